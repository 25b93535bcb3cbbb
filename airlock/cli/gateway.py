"""`airlock gateway`: the gateway alone, in the foreground, for a sandbox launcher of your own — and the gateway
options `airlock run` shares, turned into the library's `GatewayConfig`."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import logging
import os
import signal
import socket
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from airlock.dns.servers import parse_server
from airlock.gateway.config import (
    BrokerConfig,
    BrokerConfigError,
    GatewayConfig,
    RelayConfig,
    admin_endpoint,
    parse_secret,
)
from airlock.gateway.reload import PolicyWatcher, Signature, file_signature, log_reload
from airlock.gateway.startup.collection import paused_collection
from airlock.policy import Policy, Sandbox, format_host_port
from airlock.runs import registered

from . import pod_ports
from .common import (
    DEFAULT_STATE_DIR,
    EXIT_INTERRUPTED,
    UsageError,
    absolute,
    duration,
    load_policy_file,
    signal_future,
)
from .option_bounds import check_limits

if TYPE_CHECKING:  # `airlock run` builds a config before its sandbox exists; the gateway is imported meanwhile
    from airlock.gateway import Gateway
    from airlock.inspection.secrets import SecretSource

log = logging.getLogger("airlock")
POD_ADMIN = f"{pod_ports.LISTEN}:{pod_ports.ADMIN_PORT}"  # --admin with --pod


def add_gateway_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy", type=absolute, metavar="FILE", help="policy file (default: the packaged configs/default.yaml)"
    )
    parser.add_argument("--profile", metavar="P", help="profile for sandboxes that do not name one")
    parser.add_argument("--proxy-port", type=int, default=pod_ports.PROXY_PORT, metavar="PORT")
    parser.add_argument(
        "--transparent-port", type=int, default=pod_ports.TRANSPARENT_PORT, metavar="PORT",
        help="where the fence redirects clients that ignore the proxy variables; 0 turns transparent mode off",
    )  # fmt: skip
    parser.add_argument("--upstream-dns", action="append", metavar="IP[:PORT]", help="repeatable")
    parser.add_argument(
        "--upstream-ca", type=absolute, metavar="FILE", help="CA bundle for upstream TLS the gateway verifies"
    )
    parser.add_argument(
        "--audit", type=audit_destination, metavar="FILE",
        help="append one JSON line per decision to FILE ('-': stdout); SIGUSR1 reopens it (log rotation)",
    )  # fmt: skip
    parser.add_argument("--connect-timeout", type=float, default=10.0, metavar="S")
    parser.add_argument("--idle-timeout", type=float, default=300.0, metavar="S")
    parser.add_argument(
        "--max-tunnels", type=int, metavar="N", help="open tunnels per sandbox (default: 7/8 of --max-connections)"
    )
    parser.add_argument(
        "--max-connections", type=int, metavar="N",
        help="open proxy connections per sandbox (default: 4096, or what the open-file limit allows)",
    )  # fmt: skip
    parser.add_argument("--dns-port", type=int, default=53, metavar="PORT", help="sandbox DNS; 0 turns it off")
    parser.add_argument("--dns-rate", type=float, default=100.0, metavar="QPS", help="DNS queries/s per sandbox")
    parser.add_argument("--state-dir", type=absolute, metavar="DIR", help="keys, broker state, admin socket")
    parser.add_argument(
        "--broker-port", type=int, default=pod_ports.RELAY_PORT, metavar="PORT", help="0 turns the broker off"
    )
    parser.add_argument(
        "--admin", "--broker-admin", dest="admin", type=admin_address, metavar="SOCKET|127.0.0.1:PORT",
        help="the admin listener (policy reload, status, tokens); default: STATE_DIR/admin.sock",
    )  # fmt: skip
    parser.add_argument(
        "--broker-max-connections", type=int, default=32, metavar="N", help="open broker connections per address"
    )
    parser.add_argument(
        "--secret", action="append", metavar="NAME=file:PATH|env:VAR",
        help="a secret the policy's declared tools name (repeatable); never shown to a sandbox",
    )  # fmt: skip
    add_broker_options(parser)
    parser.add_argument("--dns-min-ttl", type=int, default=5, metavar="S", help="shortest time an answer is cached")
    parser.add_argument(
        "--approval-webhook", type=http_url, metavar="URL",
        help="post each request held for approval (on_unlisted: ask) to URL as JSON",
    )  # fmt: skip
    parser.add_argument(
        "--close-denied-on-reload", action="store_true", help="a policy reload closes open tunnels it denies"
    )


def add_broker_options(parser: argparse.ArgumentParser) -> None:
    """What a broker is told, in a gateway (`airlock gateway`, `airlock run`) or alone (`airlock broker`)."""
    parser.add_argument(
        "--call-log", type=absolute, metavar="DIR",
        help=f"where every brokered call is recorded with a SQLite store (default: STATE_DIR/calls, else "
        f"{DEFAULT_STATE_DIR}/calls)",
    )  # fmt: skip
    parser.add_argument(
        "--store", type=store_url, metavar="URL",
        help="the broker's state: sqlite:///PATH (default: STATE_DIR/broker.sqlite3) or postgresql://USER@HOST/DB "
        "(shared by replicas; no password in it)",
    )  # fmt: skip
    parser.add_argument(
        "--store-password-file", type=absolute, metavar="FILE",
        help="the database's password (else libpq's PGPASSWORD, PGPASSFILE, ~/.pgpass)",
    )  # fmt: skip
    parser.add_argument(
        "--signing-key", action="append", type=absolute, metavar="PEM",
        help="an Ed25519 private key file tokens are signed with (repeatable: the first signs, all verify; the same "
        "files for every replica); default: keys made in STATE_DIR/keys",
    )  # fmt: skip
    parser.add_argument("--active-kid", metavar="KID", help="the --signing-key that signs (default: the first)")
    parser.add_argument(
        "--audience", metavar="URL",
        help="the broker's URL as its clients reach it, its tokens' audience (every replica the same)",
    )  # fmt: skip
    parser.add_argument("--github-api", default="https://api.github.com", metavar="URL")
    parser.add_argument("--github-app-id", metavar="ID")
    parser.add_argument("--github-app-key", type=absolute, metavar="PEM", help="the GitHub App's private key file")
    parser.add_argument("--github-installation-id", type=int, metavar="ID", help="default: looked up per repo")
    parser.add_argument(
        "--github-token-file", type=absolute, metavar="FILE", help="static-token mode (GitHub Enterprise)"
    )
    parser.add_argument("--github-token-env", metavar="VAR", help="static-token mode, from an environment variable")
    parser.add_argument("--github-timeout", type=float, default=10.0, metavar="S")
    parser.add_argument("--token-ttl", type=duration, default=900, metavar="DURATION", help="e.g. 15m")
    parser.add_argument("--token-max-ttl", type=duration, default=3600, metavar="DURATION")


def store_url(text: str) -> str:
    """`--store`: sqlite:///PATH or a PostgreSQL URL, never with a password (a command line is every user's)."""
    scheme = text.partition("://")[0]
    if scheme == "sqlite" and text.startswith("sqlite:///"):
        return text
    if scheme not in ("postgresql", "postgres"):
        raise argparse.ArgumentTypeError(f"{text!r}: give sqlite:///PATH or postgresql://USER@HOST/DB")
    from airlock.broker.pgstore import check_url
    from airlock.broker.store import StoreError

    try:
        check_url(text)
    except StoreError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--store: ")) from None
    return text


