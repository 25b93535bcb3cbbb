"""A Kubernetes pod spec as `docker run` flags: each container of deploy/kubernetes/base/sandbox-pod.yaml becomes one
container joined to the network namespace of a pause container, as a kubelet runs a pod.

What it translates (the fields of a container and of the pod that the sandbox pod uses):
- image (through the node's `images` map), command (--entrypoint, the rest before args), args, workingDir, env
  values, restartPolicy Always (a native sidecar: --restart always; the kubelet restarts it, docker too);
- securityContext: runAsUser/runAsGroup (--user), runAsNonRoot (checked: a root user is refused, as the kubelet
  refuses it), allowPrivilegeEscalation false (no-new-privileges), readOnlyRootFilesystem (--read-only),
  capabilities drop/add, seccompProfile RuntimeDefault (docker's default) or Localhost (a file under the node's
  seccomp root); the pod's runAsNonRoot and seccompProfile where a container has none of its own;
- resources: requests (cpu as --cpu-shares, the kubelet's 1024 per CPU; memory as --memory-reservation), limits
  (--cpus, --memory; ephemeral-storage only with a read-only root, where the only writable storage is the pod's
  volumes, each with its own size limit);
- volumes: emptyDir (a docker volume on tmpfs, shared by the pod's containers, mode 0777 as an emptyDir is; its
  sizeLimit a hard size, stricter than the kubelet's eviction; without medium Memory too, for the same reason),
  configMap and secret (files the node provides, in a folder bind-mounted read-only; secret's defaultMode; an
  optional one the node lacks is an empty folder);
- the pod's automountServiceAccountToken and enableServiceLinks false, shareProcessNamespace false (docker's
  default: a PID namespace per container), restartPolicy Never (the containers' default).

Anything else — a field it does not know, or a value it cannot honour — is a PodSpecError: never silently dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

POD_KEYS = {"automountServiceAccountToken", "enableServiceLinks", "shareProcessNamespace", "restartPolicy",
            "securityContext", "initContainers", "containers", "volumes"}  # fmt: skip
POD_SECURITY_KEYS = {"runAsNonRoot", "seccompProfile"}
CONTAINER_KEYS = {"name", "image", "command", "args", "restartPolicy", "securityContext", "resources", "env",
                  "workingDir", "volumeMounts"}  # fmt: skip
SECURITY_KEYS = {"runAsUser", "runAsGroup", "runAsNonRoot", "allowPrivilegeEscalation", "readOnlyRootFilesystem",
                 "capabilities", "seccompProfile"}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}  # fmt: skip


class PodSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Node:
    """What the node gives a pod beyond its spec."""

    pod: str  # the pod's name: the prefix of its containers' and volumes' names
    network: str  # the pause container, whose network namespace the containers join
    files_dir: Path  # where configMaps and secrets are written, one folder each
    seccomp_root: Path  # the kubelet's seccomp folder: Localhost profiles are relative to it
    images: Mapping[str, str] = field(default_factory=dict)  # image in the spec -> local image
    commands: Mapping[str, Sequence[str]] = field(default_factory=dict)  # container -> what its image would run
    files: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # configMap/secret name -> {key: content}
    mounts: Sequence[str] = ()  # --mount values every container gets (the kubelet's resolv.conf, say)


def load_pod_spec(path: Path) -> dict[str, Any]:
    """The pod spec of a PodTemplate (or of a Pod) in `path`."""
    document = yaml.safe_load(path.read_text())
    kind = document.get("kind")
    if kind == "PodTemplate":
        return dict(document["template"]["spec"])
    if kind == "Pod":
        return dict(document["spec"])
    raise PodSpecError(f"{path}: a {kind}, not a Pod or a PodTemplate")


def check_pod(spec: Mapping[str, Any]) -> None:
    """Refuse the pod fields this translation cannot honour."""
    _known("the pod", spec, POD_KEYS)
    _known("the pod's securityContext", spec.get("securityContext", {}), POD_SECURITY_KEYS)
    wanted = {"automountServiceAccountToken": False, "enableServiceLinks": False, "shareProcessNamespace": False,
              "restartPolicy": "Never"}  # fmt: skip
    for key, value in wanted.items():
        if key in spec and spec[key] != value:
            raise PodSpecError(f"the pod's {key}: {spec[key]!r} (only {value!r} is translated)")


def volume_commands(spec: Mapping[str, Any], node: Node) -> tuple[list[list[str]], dict[str, str]]:
    """`docker volume create` argvs for the pod's emptyDirs (configMaps and secrets written into node.files_dir),
    and each volume's --mount source: name -> "type=...,src=..."."""
    creates, sources = [], {}
    for volume in spec.get("volumes", []):
        name = volume["name"]
        kinds = set(volume) - {"name"}
        if len(kinds) != 1:
            raise PodSpecError(f"volume {name}: want one source, got {sorted(kinds)}")
        kind = kinds.pop()
        if kind == "emptyDir":
            creates.append(_empty_dir(f"{node.pod}-{name}", volume["emptyDir"]))
            sources[name] = f"type=volume,src={node.pod}-{name}"
        elif kind in ("configMap", "secret"):
            sources[name] = f"type=bind,src={_files(name, kind, volume[kind], node)}"
        else:
            raise PodSpecError(f"volume {name}: {kind} is not translated")
    return creates, sources


