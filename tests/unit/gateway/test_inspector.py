"""The gateway's side of inspection: a CA generation per new set of inspected hosts, leaves from the oldest one
that permits a host, one trust bundle per generation holding every generation, secrets a policy needs."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography import x509

from airlock.gateway.inspector import Inspector
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
