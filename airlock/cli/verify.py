"""`airlock verify`: the sandbox evaluation matrix. A real sandbox, launched by `airlock run` with the given policy
and options inside a fake internet of its own, runs every probe; each check is judged by evidence outside the
sandbox (airlock/verify/). Exit 0 only when every check held, 1 when one failed, 2 when one could not run."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from airlock.sandbox.limits import (
    DEFAULT_CPUS,
    DEFAULT_MEMORY,
    DEFAULT_NOFILE,
    DEFAULT_NPROC,
    DEFAULT_PIDS,
    memory_bytes,
)

from .common import NeedsRoot, UsageError, absolute, default_policy_path, load_policy_file
from .option_bounds import check_limits

LIMITS = ("cpus", "memory", "pids", "nofile", "nproc")
# airlock.verify.checks.GROUPS, light for --help
GROUPS = ("network", "files", "secrets", "inspection", "tenancy", "privilege", "resources", "broker", "destruction")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("netns", "docker"), default="netns", help="the sandbox backend verified")
    parser.add_argument(
        "--image-tarball", type=absolute, metavar="FILE",
        help="docker backend: a rootfs tarball with python3, imported as the sandbox's image (docs/verify.md)",
    )  # fmt: skip
    parser.add_argument(
        "--policy", type=absolute, metavar="FILE", help="policy file (default: the packaged configs/default.yaml)"
    )
    parser.add_argument("--profile", metavar="P", help="the profile the sandbox runs with")
    parser.add_argument("--grant", action="append", metavar="G", help="as `airlock run --grant` (repeatable)")
    parser.add_argument(
        "--secret", action="append", metavar="NAME=file:PATH|env:VAR",
        help="as `airlock run --secret` (repeatable): the inspection check sends the placeholder of one your policy "
        "injects where it must not go",
    )  # fmt: skip
    parser.add_argument(
        "--isolation", choices=("auto", "bwrap", "none"), default="auto",
        help="as `airlock run --isolation` (none: a weakened run, whose file checks fail)",
    )  # fmt: skip
    parser.add_argument("--cpus", type=float, help=f"as `airlock run` (default {DEFAULT_CPUS:g})")
    parser.add_argument("--memory", help=f"as `airlock run` (default {DEFAULT_MEMORY})")
    parser.add_argument("--pids", type=int, help=f"as `airlock run` (default {DEFAULT_PIDS})")
    parser.add_argument("--nofile", type=int, help=f"as `airlock run` (default {DEFAULT_NOFILE})")
    parser.add_argument("--nproc", type=int, help=f"as `airlock run` (default {DEFAULT_NPROC})")
    parser.add_argument("--only", action="append", choices=GROUPS, metavar="GROUP", help=f"one of {', '.join(GROUPS)}")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--json", type=absolute, metavar="FILE", help="the verdicts as JSON (docs/verify.md)")
    parser.add_argument("--junit", type=absolute, metavar="FILE", help="the verdicts as JUnit XML")
    needs = NeedsRoot("it builds a fake internet of network namespaces and runs a sandbox in it", environment)
    parser.set_defaults(func=cmd_verify, needs_root=needs)


def environment(args: argparse.Namespace) -> list[str]:
    """The variables of the host's environment verify reads: `--secret NAME=env:VAR`'s."""
    sources = [spec.partition("=")[2] for spec in args.secret or []]
    return [source.removeprefix("env:") for source in sources if source.startswith("env:")]


def run_options(args: argparse.Namespace) -> list[str]:
    """The options `airlock run` is given as they were given here (every run gets the user's secrets: a policy
    that injects one starts no gateway without it)."""
    options = ["--isolation", args.isolation] if args.backend == "netns" else []
    options += ["--profile", args.profile] if args.profile else []
    options += [word for grant in args.grant or [] for word in ("--grant", grant)]
    options += [word for spec in args.secret or [] for word in ("--secret", _absolute_secret(spec))]
    return options + [
        word for name in LIMITS if getattr(args, name) is not None for word in (f"--{name}", str(getattr(args, name)))
    ]


def _absolute_secret(spec: str) -> str:
    """`NAME=file:PATH` with PATH absolute (`airlock run` works elsewhere), `NAME=env:VAR` as it is."""
    name, _, source = spec.partition("=")
    kind, _, where = source.partition(":")
    return f"{name}=file:{os.path.abspath(where)}" if kind == "file" else spec


def user_secrets(specs: list[str]) -> dict[str, str]:
    """`--secret NAME=file:PATH|env:VAR`, each read as `airlock run` reads it: name -> value."""
    from airlock.gateway.config import BrokerConfigError, parse_secret
    from airlock.inspection import InspectionError
    from airlock.inspection.secrets import SecretValues
    from airlock.verify.targets import SECRET_NAME

    try:
        sources = [parse_secret(spec) for spec in specs]
        values = SecretValues.read(sources)
    except (BrokerConfigError, InspectionError) as e:
        raise UsageError(str(e)) from None
    if SECRET_NAME in values:
        raise UsageError(f"--secret {SECRET_NAME}: that name is verify's own secret's, give yours another")
    return {name: values[name] for name in values}


def image_tarball(args: argparse.Namespace) -> Path | None:
    """The docker backend's image tarball (None: the netns backend), checked before anything is built."""
    if args.backend == "netns":
        if args.image_tarball:
            raise UsageError("--image-tarball needs --backend docker")
        return None
    if not args.image_tarball:
        raise UsageError("--backend docker needs --image-tarball FILE (a rootfs tarball: docs/verify.md)")
    if args.isolation != "auto":
        raise UsageError("--isolation: netns backend only (the docker backend's isolation is the container's)")
    if not os.path.isfile(args.image_tarball):
        raise UsageError(f"--image-tarball {args.image_tarball}: no such file")
    from airlock.verify.dockerd import docker_problem

    if problem := docker_problem():
        raise UsageError(f"--backend docker runs a docker daemon of its own: {problem}")
    return Path(args.image_tarball)


