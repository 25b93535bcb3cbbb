"""The tools a sandbox may call through the broker: names, descriptions and input JSON Schemas (draft 2020-12).

Every call's input is validated against its tool's schema (`jsonschema`) before anything else looks at it; a
violation names the first bad field as a JSON Pointer. The schemas say what an input is made of; what depends on
the token (its grants) or on GitHub is checked afterwards, by the broker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

MAX_TITLE = 256
MAX_BODY = 65536
# The grant's own rules (broker.grants.REPO) are stricter still (e.g. no "." or ".." as a name); they are
# checked after the schema.
REPO: dict[str, Any] = {
    "type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9-]{0,38}/[A-Za-z0-9._-]{1,100}$",
    "description": "owner/name of a GitHub repository the token's grant names",
}  # fmt: skip
BRANCH: dict[str, Any] = {"type": "string", "minLength": 1, "maxLength": 255}
NUMBER: dict[str, Any] = {
    "type": "integer", "minimum": 1, "maximum": 2**31 - 1,
    "description": "the pull request's number, as create_pull_request returned it",
}  # fmt: skip


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    input_schema: dict[str, Any]
    _validator: Draft202012Validator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        Draft202012Validator.check_schema(self.input_schema)
        object.__setattr__(self, "_validator", Draft202012Validator(self.input_schema))

    def problem(self, value: Any) -> tuple[str, str] | None:
        """(JSON Pointer of the bad field, what is wrong with it) for the most relevant violation, or None."""
        error = best_match(self._validator.iter_errors(value))
        return None if error is None else _described(error)


CREATE_PULL_REQUEST = ToolSpec(
    "create_pull_request",
    "Open a pull request from a head branch (already on GitHub, e.g. pushed with push_branch) into a base branch. "
    "If one is already open for the same head and base, it is returned (existing: true). Send an "
    "Idempotency-Key header to make retries safe.",
    {
        "type": "object",
        "properties": {
            "repo": REPO,
            "head": BRANCH | {"description": "the branch with the changes; must match the grant's head pattern"},
            "base": BRANCH | {"description": "the branch to merge into; one of the grant's base branches"},
            "title": {"type": "string", "minLength": 1, "maxLength": MAX_TITLE},
            "body": {"type": "string", "maxLength": MAX_BODY},
            "draft": {"type": "boolean"},
        },
        "required": ["repo", "head", "base", "title"],
        "additionalProperties": False,
    },
)

PUSH_BRANCH = ToolSpec(
    "push_branch",
    "Push commits to a branch: send them as a git bundle (`git bundle create out.bundle main..HEAD`), base64. "
    "The bundle carries exactly one ref (HEAD or refs/heads/<branch>); the commits it builds on must already be on "
    "GitHub. The branch must match the grant's head pattern and never be a base, protected or default branch; it "
    "must not exist yet or be an ancestor of the new commit (never a force push). Returns the pushed sha and ref; "
    "pushing the same bundle again changes nothing.",
    {
        "type": "object",
        "properties": {
            "repo": REPO,
            "branch": BRANCH | {"description": "the branch to create or fast-forward, e.g. agent/fix-1"},
            "bundle": {
                "type": "string",
                "minLength": 1,
                "contentEncoding": "base64",
                "contentMediaType": "application/x-git-bundle",
                "description": "the git bundle, base64 (standard alphabet, with padding)",
            },
        },
        "required": ["repo", "branch", "bundle"],
        "additionalProperties": False,
    },
)

GET_PULL_REQUEST = ToolSpec(
    "get_pull_request",
    "The state of a pull request this sandbox opened with create_pull_request (any other answers 404): state, "
    "merged, mergeable (null while GitHub computes it), its head commit, and a summary of that commit's check runs "
    '(counts by conclusion, "pending" for runs not finished, and the names of the failing ones).',
    {
        "type": "object",
        "properties": {"repo": REPO, "number": NUMBER},
        "required": ["repo", "number"],
        "additionalProperties": False,
    },
)

COMMENT_ON_PULL_REQUEST = ToolSpec(
    "comment_on_pull_request",
    "Add a comment to a pull request this sandbox opened with create_pull_request (any other answers 404). Send "
    "an Idempotency-Key header to make retries safe; without one, each call is a new comment.",
    {
        "type": "object",
        "properties": {
            "repo": REPO,
            "number": NUMBER,
            "body": {"type": "string", "minLength": 1, "maxLength": MAX_BODY, "description": "the comment (Markdown)"},
        },
        "required": ["repo", "number", "body"],
        "additionalProperties": False,
    },
)

TOOLS = {tool.name: tool for tool in (CREATE_PULL_REQUEST, PUSH_BRANCH, GET_PULL_REQUEST, COMMENT_ON_PULL_REQUEST)}

_KINDS = {"object": "an object", "array": "an array", "string": "a string", "boolean": "a boolean",
          "integer": "an integer", "number": "a number", "null": "null"}  # fmt: skip


def _pointer(parts: Any) -> str:
    return "".join(f"/{str(p).replace('~', '~0').replace('/', '~1')}" for p in parts)


def _described(error: ValidationError) -> tuple[str, str]:
    """Where and what, in words of our own: jsonschema's messages quote the value, which may be megabytes, or a
    secret the caller pasted by mistake."""
    path = _pointer(error.absolute_path)
    # jsonschema types these as "maybe unset"; a ValidationError raised by validation always has them.
    keyword, expected, instance = str(error.validator), cast(Any, error.validator_value), error.instance
    schema = error.schema if isinstance(error.schema, dict) else {}
    if keyword == "required" and isinstance(instance, dict):
        missing = next((name for name in expected if name not in instance), "?")
        return f"{path}/{missing}", "is required"
    if keyword == "additionalProperties" and isinstance(instance, dict):
        known = schema.get("properties", {})
        extra = sorted(name for name in instance if name not in known)
        return f"{path}/{extra[0] if extra else '?'}", "is not a field of this tool's input"
    if keyword == "type":
        kinds = expected if isinstance(expected, list) else [expected]
        return path, "must be " + " or ".join(_KINDS.get(str(k), str(k)) for k in kinds)
    if keyword == "minLength":
        return path, f"must be at least {expected} character{'s' if expected != 1 else ''}"
    if keyword == "maxLength":
        return path, f"must be at most {expected} characters"
    if keyword in ("minimum", "maximum"):
        return path, f"must be at {'least' if keyword == 'minimum' else 'most'} {expected}"
    if keyword == "pattern":
        return path, f"must match {expected}"
    return path, f"does not satisfy the schema's {keyword!r}"
