"""The mitmproxy pieces the gateway runs — its master, options and the five addons a proxy needs — imported
without running `mitmproxy/addons/__init__.py`.

That `__init__` imports every addon mitmproxy has, to build its default set: blocklist and clientplayback (with
flowfilter's grammar), the onboarding app (flask), proxyauth (ldap3) and two dozen more, about a third of the
gateway's start-up, for addons the gateway never loads. Importing any one addon module runs the package's
`__init__` first, so until something asks the package for a name that is not a submodule (`default_addons`, say),
a stand-in holds its place in `sys.modules`: the same package path, each submodule imported on its own. The first
such request runs the real `__init__` in the stand-in, so every other user of mitmproxy still finds the package
whole. `mitmproxy.master` imports `mitmproxy.addons.termlog`: it, too, is imported only after the stand-in.

`TlsConfig` below is mitmproxy's, but for the certificate authority it signs with: the gateway's own.

mitmproxy checks the type of every field of every HTTP message it makes (`MessageData.__post_init__`, in a Python
run without -O) with its options' general type walker, which formats its error message before it knows there is an
error: the top function of a kept-alive request's profile. `check_message_fields` makes the same check with one
`isinstance` per field, against the same types, and leaves a wrong value to mitmproxy's own check, which refuses it
with its own words.

Reading an option (`options.proxy_debug`, as every layer does as it is made) deep-copies its value, twice while it
is unchanged (`_Option.default`, then `_Option.current`): `read_options_once` copies a mutable value once and gives an
immutable one (a bool, a number, text) as it is, which is what `copy.deepcopy` gives for those.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import sys
import types
import typing
from typing import Any, Protocol

ADDONS = "mitmproxy.addons"


class _DeferredPackage(types.ModuleType):
    """A package whose `__init__` runs only when a name that is not a submodule is looked up on it."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"{self.__name__}.{name}") is not None:
            return importlib.import_module(f"{self.__name__}.{name}")
        self.__class__ = types.ModuleType  # type: ignore[assignment]  # from now on an ordinary module: no second run
        assert self.__spec__ is not None and self.__spec__.loader is not None
        self.__spec__.loader.exec_module(self)
        return getattr(self, name)


def _defer_init(name: str) -> None:
    if name in sys.modules:
        return  # imported whole already: nothing to save
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None or spec.loader is None:
        return
    package = _DeferredPackage(name)
    package.__spec__, package.__loader__, package.__file__ = spec, spec.loader, spec.origin
    package.__path__, package.__package__ = list(spec.submodule_search_locations), name
    sys.modules[name] = package


_defer_init(ADDONS)

from mitmproxy import certs, http, options, optmanager  # noqa: E402 - after the stand-in: mitmproxy.master imports an addon
from mitmproxy.addons import core, disable_h2c, next_layer, tlsconfig  # noqa: E402
from mitmproxy.addons.proxyserver import Proxyserver  # noqa: E402
from mitmproxy.master import Master  # noqa: E402
from mitmproxy.proxy.mode_servers import ServerInstance  # noqa: E402


def _isinstance_types(typespec: Any) -> tuple[type, ...] | None:
    """What `isinstance` must accept to agree with mitmproxy's `check_option_type` on this field type (an int is a
    float there); None for a type it walks otherwise (sequences, tuples, Any)."""
    if typespec is float:
        return (float, int)
    if isinstance(typespec, type) and typing.get_origin(typespec) is None:
        return (typespec,)
    if typing.get_origin(typespec) in (typing.Union, types.UnionType):
        parts = [_isinstance_types(arg) for arg in typing.get_args(typespec)]
        return None if any(p is None for p in parts) else tuple(t for p in parts if p for t in p)
    return None


def check_message_fields() -> None:
    """mitmproxy's type check of each HTTP message's fields, one `isinstance` a field (the module docstring)."""
    original = getattr(http.MessageData, "__post_init__", None)
    if original is None:
        return  # python -O: mitmproxy checks nothing
    fields_by_class: dict[type, list[tuple[str, tuple[type, ...]]]] = {}
    for cls in (http.RequestData, http.ResponseData):
        fields_by_class[cls] = []
        for field in dataclasses.fields(cls):
            if (allowed := _isinstance_types(field.type)) is None:
                return  # a type this check cannot make as mitmproxy does: mitmproxy's check stays
            fields_by_class[cls].append((field.name, allowed))

    def post_init(self: http.MessageData) -> None:
        checks = fields_by_class.get(type(self))
        if checks is not None:
            for name, allowed in checks:
                if not isinstance(getattr(self, name), allowed):
                    break
            else:
                return
        original(self)  # mitmproxy's own check: it refuses a wrong value in its own words

    http.MessageData.__post_init__ = post_init  # type: ignore[method-assign]  # mitmproxy calls it for each message


