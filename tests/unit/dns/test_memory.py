"""Replies remembered at the wire level (airlock.dns.memory), the audit lines of repeated decisions and the
distinct-subdomain rate."""

from __future__ import annotations

import json

import pytest
from dnslib import EDNS0, QTYPE, RR, A, DNSRecord

from airlock.audit import AuditRecord, RepeatedDecisions
from airlock.dns.memory import ReplyMemory, name_end
from airlock.dns.resolver import SubdomainRate
from airlock.policy import ReasonCode, parse_policy

POLICY = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: allowed.test\n")
OTHER_POLICY = parse_policy("version: 1\nprofiles:\n  default:\n    allow:\n      - host: allowed.test\n")
NOW = 1000.0


def query(name: str = "www.allowed.test", qtype: str = "A", qid: int = 1, edns: bool = False, rd: bool = True):
    record = DNSRecord.question(name, qtype)
    record.header.id, record.header.rd = qid, int(rd)
    if edns:
        record.add_ar(EDNS0(udp_len=1232))
    return record


def answer(request: DNSRecord, address: str = "192.0.2.10") -> bytes:
    reply = request.reply()
    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=60))
    if request.ar:  # an EDNS query: this reply says so too
        reply.add_ar(EDNS0(udp_len=1232))
    return bytes(reply.pack())


def wire(request: DNSRecord) -> bytes:
    return bytes(request.pack())  # what recvfrom hands the server


def remembered(memory: ReplyMemory, request: DNSRecord, sandbox: str = "sbx", ttl: float = 60, **kw) -> None:
    memory.remember(sandbox, wire(request), answer(request, **kw), "TEMPLATE", ttl, POLICY, NOW)


def recall(memory: ReplyMemory, request: DNSRecord, sandbox: str = "sbx", now: float = NOW + 0.5, policy=POLICY):
    found = memory.recall(sandbox, wire(request), policy, now)
    return None if found is None else DNSRecord.parse(found[0])


# ------------------------------------------------------------------------------------------------ name_end


def _raw(header: bytes, question: bytes = b"\x03www\x07allowed\x04test\x00\x00\x01\x00\x01") -> bytes:
    return header + question


PLAIN_HEADER = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00"


@pytest.mark.parametrize(
    ("packet", "expected"),
    [
        (_raw(PLAIN_HEADER), 12 + 18),
        (wire(query(edns=True)), 12 + 18),  # one EDNS OPT record is fine
        (_raw(PLAIN_HEADER, b"\x00\x00\x01\x00\x01"), 13),  # the root name
        (_raw(b"\x12\x34\x81\x80" + PLAIN_HEADER[4:]), None),  # a response
        (_raw(b"\x12\x34\x28\x00" + PLAIN_HEADER[4:]), None),  # opcode UPDATE
        (_raw(PLAIN_HEADER[:4] + b"\x00\x02" + PLAIN_HEADER[6:]), None),  # two questions
        (_raw(PLAIN_HEADER[:4] + b"\x00\x00" + PLAIN_HEADER[6:]), None),  # no question
        (_raw(PLAIN_HEADER[:6] + b"\x00\x01" + PLAIN_HEADER[8:]), None),  # an answer record in a query
        (_raw(PLAIN_HEADER[:8] + b"\x00\x01" + PLAIN_HEADER[10:]), None),  # an authority record
        (_raw(PLAIN_HEADER[:10] + b"\x00\x02"), None),  # two additional records
        (_raw(PLAIN_HEADER[:10] + b"\x01\x01"), None),  # 257 additional records
        (_raw(PLAIN_HEADER, b"\x03www\xc0\x0c\x00\x01\x00\x01"), None),  # compression pointer
        (_raw(PLAIN_HEADER, b"\x03www\x07allowed\x04test\x00\x00\x01\x00"), None),  # class cut short
        (_raw(PLAIN_HEADER, b"\x03www\x3fallowed"), None),  # label runs past the end
        (_raw(PLAIN_HEADER, b"\x03www"), None),  # no terminating label
        (PLAIN_HEADER, None),  # no question at all
        (b"\x00" * 5, None),
        (b"", None),
    ],
)
def test_name_end(packet: bytes, expected: int | None) -> None:
    assert name_end(packet) == expected


# ------------------------------------------------------------------------------------------------ ReplyMemory


def test_same_question_new_id_gets_the_same_reply_with_its_own_id() -> None:
    memory = ReplyMemory()
    remembered(memory, query(qid=1))
    reply = recall(memory, query(qid=0xBEEF))
    assert reply is not None and reply.header.id == 0xBEEF and reply.header.qr == 1
    assert [str(rr.rdata) for rr in reply.rr] == ["192.0.2.10"]
    assert memory.recall("sbx", wire(query(qid=7)), POLICY, NOW)[1] == "TEMPLATE"


def test_other_spelling_of_the_name_is_echoed_as_asked() -> None:
    memory = ReplyMemory()
    remembered(memory, query("www.allowed.test"))
    reply = recall(memory, query("WwW.aLLoweD.TEST", qid=9))
    assert reply is not None and reply.header.id == 9
    assert str(reply.q.qname) == "WwW.aLLoweD.TEST."
    assert [str(rr.rdata) for rr in reply.rr] == ["192.0.2.10"]


