"""The mitmproxy pieces the gateway runs — its master, options and the five addons a proxy needs — imported
without running `mitmproxy/addons/__init__.py`.

That `__init__` imports every addon mitmproxy has, to build its default set: blocklist and clientplayback (with
flowfilter's grammar), the onboarding app (flask), proxyauth (ldap3) and two dozen more, about a third of the
gateway's start-up, for addons the gateway never loads. Importing any one addon module runs the package's
`__init__` first, so until something asks the package for a name that is not a submodule (`default_addons`, say),
a stand-in holds its place in `sys.modules`: the same package path, each submodule imported on its own. The first
such request runs the real `__init__` in the stand-in, so every other user of mitmproxy still finds the package
whole. `mitmproxy.master` imports `mitmproxy.addons.termlog`: it, too, is imported only after the stand-in.

`TlsConfig` below is mitmproxy's, but for when it makes its certificate authority.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from typing import Any

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

from mitmproxy import options  # noqa: E402 - after the stand-in: mitmproxy.master imports an addon
from mitmproxy.addons import core, disable_h2c, next_layer, tlsconfig  # noqa: E402
from mitmproxy.addons.proxyserver import Proxyserver  # noqa: E402
from mitmproxy.master import Master  # noqa: E402
from mitmproxy.proxy.mode_servers import ServerInstance  # noqa: E402


class TlsConfig(tlsconfig.TlsConfig):
    """mitmproxy's TLS addon, whose certificate authority is made when first needed rather than at start.

    The gateway passes TLS through and never intercepts it, yet mitmproxy makes a CA in its confdir as it starts
    (an RSA key generated, then parsed back and checked): a quarter of `airlock run`'s start-up, for a key no
    certificate is ever signed with. Everything that would sign one still gets it, from the same options; and
    with no CA made, there is no revocation list of it to serve (mitmproxy answers one at a magic path)."""

    _CA_OPTIONS = frozenset({"certs", "confdir", "key_size", "cert_passphrase", "emudhra", "emudhra_old"})

    def configure(self, updated: set[str] | str) -> None:
        names = {updated} if isinstance(updated, str) else set(updated)  # running() passes a bare "confdir"
        if names & self._CA_OPTIONS:
            self.certstore = None  # type: ignore[assignment]  # made again, from these options, when next needed
        if rest := names - self._CA_OPTIONS:
            super().configure(rest)

    def _with_ca(self) -> None:
        if self.certstore is None:
            super().configure(self._CA_OPTIONS)  # only the part that makes (or loads) the CA

    def tls_start_client(self, tls_start: Any) -> None:
        self._with_ca()
        super().tls_start_client(tls_start)

    def quic_start_client(self, tls_start: Any) -> None:
        self._with_ca()
        super().quic_start_client(tls_start)

    def get_cert(self, conn_context: Any) -> Any:
        self._with_ca()
        return super().get_cert(conn_context)

    def request(self, flow: Any) -> None:
        if self.certstore is not None:
            super().request(flow)


__all__ = ["Master", "Proxyserver", "ServerInstance", "TlsConfig", "core", "disable_h2c", "next_layer", "options"]
