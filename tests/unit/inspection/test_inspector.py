"""The gateway's side of inspection: a CA generation per new set of inspected hosts, leaves from the oldest one
that permits a host, one trust bundle per generation holding every generation, secrets a policy needs."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509

from airlock.inspection import InspectionError
from airlock.inspection.inspector import Inspector
from airlock.inspection.trust import SYSTEM_BUNDLE
from airlock.policy import Policy, parse_policy


def policy(*hosts: str, secret: str | None = None) -> Policy:
    rules = "".join(f"      - host: {h}\n        inspect: true\n" for h in hosts)
    if secret:
        rules += f'        inject:\n          - {{header: Authorization, value: "Bearer {{secret:{secret}}}"}}\n'
    return parse_policy(f"version: 1\nprofiles:\n  default:\n    allow:\n{rules}      - host: plain.example\n")


def issuer_of(inspector: Inspector, host: str) -> x509.Name:
    return inspector.store_entry(host).cert.to_cryptography().issuer


def test_nothing_is_made_while_nothing_is_inspected(tmp_path: Path) -> None:
    inspector = Inspector(tmp_path, {})
    inspector.apply(parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: plain.example\n"))
    assert not inspector.active and inspector.bundle is None and inspector.environment() == {}
    assert not (tmp_path / "ca").exists()


def test_a_reload_that_inspects_a_new_host_adds_a_generation_and_keeps_the_old_one(tmp_path: Path) -> None:
    inspector = Inspector(tmp_path, {})
    inspector.apply(policy("api.example"))
    first_bundle = inspector.bundle
    assert first_bundle is not None and len(inspector.generations) == 1
    inspector.apply(policy("api.example"))  # the same hosts: nothing new
    assert len(inspector.generations) == 1 and inspector.bundle == first_bundle
    inspector.apply(policy("api.example", "new.example"))
    old, new = inspector.generations
    assert new.hosts == {"api.example", "new.example"}
    # A sandbox of before the reload trusts the old generation only: its hosts keep coming from it.
    assert issuer_of(inspector, "api.example") == old.cert.subject
    assert issuer_of(inspector, "new.example") == new.cert.subject
    # Sandboxes from now on get a bundle with both generations (and the old bundle stays as it was).
    assert inspector.bundle != first_bundle
    loaded = x509.load_pem_x509_certificates(inspector.bundle.read_bytes())
    assert old.cert in loaded and new.cert in loaded
    assert new.cert not in x509.load_pem_x509_certificates(first_bundle.read_bytes())
    with pytest.raises(KeyError):
        inspector.store_entry("plain.example")  # never inspected: no generation may sign it


def test_the_trust_dir_holds_the_bundle_as_it_changes_and_never_a_key(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    inspector = Inspector(tmp_path / "state", {}, shared)
    plain = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: plain.example\n")
    inspector.apply(plain)  # nothing inspected yet: the system's CAs, so a client pointed at the file finds one
    published = shared / "ca-bundle.pem"
    assert published.read_bytes() == SYSTEM_BUNDLE.read_bytes()
    inspector.apply(policy("api.example"))
    assert inspector.bundle is not None and published.read_bytes() == inspector.bundle.read_bytes()
    inspector.apply(policy("api.example", "new.example"))  # a reload that inspects one more host
    assert published.read_bytes() == inspector.bundle.read_bytes()
    assert all(ca.cert in x509.load_pem_x509_certificates(published.read_bytes()) for ca in inspector.generations)
    assert [f.name for f in shared.iterdir()] == ["ca-bundle.pem"] and b"PRIVATE" not in published.read_bytes()
    assert stat.S_IMODE(published.stat().st_mode) == 0o644 and stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_a_trust_dir_that_is_a_symlink_or_missing_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    for given in (tmp_path / "link", tmp_path / "absent"):
        with pytest.raises(InspectionError, match=f"cannot publish the trust bundle to {given}"):
            Inspector(tmp_path / "state", {}, given).apply(policy("api.example"))
    assert list((tmp_path / "real").iterdir()) == []


def test_a_policy_injecting_a_secret_the_gateway_lacks_is_refused_and_the_values_are_only_those_used(
    tmp_path: Path,
) -> None:
    inspector = Inspector(tmp_path, {"model_api": "sk-1", "unused": "sk-2"})
    assert inspector.problems(policy("api.example", secret="model_api")) == []
    assert inspector.injected(policy("api.example", secret="model_api")) == {"model_api": "sk-1"}
    [problem] = inspector.problems(policy("api.example", secret="missing"))
    assert "'missing'" in problem and "--secret" in problem


def test_the_sandbox_variables_name_the_bundle_where_the_sandbox_sees_it(tmp_path: Path) -> None:
    inspector = Inspector(tmp_path, {})
    inspector.apply(policy("api.example"))
    env = inspector.environment()
    assert set(env.values()) == {"/etc/ssl/certs/ca-certificates.crt"}
    assert {"SSL_CERT_FILE", "NODE_EXTRA_CA_CERTS", "PIP_CERT", "GIT_SSL_CAINFO"} <= env.keys()


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_tentative_generation_is_nothing_until_applied_and_then_the_one_held(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    inspector = Inspector(tmp_path / "state", {}, shared)
    inspector.apply(policy("api.example"))
    before = (list(inspector.generations), inspector.bundle, _files(tmp_path))
    assert inspector.tentative(policy("api.example")) is None  # a generation permits every host already
    made = inspector.tentative(policy("api.example", "new.example"))
    assert made is not None and made.hosts == {"api.example", "new.example"}
    # Sent to the workers (after the held ones), and nothing else: not held, no file, no bundle, nothing published.
    assert [g.cert_pem for g in inspector.exported(made)] == [inspector.generations[0].cert_pem, made.cert_pem]
    assert (list(inspector.generations), inspector.bundle, _files(tmp_path)) == before
    inspector.apply(policy("api.example", "new.example"), made)
    assert inspector.generations[-1] is made and len(inspector.generations) == 2 and made.cert_path.is_file()
    assert inspector.bundle is not None and made.cert_pem in (shared / "ca-bundle.pem").read_bytes()


def test_a_generation_whose_bundle_cannot_be_published_leaves_nothing_behind(tmp_path: Path) -> None:
    """A reload refused after the inspection followed it (here: the shared folder is gone) keeps the generations,
    the files and the published bundle as they were: no generation held that the sandboxes were never handed."""
    shared = tmp_path / "shared"
    shared.mkdir()
    inspector = Inspector(tmp_path / "state", {}, shared)
    inspector.apply(policy("api.example"))
    generations, bundle, files = list(inspector.generations), inspector.bundle, _files(tmp_path)
    (shared / "ca-bundle.pem").rename(tmp_path / "kept.pem")
    shared.rmdir()
    with pytest.raises(InspectionError, match="cannot publish the trust bundle"):
        inspector.apply(policy("api.example", "new.example"))
    shared.mkdir()
    (tmp_path / "kept.pem").rename(shared / "ca-bundle.pem")
    assert (inspector.generations, inspector.bundle, _files(tmp_path)) == (generations, bundle, files)
    assert inspector.unsigned(policy("api.example", "new.example")) != []
    inspector.apply(policy("api.example", "new.example"))  # once it can be: made and published
    assert len(inspector.generations) == 2
    assert inspector.generations[1].cert_pem in (shared / "ca-bundle.pem").read_bytes()
