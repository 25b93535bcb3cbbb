"""Inspection across proxy workers: the supervisor's CA generations and the secrets a policy injects, in each
worker's start and in each reload's prepare (pickled, over the channel only), with real worker processes. A worker
adopts the supervisor's CA and never makes one: a policy no generation from the supervisor permits is refused."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import pickle
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from worker_pools import CAPS, RUNNING, RunningPool, running_pool

from airlock.gateway import Gateway
from airlock.gateway import workers as workers_module
from airlock.gateway.config import GatewayConfig
from airlock.gateway.worker_terms import WorkerSettings, worker_share
from airlock.inspection.inspector import Inspector
from airlock.inspection.trust import PUBLISHED_BUNDLE
from airlock.policy import Policy, PolicyError, Sandbox, parse_policy

SECRET = "sk-worker-inspection-0123456789"
INSPECTING = parse_policy(
    "version: 1\nprofiles:\n  default:\n    allow:\n      - host: api.test\n        inspect: true\n"
    '        inject:\n          - {header: Authorization, value: "Bearer {secret:model_api}"}\n',
    "inspecting.yaml",
)
MISSING = parse_policy(
    "version: 1\nprofiles:\n  default:\n    allow:\n      - host: api.test\n        inspect: true\n"
    '        inject:\n          - {header: X-Key, value: "{secret:not_given}"}\n',
    "missing.yaml",
)
SANDBOXES = [Sandbox("sbx", "default", ipaddress.ip_network("127.0.0.0/8"))]


def _config(tmp_path: Path, port: int = 0) -> GatewayConfig:
    return GatewayConfig(
        policy=RUNNING, listen="127.0.0.1", proxy_port=port, transparent_port=0, dns_port=0, sandboxes=SANDBOXES,
        upstream_dns=[("127.0.0.1", 9)], audit_path=str(tmp_path / "audit.jsonl"), workers=2,
    )  # fmt: skip


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[RunningPool]:
    secrets = {"model_api": SECRET, "broker_key": "never-sent"}
    async with running_pool(tmp_path, secrets, Inspector(tmp_path / "supervisor", secrets)) as pool:
        yield pool


def test_a_worker_adopts_the_supervisors_generations_and_signs_with_their_keys(tmp_path: Path) -> None:
    supervisor = Inspector(tmp_path / "supervisor", {})
    supervisor.apply(INSPECTING)
    sent = pickle.loads(pickle.dumps(supervisor.exported()))  # as the channel carries it
    worker = Inspector(tmp_path / "worker", {})
    worker.adopt(sent)
    worker.adopt(sent)  # again (the next prepare carries every generation): nothing doubled
    assert [ca.cert_pem for ca in worker.generations] == [ca.cert_pem for ca in supervisor.generations]
    leaf = worker.store_entry("api.test").cert.to_cryptography()
    ca = x509.load_pem_x509_certificate(supervisor.generations[0].cert_pem)
    public = ca.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    leaf.verify_directly_issued_by(ca)  # signed with the supervisor's key: what the sandbox trusts
    assert not (tmp_path / "worker").exists()  # the key is never written in the worker's folder
    assert worker.unsigned(INSPECTING) == []
    assert Inspector(tmp_path / "other", {}).unsigned(INSPECTING) == [
        "inspecting.yaml: inspects api.test, which no gateway CA from the supervisor permits"
    ]


def test_start_and_prepare_carry_the_generations_and_only_the_secrets_the_policy_injects(tmp_path: Path) -> None:
    secrets = {"model_api": SECRET, "broker_key": "never-sent"}
    settings = WorkerSettings(_config(tmp_path), 2, worker_share(CAPS, 2), secrets, str(tmp_path))
    inspector = Inspector(tmp_path / "supervisor", secrets)
    inspector.apply(INSPECTING)
    start = settings.start(0, {}, INSPECTING, [], None, inspector.exported())
    prepare = settings.prepare(7, INSPECTING, inspector.exported())
    for message in (start, prepare):
        assert message.secrets == {"model_api": SECRET}
        assert [g.cert_pem for g in message.cas] == [inspector.generations[0].cert_pem]
    assert settings.start(0, {}, RUNNING, [], None, []).secrets == {}
    assert prepare.generation == 7 and prepare.policy.hash == INSPECTING.hash


async def _reload(workers: RunningPool, policy: Policy) -> None:
    """As PolicyChange.put_in_force does: the generation the policy needs made in memory (`tentative`) and sent in
    the prepare, held, written and published by the supervisor's swap alone."""
    made = workers.inspector.tentative(policy)

    def swap() -> None:
        workers.inspector.apply(policy, made)
        workers.live.replace(policy)

    await workers.pool.put_in_force(policy, workers.inspector.exported(made), swap)


async def _signing(workers: RunningPool) -> list[object]:
    """The generations each worker signs with, as it tells them."""
    await workers.pool.refresh()
    return [status["ca_generations"] for status in workers.pool.status()]


