"""Reading a policy file: `load_policy`, `parse_policy` and their one error, `PolicyError` (every problem as
`file:line: message`).

What `fastload` knows (the common shape: a huge generated policy, the packaged default) it reads without YAML's node
tree; anything else the full reader (`loader`) reads, imported only then: PyYAML and the readers of the rarer
sections are some 15 ms of an `airlock run`'s start, before its sandbox exists."""

from __future__ import annotations

from pathlib import Path

from airlock.errors import AirlockError

from . import fastload
from .model import Policy


class PolicyError(AirlockError):
    def __init__(self, errors: list[str]) -> None:
        super().__init__("\n".join(errors))
        self.errors = errors


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # ValueError: undecodable bytes, or a NUL in the path
        raise PolicyError([f"{path}:1: cannot read policy: {e}"]) from None
    return parse_policy(text, str(path))


def parse_policy(text: str, filename: str = "<policy>") -> Policy:
    """The policy in `text`, or PolicyError listing every problem as `file:line: message`."""
    try:
        return _parse(text, filename)
    except PolicyError:
        raise
    except Exception as e:
        # Last resort: whatever slipped past the checks is still a bad policy, never a crash of `policy check`
        # or of the SIGHUP reload (which keeps the running policy only on PolicyError).
        raise PolicyError([f"{filename}:1: cannot load policy: {type(e).__name__}: {e}"]) from e


def _parse(text: str, filename: str) -> Policy:
    policy = fastload.read_common(text, filename)  # the common shape, read without YAML's node tree
    if policy is None:
        from . import loader

        policy = loader.read(text, filename)
    object.__setattr__(policy, "text", text)  # frozen: set once, here, as the policy is made
    # Computed with the load, so that no audit line or reload's swap pays for them on the event loop.
    policy.hash  # noqa: B018
    policy.inspected_rules  # noqa: B018
    return policy
