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
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
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

from mitmproxy import certs, options  # noqa: E402 - after the stand-in: mitmproxy.master imports an addon
from mitmproxy.addons import core, disable_h2c, next_layer, tlsconfig  # noqa: E402
from mitmproxy.addons.proxyserver import Proxyserver  # noqa: E402
from mitmproxy.master import Master  # noqa: E402
from mitmproxy.proxy.mode_servers import ServerInstance  # noqa: E402


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


__all__ = ["Master", "Proxyserver", "ServerInstance", "TlsConfig", "core", "disable_h2c", "next_layer", "options"]