def cmd_verify(args: argparse.Namespace) -> int:
    from airlock.verify import checks, report

    chosen = checks.selected(args.only)
    if args.list:
        print(report.listing(chosen))
        return 0
    check_limits(args)
    tarball = image_tarball(args)
    from airlock.verify.checks import Limits
    from airlock.verify.runner import Request, verify
    from airlock.verify.targets import targets

    from .run import parse_grants

    policy = load_policy_file(args.policy)
    try:
        profile = policy.profile(args.profile)
    except KeyError as e:
        raise UsageError(str(e.args[0])) from None
    secrets = user_secrets(args.secret or [])  # read once, as `airlock run` reads them, before anything is built
    if missing := sorted(policy.secret_names() - secrets.keys()):
        raise UsageError(
            f"{policy.source} injects secret {missing[0]!r}: give it as `airlock run` needs it (--secret "
            f"{missing[0]}=file:PATH), or verify a policy without the injection"
        )
    path = args.policy or str(default_policy_path())
    isolation = args.isolation if tarball is None else "container"
    how = f"isolation {isolation}" if tarball is None else f"backend docker, image {tarball}"
    print(f"airlock: verifying {path} (profile {profile.name}, {how})", file=sys.stderr)
    started = time.monotonic()
    limits = Limits(
        args.cpus or DEFAULT_CPUS, memory_bytes(args.memory or DEFAULT_MEMORY), args.pids or DEFAULT_PIDS,
        len(os.sched_getaffinity(0)), args.nproc or DEFAULT_NPROC,
    )  # fmt: skip
    grants = parse_grants(args.grant or [], policy)
    found = targets(profile, grants, list(secrets))
    user_secret = secrets[found.secret].encode() if found.injected_at else None
    outcomes = verify(Request(path, found, run_options(args), chosen, limits, tarball, user_secret))
    run = report.Run(args.backend, path, profile.name, isolation, time.monotonic() - started)
    print(report.matrix(outcomes))
    if args.json:
        report.write_json(args.json, run, outcomes)
    if args.junit:
        report.write_junit(args.junit, run, outcomes)
    code = report.exit_code(outcomes)
    if code == report.EXIT_ERROR:
        print("airlock: error: a check could not run (see ERROR above): nothing is verified", file=sys.stderr)
    return code
