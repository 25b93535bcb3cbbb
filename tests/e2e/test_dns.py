"""The sandbox's resolver end to end: queries from inside the sandbox namespace to the real airlock DNS server
on the gateway, which forwards allowed names to the fake authoritative server (counting every query)."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import string
import threading
import time

import pytest
from dnslib import QTYPE, RCODE, DNSRecord

from airlock.verify.topology import DNS_SERVER, GW_IP, FakeNet, Topology

from gateway_proc import AIRLOCK, E2E_POLICY, POLICIES, PROXY, GatewayProcess
from netclient import in_netns, proxy_http

ALLOWED_IP = "192.0.2.10"


def ask(name: str, qtype: str = "A", tcp: bool = False, server: str = GW_IP, timeout: float = 3) -> DNSRecord:
    question = DNSRecord.question(name, qtype)
    return DNSRecord.parse(question.send(server, 53, tcp=tcp, timeout=timeout))


def answers(reply: DNSRecord) -> list[str]:
    return [str(rr.rdata) for rr in reply.rr]


def rcode(reply: DNSRecord) -> str:
    return RCODE.get(reply.header.rcode)


@pytest.mark.parametrize(("tcp", "name"), [(False, "allowed.test"), (True, "www.allowed.test")], ids=["udp", "tcp"])
def test_allowed_name_is_answered_from_upstream(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, tcp: bool, name: str
):
    reply = in_netns(topology.sbx, ask, name, "A", tcp)
    assert rcode(reply) == "NOERROR" and answers(reply) == [ALLOWED_IP]
    assert reply.rr[0].ttl >= 1
    assert fakenet.dns_queries(name) >= 1


@pytest.mark.parametrize("tcp", [False, True], ids=["udp", "tcp"])
def test_unlisted_name_is_refused_without_any_upstream_query(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, tcp
):
    reply = in_netns(topology.sbx, ask, "evil.test", "A", tcp)
    assert rcode(reply) == "REFUSED" and answers(reply) == []
    assert fakenet.dns_queries("evil.test") == 0


@pytest.mark.parametrize("name", ["internal.allowed.test", "loop.allowed.test", "meta.allowed.test"])
def test_internal_answers_never_reach_the_sandbox(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, name):
    reply = in_netns(topology.sbx, ask, name)
    assert answers(reply) == [] and rcode(reply) == "NXDOMAIN"
    assert fakenet.dns_queries(name) >= 1  # it was asked, and the answer was filtered


def test_cname_chains_are_flattened_and_vetted(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    internal = in_netns(topology.sbx, ask, "cname-internal.allowed.test")
    assert answers(internal) == [] and rcode(internal) == "NXDOMAIN"
    public = in_netns(topology.sbx, ask, "cname-public.allowed.test")
    assert answers(public) == [ALLOWED_IP]
    assert all(rr.rtype == QTYPE.A and str(rr.rname) == "cname-public.allowed.test." for rr in public.rr)


def test_mixed_answer_keeps_only_the_public_address(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    assert answers(in_netns(topology.sbx, ask, "mixed.allowed.test")) == [ALLOWED_IP]


def test_cidr_rule_lets_the_named_internal_service_resolve(topology, fakenet: FakeNet, gateway: GatewayProcess):
    assert answers(in_netns(topology.sbx, ask, "svc.internal.test")) == ["10.1.2.4"]


def test_rebinding_name_never_answers_internal(topology: Topology, fakenet: FakeNet, own_gateway):
    own_gateway(extra=("--dns-min-ttl", "0"))
    seen = [answers(in_netns(topology.sbx, ask, "rebind.allowed.test")) for _ in range(6)]
    assert fakenet.dns_queries("rebind.allowed.test", "A") >= 6
    assert [ALLOWED_IP] in seen and all(a in ([ALLOWED_IP], []) for a in seen), seen


@pytest.mark.parametrize("qtype", ["TXT", "ANY", "MX", "NULL", "HTTPS", "SRV"])
def test_other_types_get_no_data_and_no_upstream_query(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess, qtype: str
):
    reply = in_netns(topology.sbx, ask, "txt.allowed.test", qtype)
    assert rcode(reply) == "NOERROR" and answers(reply) == []
    assert fakenet.dns_queries("txt.allowed.test") == 0


def test_garbage_packets_do_not_break_the_server(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    valid = DNSRecord.question("allowed.test", "A").pack()

    def hostile_then_valid() -> DNSRecord:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(0.2)
            payloads = [os.urandom(2048), os.urandom(12), b"", valid[:5], valid[:-3], b"\xff" * 512]
            payloads += [valid[:2] + b"\x81\x80" + valid[4:]]  # a response, not a query
            for payload in payloads:
                sock.sendto(payload, (GW_IP, 53))
            with contextlib.suppress(TimeoutError):
                while True:
                    sock.recv(4096)  # whatever comes back must not be a crash; drain it
        with socket.create_connection((GW_IP, 53), timeout=3) as tcp:
            tcp.sendall(b"\x00\x40" + os.urandom(20))  # announces 64 bytes, sends 20, then stops
        return ask("allowed.test")

    reply = in_netns(topology.sbx, hostile_then_valid)
    assert answers(reply) == [ALLOWED_IP]
    assert gateway.proc.poll() is None


def test_no_other_resolver_is_reachable(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    for server in (DNS_SERVER, "10.253.0.1", "8.8.8.8"):
        topology.assert_route_inside(topology.sbx, server)
        with pytest.raises(OSError):
            in_netns(topology.sbx, ask, "allowed.test", "A", False, server, 2)
    assert fakenet.dns_queries("allowed.test") == 0


def test_upstream_down_gives_servfail(topology: Topology, fakenet: FakeNet, own_gateway):
    own_gateway(upstream_dns="192.0.2.99")  # in the fake internet, where nobody answers
    started = time.monotonic()
    reply = in_netns(topology.sbx, ask, "allowed.test", "A", False, GW_IP, 10)
    assert rcode(reply) == "SERVFAIL" and answers(reply) == []
    assert time.monotonic() - started < 8
    proxied = in_netns(topology.sbx, proxy_http, PROXY, "http://allowed.test/")
    assert proxied.status == 403 and "resolution failed" in proxied.json()["reason"]
    assert proxied.json()["code"] == "resolve_failed"
    assert fakenet.total_connections() == 0


def test_proxy_and_resolver_agree(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    dns_view = answers(in_netns(topology.sbx, ask, "mixed.allowed.test"))
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://mixed.allowed.test/").status == 200
    chosen = gateway.audit_for(host="mixed.allowed.test", kind="http")  # the DNS line may be written first
    assert [r["chosen_ip"] for r in chosen] == dns_view == [ALLOWED_IP]


def _random_label(n: int) -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(n))


def test_exfiltration_shaped_names_are_flagged(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    name = f"{_random_label(63)}.allowed.test"
    assert answers(in_netns(topology.sbx, ask, name)) == [ALLOWED_IP]  # flagged, not refused by default
    record = [r for r in gateway.audit_for(host=name) if r["kind"] == "dns"][-1]
    assert record["extra"]["longest_label"] == 63 and record["extra"]["entropy"] > 4
    assert any("label of 63" in flag for flag in record["extra"]["suspicious"])


def test_exfiltration_shaped_names_are_refused_when_the_switch_is_on(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway(POLICIES / "dns-refuse.yaml")
    name = f"{_random_label(63)}.allowed.test"
    assert rcode(in_netns(topology.sbx, ask, name)) == "REFUSED"
    assert fakenet.dns_queries(name) == 0
    # Many distinct short names under one domain: the unique-subdomain rate trips too.
    codes = [rcode(in_netns(topology.sbx, ask, f"x{i}.allowed.test")) for i in range(40)]
    # The random name above was the first distinct name under allowed.test; the limit is 30 a minute.
    assert codes[:29] == ["NOERROR"] * 29 and set(codes[29:]) == {"REFUSED"}
    refused = gw.audit_for(host="x39.allowed.test")[-1]
    assert refused["code"] == "suspicious_name" and "distinct subdomains" in refused["reason"]


def test_rate_limit_per_sandbox(topology: Topology, fakenet: FakeNet, own_gateway):
    own_gateway(extra=("--dns-rate", "5"))

    def burst() -> int:
        answered = 0
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(1)
            for i in range(40):
                sock.sendto(DNSRecord.question(f"r{i}.allowed.test").pack(), (GW_IP, 53))
            try:
                while True:
                    sock.recv(4096)
                    answered += 1
            except TimeoutError:
                return answered

    answered = in_netns(topology.sbx, burst)
    assert 5 <= answered <= 15, answered  # a burst of ~10 passes, the rest is dropped silently


def test_airlock_run_resolves_allowed_names_only(topology: Topology, fakenet: FakeNet):
    def run(name: str):
        argv = [AIRLOCK, "run", "--policy", E2E_POLICY, "--upstream-dns", DNS_SERVER,
                "--sandbox-id", f"{topology.prefix}d{secrets.token_hex(1)}", "--", "getent", "hosts", name]  # fmt: skip
        return topology.run(topology.gw, argv, timeout=60)

    allowed = run("allowed.test")
    assert allowed.returncode == 0 and allowed.stdout.split()[0] == ALLOWED_IP, (allowed.stdout, allowed.stderr)
    unlisted = run("evil.test")
    assert unlisted.returncode != 0 and unlisted.stdout == ""
    assert fakenet.dns_queries("evil.test") == 0


def test_repeated_questions_are_answered_from_memory_and_still_audited(
    topology: Topology, fakenet: FakeNet, gateway: GatewayProcess
):
    def three_times() -> list[DNSRecord]:
        return [ask("www.allowed.test"), ask("WwW.AlLoWeD.tEsT"), ask("www.allowed.test", "AAAA")]

    first, shouting, aaaa = in_netns(topology.sbx, three_times)
    assert answers(first) == answers(shouting) == [ALLOWED_IP]
    assert str(shouting.q.qname) == "WwW.AlLoWeD.tEsT."  # the question is echoed as asked (0x20 randomization)
    assert first.header.id != shouting.header.id
    assert rcode(aaaa) == "NOERROR" and answers(aaaa) == []  # another question, not the remembered answer
    deadline = time.monotonic() + 3
    while len([r for r in gateway.audit() if r["host"] == "www.allowed.test" and r["kind"] == "dns"]) < 3:
        assert time.monotonic() < deadline, "every query, remembered or not, writes its audit line"
        time.sleep(0.05)


def test_a_policy_reload_forgets_remembered_answers_at_once(topology: Topology, own_gateway, tmp_path):
    policy = tmp_path / "live.yaml"
    policy.write_text(E2E_POLICY.read_text())
    gw = own_gateway(policy)
    stop = threading.Event()
    seen: list[tuple[float, str]] = []  # (when answered, rcode), asked every 20 ms from the sandbox

    def keep_asking() -> None:
        while not stop.is_set():
            seen.append((time.monotonic(), rcode(ask("www.allowed.test"))))
            time.sleep(0.02)

    asker = threading.Thread(target=in_netns, args=(topology.sbx, keep_asking))
    asker.start()
    try:
        deadline = time.monotonic() + 5
        while not any("(remembered)" in r["reason"] for r in gw.audit_for(host="www.allowed.test")):
            assert time.monotonic() < deadline, "repeats are answered from memory"
            time.sleep(0.05)
        policy.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - host: other.test\n")
        signalled = time.monotonic()
        gw.proc.send_signal(signal.SIGHUP)
        while "policy reloaded" not in gw.log():
            assert time.monotonic() < deadline, gw.log()
            time.sleep(0.01)
        reloaded = time.monotonic()
        time.sleep(0.5)  # well inside the second a remembered answer may live
    finally:
        stop.set()
        asker.join()
    before = [code for at, code in seen if at < signalled]
    after = [code for at, code in seen if at > reloaded]
    assert before and set(before) == {"NOERROR"}
    assert len(after) >= 5 and set(after) == {"REFUSED"}, after


def test_other_classes_are_refused_without_an_upstream_query(topology: Topology, fakenet: FakeNet, gateway):
    def chaos() -> DNSRecord:
        question = DNSRecord.question("chaos.allowed.test", "A", "CH")
        return DNSRecord.parse(question.send(GW_IP, 53, timeout=3))

    reply = in_netns(topology.sbx, chaos)
    assert rcode(reply) == "REFUSED" and answers(reply) == []
    assert fakenet.dns_queries("chaos.allowed.test") == 0


def test_tcp_connections_per_sandbox_are_capped(topology: Topology, fakenet: FakeNet, gateway: GatewayProcess):
    def over_the_cap() -> tuple[int, bool, bool]:
        query = DNSRecord.question("allowed.test").pack()
        framed = len(query).to_bytes(2, "big") + query
        held = [socket.create_connection((GW_IP, 53), timeout=3) for _ in range(16)]

        def answered(sock: socket.socket) -> bool:
            try:
                sock.sendall(framed)
                return len(sock.recv(4096)) > 2
            except OSError:
                return False

        try:
            working = sum(answered(sock) for sock in held)  # every held connection is served
            with socket.create_connection((GW_IP, 53), timeout=3) as extra:
                seventeenth = answered(extra)  # closed by the gateway at once
            held.pop().close()
            time.sleep(0.2)
            with socket.create_connection((GW_IP, 53), timeout=3) as again:
                after_one_closed = answered(again)
            return working, seventeenth, after_one_closed
        finally:
            for sock in held:
                sock.close()

    assert in_netns(topology.sbx, over_the_cap) == (16, False, True)


def test_cname_chain_through_a_denied_name_is_refused(topology: Topology, fakenet: FakeNet, own_gateway, tmp_path):
    # cname-public.allowed.test is a CNAME to allowed.test, which this policy denies.
    policy = tmp_path / "deny-apex.yaml"
    policy.write_text(
        "version: 1\nprofiles:\n  default:\n    allow:\n      - host: '*.allowed.test'\n"
        "    deny:\n      - host: allowed.test\n"
    )
    gw = own_gateway(policy)
    aliased = in_netns(topology.sbx, ask, "cname-public.allowed.test")
    assert rcode(aliased) == "REFUSED" and answers(aliased) == []
    assert fakenet.dns_queries("cname-public.allowed.test") >= 1  # asked: the chain is only known from the answer
    [record] = [r for r in gw.audit_for(host="cname-public.allowed.test") if r["kind"] == "dns"]
    assert record["reason"].startswith("CNAME chain passes through allowed.test, denied by rule")
    assert record["code"] == "alias_denied" and record["extra"]["cnames"] == ["allowed.test"]
    assert answers(in_netns(topology.sbx, ask, "www.allowed.test")) == [ALLOWED_IP]  # no chain, no change


def test_queries_waiting_on_upstream_are_capped(topology: Topology, fakenet: FakeNet, own_gateway):
    gw = own_gateway(upstream_dns="192.0.2.99")  # in the fake internet, where nobody answers

    def burst() -> list[DNSRecord]:
        replies = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.settimeout(1.5)  # well before the upstream timeout
            for i in range(40):
                sock.sendto(DNSRecord.question(f"w{i}.allowed.test").pack(), (GW_IP, 53))
            with contextlib.suppress(TimeoutError):
                while True:
                    replies.append(DNSRecord.parse(sock.recv(4096)))
        return replies

    early = in_netns(topology.sbx, burst)
    assert len(early) == 8 and {rcode(r) for r in early} == {"SERVFAIL"}  # 40 - 32 waiting on upstream
    over = [r for r in gw.audit() if r["kind"] == "dns" and r["code"] == "inflight_limit"]
    assert len(over) == 8 and {r["decision"] for r in over} == {"error"}


def test_the_proxy_refuses_a_cname_chain_through_a_denied_name_too(
    topology: Topology, fakenet: FakeNet, own_gateway, tmp_path
):
    policy = tmp_path / "deny-apex.yaml"
    policy.write_text(
        "version: 1\nprofiles:\n  default:\n    allow:\n      - host: '*.allowed.test'\n        ports: [80]\n"
        "    deny:\n      - host: allowed.test\n        ports: [80]\n"
    )
    gw = own_gateway(policy)
    reply = in_netns(topology.sbx, proxy_http, PROXY, "http://cname-public.allowed.test/")
    assert reply.status == 403, reply
    assert fakenet.total_connections() == 0
    record = [r for r in gw.audit_for(host="cname-public.allowed.test") if r["kind"] == "http"][-1]
    assert record["reason"].startswith("CNAME chain passes through allowed.test, denied by rule"), record
    assert record["code"] == "alias_denied"
    assert in_netns(topology.sbx, proxy_http, PROXY, "http://www.allowed.test/").status == 200  # no chain
