"""`airlock reap`: remove sandboxes whose lifetime has passed (docker labels) and leftovers of crashed runs
(netns sandboxes' namespaces, links, fences and cgroups)."""

from __future__ import annotations

import argparse
import sys

from .common import DOCKER_ENVIRONMENT, NeedsRoot, duration


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--older-than", type=duration, metavar="DURATION", help="also anything older than this")
    needs = NeedsRoot("it removes namespaces, nftables fences and cgroups", lambda args: DOCKER_ENVIRONMENT)
    parser.set_defaults(func=cmd_reap, needs_root=needs)


def cmd_reap(args: argparse.Namespace) -> int:
    removed = [f"docker {s}" for s in reap_docker(args.older_than)]
    if args.older_than is not None:
        from airlock.sandbox.cgroups import reap_groups
        from airlock.sandbox.netns import has_namespace, reap_netns

        removed += [f"netns {s}" for s in reap_netns(args.older_than)]
        # After the namespaces: the groups of those just removed go in the same run.
        removed += [f"cgroup {s}" for s in reap_groups(args.older_than, has_namespace)]
    for item in removed:
        print(f"removed {item}")
    return 0


def reap_docker(older_than: int | None) -> list[str]:
    """The docker sandboxes removed; none (said on stderr) when no docker engine answers."""
    import docker

    from airlock.sandbox.docker_reaper import reap

    try:
        client = docker.from_env()
        client.ping()
        return reap(client, older_than)
    except docker.errors.DockerException:
        print("airlock reap: no docker engine answers; docker sandboxes not checked", file=sys.stderr)
        return []