def broker_config(
    args: argparse.Namespace, port: int, max_connections: int, secrets: list[SecretSource]
) -> BrokerConfig:
    """The broker options (add_broker_options) as the library's settings."""
    return BrokerConfig(
        port=port,
        call_log=args.call_log or str(Path(args.state_dir or DEFAULT_STATE_DIR) / "calls"),
        github_api=args.github_api,
        github_app_id=args.github_app_id,
        github_app_key=args.github_app_key,
        github_installation_id=args.github_installation_id,
        github_token_file=args.github_token_file,
        github_token_env=args.github_token_env,
        github_timeout=args.github_timeout,
        token_ttl=args.token_ttl,
        token_max_ttl=args.token_max_ttl,
        max_connections_per_client=max_connections,
        secrets=secrets,
        store=args.store,
        store_password_file=args.store_password_file,
        signing_keys=args.signing_key or [],
        active_kid=args.active_kid,
        audience=args.audience,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_gateway_options(parser)
    parser.add_argument("--listen", metavar="ADDR", help="the address to listen on (required, but with --pod)")
    parser.add_argument("--sandbox", action="append", metavar="ID=CIDR[:PROFILE]", help="repeatable")
    parser.add_argument("--audit-stdout", action="store_true")
    parser.add_argument(
        "--workers", type=worker_count, metavar="N|auto",
        help="proxy processes serving the same listeners (default auto: the CPUs this process may use, at most 8; "
        "with --pod 1); policy, DNS, broker, admin and the audit file stay in this one (docs/operations.md, Workers)",
    )  # fmt: skip
    pod = parser.add_argument_group("the gateway sidecar of a Kubernetes pod (docs/kubernetes.md)")
    pod.add_argument(
        "--pod", action="store_true",
        help=f"one sandbox, the pod: on {pod_ports.LISTEN}, DNS on {pod_ports.DNS_PORT}, admin on {POD_ADMIN}, no "
        "broker of its own; the policy file reloaded when it changes",
    )  # fmt: skip
    pod.add_argument("--sandbox-id", metavar="ID", help="the pod's sandbox id (default: $HOSTNAME, the pod's name)")
    pod.add_argument(
        "--broker-url", type=http_url, metavar="URL", help="the central broker, relayed to the agent on --broker-port"
    )
    pod.add_argument(
        "--broker-token-file", type=absolute, metavar="FILE", help="the pod's broker token (read again as it changes)"
    )
    pod.add_argument("--trust-dir", type=absolute, metavar="DIR", help="where ca-bundle.pem is kept for the agent")
    # Its default depends on --pod (check_pod_options, check_host_options): None says "not given".
    parser.set_defaults(func=cmd_gateway, dns_port=None)


POD_ONLY = ("sandbox_id", "broker_url", "broker_token_file", "trust_dir")


def gateway_config(args: argparse.Namespace, policy: Policy, listen: str, sandboxes: list[Sandbox]) -> GatewayConfig:
    """The gateway options as the library's settings (limits checked already)."""
    try:
        upstream_dns = [parse_server(s) for s in args.upstream_dns or []]
    except ValueError as e:
        raise UsageError(f"--upstream-dns: {e}") from None
    if args.profile and args.profile not in policy.profiles:
        raise UsageError(f"no profile {args.profile!r} in {policy.source}")
    if args.upstream_ca:
        check_ca_bundle(args.upstream_ca)
    try:
        secrets = [parse_secret(spec) for spec in args.secret or []]
    except BrokerConfigError as e:
        raise UsageError(str(e)) from None
    return GatewayConfig(
        policy=policy,
        listen=listen,
        proxy_port=args.proxy_port,
        transparent_port=args.transparent_port,
        sandboxes=sandboxes,
        upstream_dns=upstream_dns,
        upstream_ca=args.upstream_ca,
        audit_path=None if args.audit == "-" else args.audit,
        audit_stdout=args.audit == "-" or getattr(args, "audit_stdout", False),
        connect_timeout=args.connect_timeout,
        idle_timeout=args.idle_timeout,
        max_tunnels_per_sandbox=args.max_tunnels,
        max_connections_per_sandbox=args.max_connections,
        dns_min_ttl=args.dns_min_ttl,
        dns_port=args.dns_port,
        dns_rate=args.dns_rate,
        close_denied_on_reload=args.close_denied_on_reload,
        state_dir=args.state_dir,
        policy_path=args.policy,
        approval_webhook=args.approval_webhook,
        admin=args.admin,
        broker=broker_config(args, args.broker_port, args.broker_max_connections, secrets),
    )


def worker_count(text: str) -> int:
    """`--workers`: a count of at least 1, or `auto` (the CPUs, capped)."""
    if text == "auto":
        from airlock.gateway.worker_terms import auto_workers

        return auto_workers()
    if not text.isdigit() or not 1 <= int(text) <= 256:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of workers from 1 to 256, or auto")
    return int(text)


def default_workers(pod: bool) -> int:
    """Without --workers: one per CPU for a gateway many sandboxes share; one for a pod's sidecar, which serves
    its one sandbox (as `airlock run`'s embedded gateway does) and must not cost a pod a process per node CPU."""
    if pod:
        return 1
    from airlock.gateway.worker_terms import auto_workers

    return auto_workers()


def admin_address(text: str) -> str:
    """`--admin`: a socket path made absolute as it is read (like every path option); `HOST:PORT` as given (a bad
    one is told where the listener is made)."""
    try:
        endpoint = admin_endpoint(text)
    except BrokerConfigError:
        return text
    return str(endpoint) if isinstance(endpoint, Path) else text


def http_url(text: str) -> str:
    """`--approval-webhook`, `--broker-url`: an http(s) URL with a host (what the gateway itself dials)."""
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL")
    return text


def audit_destination(text: str) -> str:
    """`--audit FILE`, made absolute; `-` stays: the audit goes to stdout."""
    return text if text == "-" else absolute(text)


def check_ca_bundle(path: str) -> None:
    """UsageError unless `path` holds CA certificates: a bundle that does not load would be found out only when
    the broker first calls GitHub (and the proxy, which passes TLS through, never reads it)."""
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as e:
        raise UsageError(f"--upstream-ca {path}: no CA certificates there ({e.strerror or e})") from None


def local_address(address: str) -> None:
    """UsageError unless `address` is one of this host's (network namespace's) own: mitmproxy would log its bind
    error and the gateway wait for a listener that never comes."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as e:
            raise UsageError(f"--listen {address}: {e.strerror}: not an address of this host") from None


def sandboxes(specs: list[str], profile: str | None, policy: Policy) -> list[Sandbox]:
    """`--sandbox ID=CIDR[:PROFILE]`; with none given, one sandbox `default` covers every client."""
    if not specs:
        name = profile or policy.default_profile
        return [Sandbox("default", name, ipaddress.ip_network(n)) for n in ("0.0.0.0/0", "::/0")]
    found = []
    for spec in specs:
        sandbox_id, sep, rest = spec.partition("=")
        if not sep or not sandbox_id:
            raise UsageError(f"--sandbox {spec!r}: expected ID=CIDR[:PROFILE]")
        cidr, _, sandbox_profile = rest.partition(":") if rest.count(":") <= 1 else (rest, "", "")
        try:
            network = ipaddress.ip_network(cidr, strict=True)
        except ValueError as e:
            raise UsageError(f"--sandbox {spec!r}: {e}") from None
        sandbox_profile = sandbox_profile or profile or policy.default_profile
        if sandbox_profile not in policy.profiles:
            raise UsageError(f"--sandbox {spec!r}: no profile {sandbox_profile!r} in the policy")
        found.append(Sandbox(sandbox_id, sandbox_profile, network))
    return found


def cmd_gateway(args: argparse.Namespace) -> int:
    check_limits(args)
    if args.pod:
        check_pod_options(args)
    else:
        check_host_options(args)
    try:  # before the state directory exists; a name would be resolved differently by each listener
        ipaddress.ip_address(args.listen)
    except ValueError:
        raise UsageError(f"--listen {args.listen!r}: give the IP address to listen on (127.0.0.1, ::1, ...)") from None
    local_address(args.listen)
    # A service: its INFO lines (listening, a policy reloaded) are what its operator reads, -v or not.
    logging.getLogger("airlock").setLevel(logging.INFO)
    # A pod's policy file (a ConfigMap) is watched from the moment it is read: an update meanwhile is not missed.
    watch = file_signature(args.policy) if args.pod and args.policy is not None else None
    with paused_collection():  # the policy is kept: its load needs no collection (startup/collection.py)
        policy = load_policy_file(args.policy)
    if args.pod:  # its state lives as long as the sidecar (a non-root one could not make DEFAULT_STATE_DIR)
        config = pod_config(args, policy)
    else:
        args.state_dir = args.state_dir or DEFAULT_STATE_DIR
        config = gateway_config(args, policy, args.listen, sandboxes(args.sandbox or [], args.profile, policy))
    config = dataclasses.replace(config, workers=args.workers or default_workers(args.pod))
    return asyncio.run(serve(config, watch))


def check_host_options(args: argparse.Namespace) -> None:
    """Without --pod: --listen given, and none of the pod's options."""
    for name in POD_ONLY:
        if getattr(args, name) is not None:
            raise UsageError(f"--{name.replace('_', '-')} is an option of --pod")
    if args.listen is None:
        raise UsageError("the following arguments are required: --listen (or --pod)")
    args.dns_port = 53 if args.dns_port is None else args.dns_port


def check_pod_options(args: argparse.Namespace) -> None:
    """With --pod: the options that do not fit a pod refused, the pod's defaults filled in where not given."""
    if args.sandbox:
        raise UsageError("--sandbox: with --pod the pod is the one sandbox (--sandbox-id names it)")
    if args.listen not in (None, pod_ports.LISTEN):
        raise UsageError(f"--listen {args.listen}: with --pod the gateway listens on {pod_ports.LISTEN}, where the "
                         "fence redirects the pod's traffic")  # fmt: skip
    fill_pod_defaults(args)
    args.sandbox_id = (args.sandbox_id if args.sandbox_id is not None else os.environ.get("HOSTNAME", "")).strip()
    if not args.sandbox_id:
        raise UsageError("--pod: no sandbox id: give --sandbox-id, or run where $HOSTNAME names the pod")
    if (args.broker_url is None) != (args.broker_token_file is None):
        raise UsageError("--broker-url and --broker-token-file go together: where the broker is, and the pod's token")
    if args.broker_url is not None and not args.broker_port:
        raise UsageError("--broker-port 0: the broker relay needs a port")


def fill_pod_defaults(args: argparse.Namespace) -> None:
    """What --pod changes where the option is not given (pod_ports.py: the fence's defaults are the same)."""
    args.listen = pod_ports.LISTEN
    args.dns_port = pod_ports.DNS_PORT if args.dns_port is None else args.dns_port
    args.admin = args.admin or POD_ADMIN


def pod_config(args: argparse.Namespace, policy: Policy) -> GatewayConfig:
    """The pod's gateway: every client is the pod (the listener is on loopback: only the pod's own processes reach
    it, the fence's redirected connections keeping the pod's address as their source); no broker of its own, the
    central one relayed when --broker-url says where it is."""
    name = args.profile or policy.default_profile
    pod = [Sandbox(args.sandbox_id, name, ipaddress.ip_network(n)) for n in ("0.0.0.0/0", "::/0")]
    relay = None
    if args.broker_url is not None:
        relay = RelayConfig(args.broker_url, args.broker_token_file, args.broker_port, args.broker_max_connections)
    config = gateway_config(args, policy, pod_ports.LISTEN, pod)
    no_broker = dataclasses.replace(config.broker, port=0)  # --broker-port is the relay's
    return dataclasses.replace(config, broker=no_broker, relay=relay, trust_dir=args.trust_dir)


async def serve(config: GatewayConfig, watch: Signature | None = None) -> int:
    """Run until SIGTERM (exit 0) or SIGINT (130); SIGHUP reloads the policy file (off the event loop), SIGUSR1
    reopens the audit file; with `watch` (the policy file's signature when it was read), the policy reloads when
    its file changes (a ConfigMap updated)."""
    with paused_collection():  # the gateway's own imports, and the gateway they build, are kept too
        from airlock.gateway import Gateway

        gateway = Gateway(config)
    # Handlers first: a signal that arrives while the gateway starts still stops it cleanly.
    stopped = signal_future(signal.SIGTERM, signal.SIGINT)
    loop = asyncio.get_running_loop()
    reloads: set[asyncio.Task[None]] = set()
    loop.add_signal_handler(signal.SIGHUP, reload_policy, gateway, reloads)
    loop.add_signal_handler(signal.SIGUSR1, gateway.reopen_audit)
    watcher = PolicyWatcher(config.policy.source, gateway.reload_policy, gateway.tell_reload, watch)
    try:
        await gateway.start()
        dns = f", DNS on port {config.dns_port}" if config.dns_port else ""
        transparent = f", transparent on port {config.transparent_port}" if config.transparent_port else ""
        relay = f", broker relay on port {config.relay.port} to {config.relay.url}" if config.relay else ""
        where = format_host_port(config.listen, config.proxy_port)
        workers = f" ({config.workers} workers)" if config.workers > 1 else ""
        print(
            f"airlock gateway: proxy on {where}{workers}{transparent}{dns}{relay}, admin on {gateway.admin.address}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
        if watch is not None:
            watcher.start()
        with registered(gateway.admin.address, config.policy.source, "airlock gateway"):
            signum = await stopped
    finally:
        await watcher.stop()
        await gateway.stop()
    if signum == signal.SIGINT:
        print("airlock: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


def reload_policy(gateway: Gateway, running: set[asyncio.Task[None]]) -> None:
    """SIGHUP: the policy file loaded again off the event loop (a task kept in `running` until it ends); a bad
    file is reported and the running policy stays."""
    task = asyncio.get_running_loop().create_task(_reload(gateway))
    running.add(task)
    task.add_done_callback(running.discard)


async def _reload(gateway: Gateway) -> None:
    try:
        log_reload(await gateway.reload_policy())
    except Exception as e:  # e.g. a SIGHUP before the gateway has started: keep what runs
        log.error("policy NOT reloaded, the running policy stays: %s: %s", type(e).__name__, e)
