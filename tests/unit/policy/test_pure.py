"""The policy core (policy/ → airlock.policy) is pure, and these tests hold it to what that means here:

- no module-level mutable state: every name a policy module binds is an immutable value (numbers, text, tuples,
  frozensets, read-only mappings, frozen dataclasses, compiled patterns, enums), a class, a function, or a memo of
  a pure function (`functools.cache`: what it holds is never observable); no `global` or `nonlocal` anywhere;
- no I/O: importing it and deciding opens no file, socket or process, but for these reads — `load_policy` reads the
  file it is given, the Public Suffix List's data file (a file of the `publicsuffixlist` package) is read on
  first use, and so are jsonschema's meta-schemas (files of `jsonschema-specifications`) when a policy declares
  tools. Python's own loading of modules (.py, .pyc, .so files) is not I/O of the policy's.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib
import ipaddress
import json
import pkgutil
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import airlock.policy

POLICY_DIR = Path(airlock.policy.__file__).parent
IMMUTABLE = (
    int, float, complex, str, bytes, bool, type(None), frozenset, range, re.Pattern, enum.Enum,
    types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodWrapperType,
    functools._lru_cache_wrapper,
    types.MappingProxyType, typing.TypeAliasType, typing.TypeVar, ipaddress.IPv4Network, ipaddress.IPv6Network,
    ipaddress.IPv4Address, ipaddress.IPv6Address, type(annotations),
)  # fmt: skip


def _immutable(value: object) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(item) for item in value)
    if isinstance(value, types.MappingProxyType):
        return all(_immutable(key) and _immutable(item) for key, item in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.__dataclass_params__.frozen and all(  # type: ignore[attr-defined]
            _immutable(getattr(value, f.name)) for f in dataclasses.fields(value)
        )
    return isinstance(value, IMMUTABLE) or type(value).__module__ == "typing"  # unions, aliases


def test_policy_modules_hold_no_mutable_state() -> None:
    mutable = []
    for info in pkgutil.iter_modules(airlock.policy.__path__):
        module = importlib.import_module(f"airlock.policy.{info.name}")
        for name, value in vars(module).items():
            if not name.startswith("__") and not _immutable(value):
                mutable.append(f"airlock.policy.{info.name}.{name}: {type(value).__name__}")
    assert mutable == []


def test_policy_modules_rebind_no_module_names() -> None:
    rebinding = []
    for path in sorted(POLICY_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Global | ast.Nonlocal):
                rebinding.append(f"{path.name}:{node.lineno}: {type(node).__name__.lower()} {', '.join(node.names)}")
    assert rebinding == []


def test_a_mutable_module_value_is_caught() -> None:
    # The check above would see what policy/records.py held before the audit record moved out: a counter, a cache.
    import itertools

    assert not _immutable(itertools.count()) and not _immutable({}) and not _immutable((1, [2]))
    assert _immutable((1, frozenset({"a"}), types.MappingProxyType({"k": (2,)})))


_WORKLOAD = """
import ipaddress, json, sys
events = []
def hook(event, args):
    if event == "open" or event.startswith(("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn",
                                            "os.fork", "os.remove", "os.rename", "os.mkdir")):
        events.append([event, str(args[0]) if args else ""])
sys.addaudithook(hook)
import airlock.policy as P
text = "version: 1\\nprofiles:\\n  default:\\n    allow:\\n      - host: '*.allowed.test'\\n"
text += "      - cidr: 192.0.2.0/24\\n"
policy = P.parse_policy(text)
profile = policy.profile("default")
P.decide(profile, "www.allowed.test", 443), P.decide(profile, "xn--bcher-kva.test", 80), P.decide_name(profile, "a.b")
P.vet(profile, (ipaddress.ip_address("192.0.2.1"), ipaddress.ip_address("::ffff:10.0.0.1")), 443, frozenset())
P.canonical_host("WWW.Allowed.TEST."), P.classify(ipaddress.ip_address("169.254.169.254"))
P.registrable_domain("a.b.example.co.uk"), P.is_public_suffix("co.uk")
P.load_policy(sys.argv[1])
tools = "tools:\\n  - {name: t, description: d, argv: [/bin/true], input: {type: object}}\\n"
assert P.parse_policy(text + tools).tools[0].name == "t"
P.TokenBuckets(1.0, 2).take("k", 0.0)
inspected = "      - {host: api.test, inspect: true, http: [{paths: ['/v1/**']}]}\\n"
rule = P.parse_policy(text + inspected).profile("default").allow[-1]
P.judge_request(rule, "GET", "/v1/caf%C3%A9/../x?q", False), P.judge_request(rule, "GET", "/%EF%BC%8F", False)
print(json.dumps(events))
"""


def test_the_policy_core_reads_only_its_policy_file_and_the_suffix_list(tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("version: 1\nprofiles:\n  default:\n    allow:\n      - host: pypi.org\n")
    run = subprocess.run(
        [sys.executable, "-c", _WORKLOAD, str(policy_file)], capture_output=True, text=True, timeout=60, check=True
    )
    import jsonschema_specifications
    import publicsuffixlist

    suffix_list = Path(publicsuffixlist.__file__).parent
    meta_schemas = Path(jsonschema_specifications.__file__).parent
    io = [
        (event, target)
        for event, target in json.loads(run.stdout)
        if not (event == "open" and target.endswith((".py", ".pyc", ".so")))  # Python loading a module
        and not (event == "open" and Path(target).parent == suffix_list)
        and not (event == "open" and Path(target).is_relative_to(meta_schemas))
        and not (event == "open" and target == str(policy_file))
    ]
    assert io == []
    assert ["open", str(policy_file)] in json.loads(run.stdout)  # the hook saw what it should
