"""The docker backend's reaper: every container and network of a sandbox found by its label and removed in
`DockerSandbox.destroy()`'s order, then its fence and token (`remove_sandbox`, also the watchdog's), and the
sandboxes whose lifetime has passed (`reap`, for `airlock reap`). A label is trusted with nothing: one that is no
sandbox id names no path and no table."""

from __future__ import annotations

import logging
import math
import shutil
import time
from datetime import datetime
from typing import Any

import docker

from . import SANDBOX_ID
from .docker import (
    EXPIRES_LABEL,
    LABEL,
    DockerSandboxError,
    fence_table,
    remove_container,
    remove_network,
    sandbox_token_dir,
)
from .fence import Fence

log = logging.getLogger("airlock.sandbox.docker_reaper")


def _labelled(sandbox_id: str) -> dict[str, str | list[str] | bool]:
    """The filter for what of the engine's is this sandbox's."""
    return {"label": f"{LABEL}={sandbox_id}"}


def remove_sandbox(client: docker.DockerClient, sandbox_id: str) -> None:
    """Everything of one docker sandbox, for the reaper: container(s) and network found by label, in
    destroy()'s order, then its fence table (never another backend's) and its token."""
    if not SANDBOX_ID.fullmatch(sandbox_id):
        raise DockerSandboxError(f"not a sandbox id: {sandbox_id!r}")
    for container_id in [c.id for c in client.containers.list(all=True, filters=_labelled(sandbox_id)) if c.id]:
        remove_container(client, container_id)
    for network_id in [n.id for n in client.networks.list(filters=_labelled(sandbox_id)) if n.id]:
        remove_network(client, network_id)
    Fence(fence_table(sandbox_id), "", "", ()).remove()
    shutil.rmtree(sandbox_token_dir(sandbox_id), ignore_errors=True)


def reap(client: docker.DockerClient, older_than: float | None = None, now: float | None = None) -> list[str]:
    """Remove airlock sandboxes whose lifetime has passed (label), or older than `older_than` seconds. A label
    that is no sandbox id is reported and skipped: it would name paths and nft tables."""
    now = time.time() if now is None else now
    victims: set[str] = set()
    for obj in [
        *client.containers.list(all=True, filters={"label": LABEL}),
        *client.networks.list(filters={"label": LABEL}),
    ]:
        labels = obj.attrs.get("Labels") or obj.attrs.get("Config", {}).get("Labels") or {}
        sandbox_id = labels.get(LABEL)
        if not sandbox_id:
            continue
        if not isinstance(sandbox_id, str) or not SANDBOX_ID.fullmatch(sandbox_id):
            log.warning("skipped %s: its %s label %r is not a sandbox id", obj.id, LABEL, sandbox_id)
            continue
        if _expired(labels, obj.attrs, now, older_than):
            victims.add(sandbox_id)
    for sandbox_id in sorted(victims):
        remove_sandbox(client, sandbox_id)
    return sorted(victims)


def _expired(labels: dict[str, str], attrs: dict[str, Any], now: float, older_than: float | None) -> bool:
    try:
        expires = float(labels.get(EXPIRES_LABEL, "0") or 0)
    except ValueError:
        expires = math.nan
    if not math.isfinite(expires):
        expires = 0.0  # unreadable: expired, like a missing label
    created = _created(attrs)
    return expires < now or (older_than is not None and created is not None and created < now - older_than)


def _created(attrs: dict[str, Any]) -> float | None:
    text = attrs.get("Created")
    if not isinstance(text, str):
        return None
    try:
        # Docker prints nanoseconds; Python parses microseconds.
        head, _, rest = text.partition(".")
        fraction = "".join(ch for ch in rest if ch.isdigit())[:6]
        return datetime.fromisoformat(f"{head}.{fraction or '0'}+00:00").timestamp()
    except ValueError:
        return None