def _empty_dir(docker_name: str, options: Mapping[str, Any]) -> list[str]:
    _known(f"emptyDir {docker_name}", options, {"medium", "sizeLimit"})
    if options.get("medium") not in (None, "Memory"):
        raise PodSpecError(f"emptyDir {docker_name}: medium {options['medium']!r} is not translated")
    size = f",size={memory(options['sizeLimit'])}" if "sizeLimit" in options else ""
    return ["volume", "create", "--driver", "local", "--opt", "type=tmpfs", "--opt", "device=tmpfs",
            "--opt", f"o=mode=0777{size}", docker_name]  # fmt: skip


def _files(name: str, kind: str, source: Mapping[str, Any], node: Node) -> Path:
    _known(f"{kind} volume {name}", source, {"name", "secretName", "defaultMode", "optional"})
    ref = source.get("secretName" if kind == "secret" else "name")
    if ref not in node.files and not source.get("optional", False):
        raise PodSpecError(f"{kind} volume {name}: the node has no {kind} {ref!r}")
    folder = node.files_dir / name
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    for key, content in node.files.get(ref, {}).items():  # an optional one the node lacks: an empty folder
        (folder / key).write_text(content)
        (folder / key).chmod(source.get("defaultMode", 0o644))
    return folder


def run_argv(container: Mapping[str, Any], spec: Mapping[str, Any], node: Node, sources: Mapping[str, str],
             *, detach: bool) -> list[str]:  # fmt: skip
    """The `docker run` arguments (after `docker`) of one container of the pod."""
    name = container["name"]
    _known(f"container {name}", container, CONTAINER_KEYS)
    argv = ["run", f"--name={node.pod}-{name}", f"--network=container:{node.network}", "--pull=never"]
    argv += ["--detach"] if detach else []
    if container.get("restartPolicy") not in (None, "Always"):
        raise PodSpecError(f"container {name}: restartPolicy {container['restartPolicy']!r} is not translated")
    if container.get("restartPolicy") == "Always":
        argv.append("--restart=always")
    argv += _security(name, container.get("securityContext", {}), spec.get("securityContext", {}), node)
    argv += _resources(name, container.get("resources", {}), container.get("securityContext", {}))
    for variable in container.get("env", []):
        _known(f"container {name}'s env", variable, {"name", "value"})
        argv.append(f"--env={variable['name']}={variable['value']}")
    if "workingDir" in container:
        argv.append(f"--workdir={container['workingDir']}")
    for mount in container.get("volumeMounts", []):
        _known(f"container {name}'s volumeMounts", mount, {"name", "mountPath", "readOnly"})
        if mount["name"] not in sources:
            raise PodSpecError(f"container {name}: no volume {mount['name']!r} in the pod")
        readonly = ",readonly" if mount.get("readOnly") else ""
        argv.append(f"--mount={sources[mount['name']]},dst={mount['mountPath']}{readonly}")
    argv += [f"--mount={extra}" for extra in node.mounts]
    return argv + _command(name, container, node)