def _names(inspector: Inspector) -> list[str]:
    return [ca.cert_path.stem for ca in inspector.generations]


async def test_an_inspecting_reload_with_the_supervisors_ca_is_in_force_in_every_worker(workers: RunningPool) -> None:
    await _reload(workers, INSPECTING)
    assert await workers.hashes() == [INSPECTING.hash, INSPECTING.hash]
    assert len(workers.inspector.generations) == 1
    assert await _signing(workers) == [_names(workers.inspector)] * 2


async def test_an_inspecting_reload_no_supervisor_ca_permits_is_refused_by_every_worker(workers: RunningPool) -> None:
    swapped: list[object] = []
    with pytest.raises(PolicyError) as refused:
        await workers.pool.put_in_force(INSPECTING, workers.inspector.exported(), lambda: swapped.append(INSPECTING))
    errors = refused.value.errors
    for index in (0, 1):
        assert f"proxy worker {index}: inspecting.yaml: inspects api.test, which no gateway CA" in " ".join(errors)
    assert swapped == [] and await workers.hashes() == [RUNNING.hash, RUNNING.hash]


async def test_a_reload_injecting_a_secret_the_supervisor_was_not_given_is_refused(workers: RunningPool) -> None:
    with pytest.raises(PolicyError) as refused:
        await _reload(workers, MISSING)
    assert any("injects secret 'not_given'" in e for e in refused.value.errors), refused.value.errors
    assert await workers.hashes() == [RUNNING.hash, RUNNING.hash]
    # The generation made for it was sent in the prepare: adopted by no worker, held by no one.
    assert workers.inspector.generations == [] and await _signing(workers) == [[], []]


async def test_a_restarted_worker_gets_the_generations_made_since_the_start(workers: RunningPool) -> None:
    await _reload(workers, INSPECTING)
    worker = workers.pool.workers[0]
    worker.process.kill()
    await worker.process.wait()
    # Restarted with the policy in force, which it parses and can only serve with the supervisor's CA: it serves.
    for _ in range(600):
        if workers.pool.workers[0] is not worker and workers.pool.serving() == [0, 1]:
            break
        await asyncio.sleep(0.05)
    assert workers.pool.serving() == [0, 1]
    assert await workers.hashes() == [INSPECTING.hash, INSPECTING.hash]


FIRST = parse_policy(
    "version: 1\nprofiles:\n  default:\n    allow:\n      - host: first.test\n        inspect: true\n", "first.yaml"
)
WIDER = parse_policy(
    "version: 1\nprofiles:\n  default:\n    allow:\n      - host: first.test\n        inspect: true\n"
    "      - host: api.test\n        inspect: true\n",
    "wider.yaml",
)


def _ca_files(state: Path) -> list[str]:
    return sorted(str(p.relative_to(state)) for p in (state / "ca").rglob("*"))


async def test_a_reload_the_workers_refuse_leaves_no_generation_and_the_same_one_accepted_then_makes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole gateway with two workers, its running policy inspecting first.test: a reload adding api.test (a host
    no generation permits) that the workers do not prepare in time is refused, and leaves the supervisor's
    generations, its CA files, the published bundle and each worker's generations as they were; accepted then, the
    very policy gets its generation, published, and signed with by both workers."""
    trust, state = tmp_path / "trust", tmp_path / "state"
    trust.mkdir()
    config = dataclasses.replace(_config(tmp_path), policy=FIRST, state_dir=str(state), trust_dir=str(trust))
    config = dataclasses.replace(config, broker=dataclasses.replace(config.broker, port=0))
    gateway = Gateway(config)
    await gateway.start()
    try:
        inspector = gateway.parts.inspector
        pool = gateway.parts.workers
        assert pool is not None

        async def signing() -> list[object]:
            await pool.refresh()
            return [status["ca_generations"] for status in pool.status()]

        before = (_names(inspector), _ca_files(state), (trust / PUBLISHED_BUNDLE).read_bytes(), inspector.bundle)
        assert len(before[0]) == 1 and await signing() == [before[0]] * 2
        monkeypatch.setattr(workers_module, "PREPARE_TIMEOUT", 0.0)  # no worker answers the prepare in time
        with pytest.raises(PolicyError, match="no answer within"):
            await gateway.put_in_force(WIDER)
        after = (_names(inspector), _ca_files(state), (trust / PUBLISHED_BUNDLE).read_bytes(), inspector.bundle)
        assert after == before
        assert await signing() == [before[0]] * 2
        assert gateway.parts.live.current.policy.hash == FIRST.hash

        monkeypatch.undo()
        await gateway.put_in_force(WIDER)
        names = _names(inspector)
        assert len(names) == 2 and names[0] == before[0][0]
        published = (trust / PUBLISHED_BUNDLE).read_bytes()
        assert all(ca.cert_pem in published for ca in inspector.generations)
        assert await signing() == [names] * 2
        assert [status["policy_hash"] for status in pool.status()] == [WIDER.hash, WIDER.hash]
    finally:
        await gateway.stop()