check_message_fields()

_IMMUTABLE = frozenset({bool, int, float, str, bytes, type(None)})  # copy.deepcopy gives these back as they are


def read_options_once() -> None:
    """mitmproxy's option read without its second deep copy, and with none of an immutable value (the docstring)."""
    unset = optmanager.unset

    def current(self: optmanager._Option) -> Any:
        value = self._default if self.value is unset else self.value
        return value if type(value) in _IMMUTABLE else copy.deepcopy(value)

    optmanager._Option.current = current  # type: ignore[method-assign]  # every option read calls it


read_options_once()


class LayerChoice(next_layer.NextLayer):
    """mitmproxy's choice of a connection's next layer, made only where the gateway's addon asks for it (`choose`):
    not a hook of its own, which would choose first for every connection, the inside of every passed-through tunnel
    included (a TLS layer on each side, which the addon replaces). Its options (`configure`) are mitmproxy's."""

    next_layer = None  # type: ignore[assignment]  # no hook: the gateway's addon calls `choose`

    def choose(self, nextlayer: Any) -> None:
        next_layer.NextLayer.next_layer(self, nextlayer)

    def _ignore_connection(self, context: Any, data_client: bytes, data_server: bytes) -> bool | None:
        """mitmproxy's, which first reads (copies) the `ignore_hosts` and `allow_hosts` options to see whether either
        is set: their compiled forms here (`configure`) say as much."""
        if not self.ignore_hosts and not self.allow_hosts:
            return False
        return super()._ignore_connection(context, data_client, data_server)


class LeafIssuer(Protocol):
    """Where inspected connections get their certificates: the gateway's own name-constrained CA."""

    @property
    def certstore(self) -> certs.CertStore: ...  # mitmproxy's view of that CA (its key, its chain, no DH params)

    def store_entry(self, host: str) -> certs.CertStoreEntry: ...  # a leaf for exactly this host, or raises

    @property
    def active(self) -> bool: ...  # whether a CA exists yet (a policy in force inspects)


class TlsConfig(tlsconfig.TlsConfig):
    """mitmproxy's TLS addon, which signs only with the gateway's own CA, and only for inspected hosts.

    mitmproxy would make (or load) its own unconstrained CA in its confdir as it starts: a quarter of `airlock
    run`'s start-up, for a key that could sign any name. Here no such CA exists: the gateway passes TLS through
    except where a rule says `inspect: true`, and there the leaf is the gateway CA's (`issuer`), for the SNI the
    tunnel was judged by and nothing else; while the issuer has no CA, a TLS session to the sandbox cannot start.
    mitmproxy's revocation-list answer at a magic path is never served either."""

    _CA_OPTIONS = frozenset({"certs", "confdir", "key_size", "cert_passphrase", "emudhra", "emudhra_old"})

    def __init__(self, issuer: LeafIssuer | None = None) -> None:
        super().__init__()
        self.issuer = issuer  # the gateway's CAs, which exist once a policy in force inspects

    def configure(self, updated: set[str] | str) -> None:
        names = {updated} if isinstance(updated, str) else set(updated)  # running() passes a bare "confdir"
        if rest := names - self._CA_OPTIONS:
            super().configure(rest)  # type: ignore[no-untyped-call]  # mitmproxy's addon hooks are untyped

    def _store(self) -> certs.CertStore:
        if self.issuer is None or not self.issuer.active:
            raise RuntimeError("no rule inspects: the gateway has no certificate authority")
        self.certstore = self.issuer.certstore
        return self.certstore

    def tls_start_client(self, tls_start: Any) -> None:
        self._store()
        super().tls_start_client(tls_start)

    def quic_start_client(self, tls_start: Any) -> None:
        raise RuntimeError("QUIC is never intercepted")

    def get_cert(self, conn_context: Any) -> certs.CertStoreEntry:
        self._store()
        assert self.issuer is not None
        if not conn_context.client.sni:
            raise RuntimeError("an inspected connection without SNI")
        return self.issuer.store_entry(conn_context.client.sni)

    def request(self, flow: Any) -> None:
        pass


__all__ = ["LayerChoice", "Master", "Proxyserver", "ServerInstance", "TlsConfig", "core", "disable_h2c", "options"]
