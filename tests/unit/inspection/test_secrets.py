"""The gateway's `--secret` values, one reader for the broker and the proxy's injection: exactly one trailing line
break removed, everything else that is no single token refused with one line that names the source and never the
value; and the placeholders a sandbox may hold."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from airlock.gateway import Gateway, GatewayError
from airlock.gateway.config import BrokerConfig, GatewayConfig, parse_secret
from airlock.inspection import InspectionError
from airlock.inspection.secrets import (
    MAX_SECRET,
    PlaceholderEnv,
    SecretSource,
    SecretValues,
    parse_placeholder_env,
    placeholder,
)
from airlock.policy import parse_policy

TOKEN = "sk-test_0123456789abcdef/+=.~"
POLICY = "version: 1\nprofiles:\n  default:\n    allow:\n      - host: example.com\n"


def from_file(tmp_path: Path, content: bytes, name: str = "api") -> SecretValues:
    path = tmp_path / f"{name}.secret"
    path.write_bytes(content)
    return SecretValues.read([SecretSource(name, "file", str(path))])


@pytest.mark.parametrize("content", [TOKEN, TOKEN + "\n", TOKEN + "\r\n"])
def test_one_trailing_line_break_is_removed(tmp_path: Path, content: str) -> None:
    assert from_file(tmp_path, content.encode())["api"] == TOKEN
    assert SecretValues.read([SecretSource("api", "env", "V")], {"V": content}).get("api") == TOKEN


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is empty"),
        (b"\n", "is empty"),
        (b"\r\n", "is empty"),
        (TOKEN.encode() + b"\n\n", "must hold one token"),
        (TOKEN.encode() + b"\r", "must hold one token"),
        (b" " + TOKEN.encode(), "must hold one token"),
        (TOKEN.encode() + b" \n", "must hold one token"),
        (b"Bearer " + TOKEN.encode(), "must hold one token"),
        (b"abc\x00def", "must hold one token"),
        (b"abc\rdef", "must hold one token"),
        (b"abc\ndef", "must hold one token"),
        (b"abc\tdef", "must hold one token"),
        ("tökén".encode(), "must hold one token"),
        (b"\xff\xfe", "must hold one token"),
        (b"a" * (MAX_SECRET + 1), "must hold one token of at most 4096"),
    ],
)
def test_what_is_no_single_token_is_refused(tmp_path: Path, content: bytes, message: str) -> None:
    with pytest.raises(InspectionError, match=message) as refused:
        from_file(tmp_path, content)
    assert str(refused.value).startswith(f"--secret api: file {tmp_path}/api.secret")
    assert "\n" not in str(refused.value) and "def" not in str(refused.value)  # one line, no part of the value
    with pytest.raises(InspectionError, match=message):
        SecretValues.read([SecretSource("api", "env", "V")], {"V": content.decode("utf-8", "surrogateescape")})


def test_the_longest_token(tmp_path: Path) -> None:
    assert from_file(tmp_path, b"a" * MAX_SECRET + b"\r\n")["api"] == "a" * MAX_SECRET


def test_what_is_no_regular_file_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block the gateway's start for good
    for path in (fifo, tmp_path, Path("/dev/zero")):
        with pytest.raises(InspectionError, match=f"--secret api: file {path}: cannot read it: not a regular file"):
            SecretValues.read([SecretSource("api", "file", str(path))])


def test_a_symlink_to_a_regular_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "real").write_text(TOKEN + "\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")  # as orchestrators mount secrets
    assert SecretValues.read([SecretSource("api", "file", str(tmp_path / "link"))])["api"] == TOKEN


def test_missing_sources(tmp_path: Path) -> None:
    with pytest.raises(InspectionError, match=f"--secret api: file {tmp_path}/none: cannot read it: No such file"):
        SecretValues.read([SecretSource("api", "file", str(tmp_path / "none"))])
    with pytest.raises(InspectionError, match="--secret api: env UNSET_FOR_THE_TEST is not set"):
        SecretValues.read([SecretSource("api", "env", "UNSET_FOR_THE_TEST")], {})


def test_a_name_given_twice_is_refused() -> None:
    sources = [parse_secret("api=env:A"), parse_secret("api=env:B")]
    with pytest.raises(InspectionError, match="--secret api is given twice"):
        SecretValues.read(sources, {"A": "x", "B": "y"})


def test_the_values_are_a_mapping_whose_repr_shows_no_value() -> None:
    values = SecretValues.read([parse_secret("b=env:B"), parse_secret("a=env:A")], {"A": "first", "B": "second"})
    assert dict(values) == {"a": "first", "b": "second"} and values.get("c") is None and len(values) == 2
    assert repr(values) == "SecretValues(['a', 'b'])"


def test_the_gateway_reads_its_secrets_once_with_the_same_reader_before_anything_starts(tmp_path: Path) -> None:
    """Two trailing line breaks, which the broker used to strip silently, stop the gateway like any bad value; a
    good file is read when the gateway is made, for broker and inspection alike, and never again."""
    secret = tmp_path / "t"
    secret.write_text(TOKEN + "\n\n")
    config = GatewayConfig(
        parse_policy(POLICY), "127.0.0.1", state_dir=str(tmp_path / "state"),
        broker=BrokerConfig(secrets=[parse_secret(f"T=file:{secret}")]),
    )  # fmt: skip
    with pytest.raises(GatewayError, match=r"--secret T: file .* must hold one token"):
        Gateway(config)
    secret.write_text(TOKEN + "\n")
    gateway = Gateway(config)
    secret.write_text("replaced-later\n")
    assert dict(gateway.parts.secrets) == {"T": TOKEN}


def test_placeholders() -> None:
    assert placeholder("model_api") == "airlock-placeholder-model_api"
    env = parse_placeholder_env("MODEL_API_KEY=model_api")
    assert env == PlaceholderEnv("MODEL_API_KEY", "model_api") and env.value == "airlock-placeholder-model_api"


@pytest.mark.parametrize("spec", ["MODEL_API_KEY", "=model_api", "MODEL_API_KEY=", "1X=a", "X-Y=a", "X=a-b", "X=a=b"])
def test_bad_placeholder_options_are_refused(spec: str) -> None:
    with pytest.raises(InspectionError, match=r"expected VAR=SECRET_NAME"):
        parse_placeholder_env(spec)
