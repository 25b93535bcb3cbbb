"""podspec.py, the pod spec's translation into `docker run` flags, without docker: the sandbox pod's containers come
out with every field of theirs, and whatever it cannot translate is an error, never dropped."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from podspec import Node, PodSpecError, check_pod, cpu, load_pod_spec, memory, run_argv, volume_commands

SPEC = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "sandbox-pod.yaml"
FILES = {"airlock-policy": {"policy.yaml": "version: 1\n"}, "airlock-sandbox-broker-token": {"token": "t\n"}}


@pytest.fixture
def spec() -> dict[str, Any]:
    return load_pod_spec(SPEC)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    (tmp_path / "seccomp" / "airlock").mkdir(parents=True)
    (tmp_path / "seccomp" / "airlock" / "agent.json").write_text('{"defaultAction": "SCMP_ACT_ERRNO"}')
    return Node(pod="p", network="p-pause", files_dir=tmp_path / "files", seccomp_root=tmp_path / "seccomp",
                images={"airlock-agent:0.1.0": "airlock-test:abc"}, commands={"agent": ["sleep", "infinity"]},
                files=FILES)  # fmt: skip


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in [*spec["initContainers"], *spec["containers"]] if c["name"] == name)


def translate(spec: dict[str, Any], node: Node) -> dict[str, list[str]]:
    """Each container's `docker run` arguments, as the pod test makes them."""
    check_pod(spec)
    _, sources = volume_commands(spec, node)
    containers = [*spec["initContainers"], *spec["containers"]]
    return {c["name"]: run_argv(c, spec, node, sources, detach=True) for c in containers}


def argv_of(spec: dict[str, Any], node: Node, name: str) -> list[str]:
    return translate(spec, node)[name]


def test_the_fence_runs_as_root_with_net_admin_alone(spec: dict[str, Any], node: Node) -> None:
    argv = argv_of(spec, node, "airlock-fence")
    assert argv[:5] == ["run", "--name=p-airlock-fence", "--network=container:p-pause", "--pull=never", "--detach"]
    assert {"--user=0:0", "--security-opt=no-new-privileges", "--read-only", "--cap-drop=ALL", "--cap-add=NET_ADMIN",
            "--cpu-shares=10", "--memory-reservation=33554432", "--cpus=1",
            "--memory=67108864"} <= set(argv)  # fmt: skip
    image = argv.index("airlock:0.1.0")
    assert argv[image + 1 :][:3] == ["fence", "--pod", "--gateway-uid"] and "--restart=always" not in argv


def test_the_gateway_is_a_sidecar_with_its_volumes(spec: dict[str, Any], node: Node) -> None:
    argv = argv_of(spec, node, "airlock-gateway")
    assert "--restart=always" in argv and "--user=10001:10001" in argv and "--cap-add=NET_ADMIN" not in argv
    mounts = [a for a in argv if a.startswith("--mount=")]
    assert mounts == [
        f"--mount=type=bind,src={node.files_dir}/policy,dst=/etc/airlock/policy,readonly",
        f"--mount=type=bind,src={node.files_dir}/broker-token,dst=/var/run/airlock/broker,readonly",
        "--mount=type=volume,src=p-gateway-state,dst=/var/lib/airlock",
        "--mount=type=volume,src=p-trust,dst=/var/run/airlock/trust",
    ]
    assert (node.files_dir / "broker-token" / "token").stat().st_mode & 0o777 == 0o444  # the secret's defaultMode
    assert (node.files_dir / "policy" / "policy.yaml").read_text() == "version: 1\n"


def test_the_agent_is_hardened_and_runs_the_nodes_command(spec: dict[str, Any], node: Node) -> None:
    argv = argv_of(spec, node, "agent")
    assert {"--user=10002:10002", "--read-only", "--cap-drop=ALL", "--security-opt=no-new-privileges",
            f"--security-opt=seccomp={node.seccomp_root}/airlock/agent.json", "--workdir=/workspace",
            "--env=HTTPS_PROXY=http://127.0.0.1:3128", "--memory=2147483648", "--cpus=2"} <= set(argv)  # fmt: skip
    assert argv[-3:] == ["airlock-test:abc", "sleep", "infinity"]
    assert "--mount=type=volume,src=p-trust,dst=/var/run/airlock/trust,readonly" in argv


def test_the_emptydirs_are_tmpfs_volumes_with_their_size(spec: dict[str, Any], node: Node) -> None:
    creates, _ = volume_commands(spec, node)
    assert [c[-1] for c in creates] == ["p-gateway-state", "p-trust", "p-workspace", "p-tmp"]
    assert creates[0] == ["volume", "create", "--driver", "local", "--opt", "type=tmpfs", "--opt", "device=tmpfs",
                          "--opt", "o=mode=0777,size=67108864", "p-gateway-state"]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda s: container(s, "agent").update(stdin=True), "container agent: stdin not translated"),
        (lambda s: container(s, "agent")["securityContext"].update(privileged=False), "privileged not translated"),
        (lambda s: container(s, "agent")["securityContext"].pop("runAsUser"), "runAsNonRoot, but runAsUser is None"),
        (lambda s: container(s, "airlock-gateway")["securityContext"].update(runAsUser=0), "runAsUser is 0"),
        (lambda s: container(s, "agent")["env"].append({"name": "X", "valueFrom": {}}), "valueFrom not translated"),
        (lambda s: container(s, "agent")["resources"]["limits"].update({"nvidia.com/gpu": 1}), "nvidia.com/gpu"),
        (lambda s: container(s, "agent")["securityContext"].update(readOnlyRootFilesystem=False), "ephemeral-storage"),
        (lambda s: container(s, "agent")["securityContext"]["seccompProfile"].update(type="Unconfined"), "Unconfined"),
        (lambda s: container(s, "agent").update(args=["x"]), "the node may not give another"),
        (lambda s: s.update(hostNetwork=True), "the pod: hostNetwork not translated"),
        (lambda s: s.update(shareProcessNamespace=True), "shareProcessNamespace: True (only False is translated)"),
        (lambda s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}), "volume h: hostPath"),
        (lambda s: s["volumes"][0]["configMap"].update(name="other"), "the node has no configMap 'other'"),
    ],
)
def test_what_it_cannot_translate_is_an_error(spec: dict[str, Any], node: Node, edit: Any, says: str) -> None:
    changed = copy.deepcopy(spec)
    edit(changed)
    translate(copy.deepcopy(spec), node)  # the spec as it is translates
    with pytest.raises(PodSpecError) as info:
        translate(changed, replace(node, files_dir=node.files_dir.with_name("files2")))
    assert says in str(info.value)


@pytest.mark.parametrize(("text", "cpus"), [("250m", 0.25), ("2", 2.0), (1, 1.0), ("1.5", 1.5)])
def test_cpu_quantities(text: str, cpus: float) -> None:
    assert cpu(text) == cpus


@pytest.mark.parametrize(("text", "size"), [("64Mi", 64 * 2**20), ("2Gi", 2 * 2**30), ("1G", 10**9), ("512", 512)])
def test_memory_quantities(text: str, size: int) -> None:
    assert memory(text) == size


@pytest.mark.parametrize("text", ["1.5x", "-1", "", "10m"])
def test_a_quantity_it_cannot_read_is_an_error(text: str) -> None:
    with pytest.raises(PodSpecError):
        memory(text)
