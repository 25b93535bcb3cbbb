"""The docker e2e tests' session environment: the private daemon of airlock.verify.dockerd (in the topology's
gateway namespace) and the sandbox test image imported into it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import docker

from airlock.verify.dockerd import DockerDaemon


@dataclass
class DockerEnv:
    """The session's private docker daemon (in the gw namespace) and the imported sandbox test image."""

    host: str  # "unix:///.../docker.sock"
    image: str  # "airlock-test:<hash12>"
    client: docker.DockerClient
    env: dict[str, str]  # {"DOCKER_HOST": host}, for subprocesses (docker CLI, airlock)
    daemon: DockerDaemon
    tarball: Path  # the rootfs tarball the image was imported from