def _security(name: str, context: Mapping[str, Any], pod: Mapping[str, Any], node: Node) -> list[str]:
    _known(f"container {name}'s securityContext", context, SECURITY_KEYS)
    argv = []
    uid = context.get("runAsUser")
    non_root = context.get("runAsNonRoot", pod.get("runAsNonRoot", False))
    if non_root and not uid:  # the kubelet refuses to start it (an unset user could be the image's root)
        raise PodSpecError(f"container {name}: runAsNonRoot, but runAsUser is {uid!r}")
    if uid is not None:
        argv.append(f"--user={uid}:{context.get('runAsGroup', uid)}")
    elif "runAsGroup" in context:
        raise PodSpecError(f"container {name}: runAsGroup without runAsUser is not translated")
    if context.get("allowPrivilegeEscalation", True) is False:
        argv.append("--security-opt=no-new-privileges")
    if context.get("readOnlyRootFilesystem"):
        argv.append("--read-only")
    capabilities = context.get("capabilities", {})
    _known(f"container {name}'s capabilities", capabilities, {"drop", "add"})
    argv += [f"--cap-drop={cap}" for cap in capabilities.get("drop", [])]
    argv += [f"--cap-add={cap}" for cap in capabilities.get("add", [])]
    argv += _seccomp(name, context.get("seccompProfile", pod.get("seccompProfile")), node)
    return argv


def _seccomp(name: str, profile: Mapping[str, Any] | None, node: Node) -> list[str]:
    if profile is None or profile == {"type": "RuntimeDefault"}:
        return []  # docker's default profile, which RuntimeDefault is
    _known(f"container {name}'s seccompProfile", profile, {"type", "localhostProfile"})
    if profile.get("type") != "Localhost":
        raise PodSpecError(f"container {name}: seccompProfile {profile.get('type')!r} is not translated")
    path = node.seccomp_root / profile["localhostProfile"]
    json.loads(path.read_text())  # the kubelet refuses a missing or broken profile; so does this
    return [f"--security-opt=seccomp={path}"]


def _resources(name: str, resources: Mapping[str, Any], context: Mapping[str, Any]) -> list[str]:
    _known(f"container {name}'s resources", resources, {"requests", "limits"})
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    _known(f"container {name}'s requests", requests, {"cpu", "memory"})
    _known(f"container {name}'s limits", limits, {"cpu", "memory", "ephemeral-storage"})
    argv = []
    if "cpu" in requests:
        argv.append(f"--cpu-shares={max(2, round(cpu(requests['cpu']) * 1024))}")  # the kubelet's cpu.shares
    if "memory" in requests:
        argv.append(f"--memory-reservation={memory(requests['memory'])}")
    if "cpu" in limits:
        argv.append(f"--cpus={cpu(limits['cpu']):g}")
    if "memory" in limits:
        argv.append(f"--memory={memory(limits['memory'])}")
    if "ephemeral-storage" in limits and not context.get("readOnlyRootFilesystem"):
        raise PodSpecError(f"container {name}: an ephemeral-storage limit is translated only with a read-only root")
    return argv


def _command(name: str, container: Mapping[str, Any], node: Node) -> list[str]:
    image = node.images.get(container["image"], container["image"])
    command, args = list(container.get("command", [])), [str(a) for a in container.get("args", [])]
    if name in node.commands:
        if command or args:
            raise PodSpecError(f"container {name}: the spec gives its command; the node may not give another")
        return [image, *node.commands[name]]
    if command:
        return [f"--entrypoint={command[0]}", image, *command[1:], *args]
    return [image, *args]


def cpu(quantity: str | int | float) -> float:
    """A CPU quantity ("250m", "2") in CPUs."""
    number, suffix = _quantity(quantity)
    if suffix not in (None, "m"):
        raise PodSpecError(f"cpu {quantity!r}: want millicores (250m) or cores (2)")
    return number / 1000 if suffix == "m" else number


def memory(quantity: str | int) -> int:
    """A memory quantity ("64Mi", "2Gi", "1G") in bytes."""
    number, suffix = _quantity(quantity)
    if suffix == "m":
        raise PodSpecError(f"memory {quantity!r}: millibytes are not translated")
    return int(number * _FACTORS[suffix])


def _quantity(quantity: str | int | float) -> tuple[float, str | None]:
    match = _QUANTITY.match(str(quantity))
    if not match:
        raise PodSpecError(f"{quantity!r} is not a Kubernetes quantity")
    return float(match.group(1)), match.group(2)


def _known(what: str, mapping: Mapping[str, Any], keys: set[str]) -> None:
    unknown = set(mapping) - keys
    if unknown:
        raise PodSpecError(f"{what}: {', '.join(sorted(unknown))} not translated")
