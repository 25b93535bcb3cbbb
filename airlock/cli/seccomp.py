"""`airlock seccomp-profile`: airlock's seccomp profile as the JSON docker and the kubelet read (docker's default
minus every system call airlock refuses: airlock/sandbox/seccomp.py). A Kubernetes node installs it as
/var/lib/kubelet/seccomp/airlock/agent.json, the sandbox pod's `Localhost` profile for the agent's container."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(func=cmd_seccomp_profile)


def cmd_seccomp_profile(args: argparse.Namespace) -> int:
    from airlock.sandbox.seccomp import docker_profile

    print(json.dumps(docker_profile(), indent=2))
    return 0