@pytest.mark.parametrize(
    ("asked", "why"),
    [
        (query("api.allowed.test"), "another name"),
        (query("www.allowed.tesu"), "another name, same length"),
        (query(qtype="AAAA"), "another type"),
        (query(qtype="HTTPS"), "type 65 = 'A': lowercases like type 97"),
        (query(edns=True), "with EDNS where the remembered query had none"),
        (query(rd=False), "other flags"),
    ],
)
def test_a_query_that_differs_beyond_id_and_case_is_not_answered_from_memory(asked: DNSRecord, why: str) -> None:
    memory = ReplyMemory()
    remembered(memory, query())
    assert recall(memory, asked) is None, why


def test_edns_queries_get_the_reply_made_for_an_edns_query() -> None:
    memory = ReplyMemory()
    remembered(memory, query(edns=True))
    reply = recall(memory, query(edns=True, qid=3))
    assert reply is not None and any(rr.rtype == QTYPE.OPT for rr in reply.ar)
    assert recall(memory, query()) is None


def test_memory_is_per_sandbox_per_policy_and_short() -> None:
    memory = ReplyMemory(seconds=1.0)
    remembered(memory, query(), sandbox="a")
    assert recall(memory, query(), sandbox="a") is not None
    assert recall(memory, query(), sandbox="b") is None
    assert recall(memory, query(), sandbox="a", policy=OTHER_POLICY) is None  # a reload forgets everything
    assert recall(memory, query(), sandbox="a", now=NOW + 1.01) is None  # never past a second


def test_short_ttls_shorten_the_memory_and_ttl_zero_is_not_kept() -> None:
    memory = ReplyMemory(seconds=1.0)
    remembered(memory, query("a.allowed.test"), ttl=0.3)
    assert recall(memory, query("a.allowed.test"), now=NOW + 0.2) is not None
    assert recall(memory, query("a.allowed.test"), now=NOW + 0.4) is None
    remembered(memory, query("b.allowed.test"), ttl=0)  # rebinding: ask again every time
    assert len(memory) == 1 and recall(memory, query("b.allowed.test"), now=NOW) is None


def test_only_plain_queries_whose_reply_echoes_the_question_are_kept() -> None:
    memory = ReplyMemory()
    two = query()
    two.add_question(query("api.allowed.test").q)
    memory.remember("sbx", wire(two), answer(query()), "T", 60, POLICY, NOW)
    mismatched = answer(query("api.allowed.test"))  # a reply to another question
    memory.remember("sbx", wire(query("www.allowed.test")), mismatched, "T", 60, POLICY, NOW)
    assert len(memory) == 0


def test_memory_is_bounded_oldest_first() -> None:
    memory = ReplyMemory(size=3)
    for i in range(5):
        remembered(memory, query(f"n{i}.allowed.test"))
    assert len(memory) == 3
    assert recall(memory, query("n0.allowed.test")) is None and recall(memory, query("n1.allowed.test")) is None
    assert recall(memory, query("n4.allowed.test")) is not None


# ------------------------------------------------------------------------------------------------ audit lines


def test_repeated_decisions_write_one_line_each_with_its_own_id_and_client() -> None:
    reason = 'answered "quoted" (remembered)'
    record = AuditRecord("dns", "sbx", "10.0.0.2", "www.allowed.test", None, "allow", reason, ReasonCode.ALLOWED)
    record.method, record.extra = "A", {"answers": ["192.0.2.10"], "rcode": "NOERROR"}
    template = RepeatedDecisions.template(record)
    text = RepeatedDecisions(1_700_000_000.25, [(template, "10.0.0.2"), (template, "10.0.0.3")]).to_json()
    lines = [json.loads(line) for line in text.split("\n")]
    assert [line["client"] for line in lines] == ["10.0.0.2", "10.0.0.3"]
    assert lines[0]["request_id"] != lines[1]["request_id"]
    assert {line["ts"] for line in lines} == {"2023-11-14T22:13:20.250Z"}
    original = json.loads(record.to_json())
    for line in lines:
        assert {k: v for k, v in line.items() if k not in ("ts", "request_id", "client")} == {
            k: v for k, v in original.items() if k not in ("ts", "request_id", "client")
        }


# ------------------------------------------------------------------------------------------------ subdomain rate


def test_distinct_names_per_minute_per_sandbox_and_base() -> None:
    rate = SubdomainRate()
    counts = [rate.observe("a", "allowed.test", f"n{i}.allowed.test", NOW + i) for i in range(5)]
    assert counts == [1, 2, 3, 4, 5]
    assert rate.observe("a", "allowed.test", "n0.allowed.test", NOW + 5) == 5  # asked again: not new
    assert rate.observe("b", "allowed.test", "n0.allowed.test", NOW + 5) == 1  # another sandbox
    assert rate.observe("a", "other.test", "x.other.test", NOW + 5) == 1  # another base
    # At +62.5 only names asked since +2.5 count: n3, n4, n0 (asked again at +5) and the new one.
    assert rate.observe("a", "allowed.test", "late.allowed.test", NOW + 62.5) == 4
