"""Package registries of the fake internet, under their real names (the docs' walk-throughs type those): PyPI's
simple index and files host, npm's registry, and the `pkg.example` index of the denial walk-through (docs/policy.md).
Each serves one small package, built here byte for byte the same every run:

- PyPI: `airlockdemo` 1.0, a pure-Python wheel (`import airlockdemo; airlockdemo.ANSWER == 42`);
- npm: `airlock-demo` 1.0.0 (`require("airlock-demo") === 42`).

`answer(host, path)` is (content type, body) for a path one of them serves, else None."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import tarfile
import zipfile

REGISTRY_HOSTS = ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "pkg.example")
WHEEL_NAME = "airlockdemo-1.0-py3-none-any.whl"
NPM_PACKAGE = "airlock-demo"
NPM_TARBALL = f"{NPM_PACKAGE}-1.0.0.tgz"
_FIXED_TIME = (2020, 1, 1, 0, 0, 0)


def wheel() -> bytes:
    """A pure-Python wheel built by hand (no build tools): module `airlockdemo`."""
    files = {
        "airlockdemo.py": b"ANSWER = 42\n",
        "airlockdemo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: airlockdemo\nVersion: 1.0\n",
        "airlockdemo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = io.StringIO()
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write(f"{name},sha256={digest},{len(data)}\n")
    record.write("airlockdemo-1.0.dist-info/RECORD,,\n")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in [*files.items(), ("airlockdemo-1.0.dist-info/RECORD", record.getvalue().encode())]:
            archive.writestr(zipfile.ZipInfo(name, _FIXED_TIME), data)
    return out.getvalue()


def npm_tarball() -> bytes:
    """`npm pack`'s layout: everything under package/, gzipped."""
    files = {
        "package/package.json": json.dumps({"name": NPM_PACKAGE, "version": "1.0.0", "main": "index.js"}).encode(),
        "package/index.js": b"module.exports = 42;\n",
    }
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            archive.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


def _packument(tarball: bytes) -> bytes:
    integrity = "sha512-" + base64.b64encode(hashlib.sha512(tarball).digest()).decode()
    version = {
        "name": NPM_PACKAGE, "version": "1.0.0", "main": "index.js",
        "dist": {
            "tarball": f"https://registry.npmjs.org/{NPM_PACKAGE}/-/{NPM_TARBALL}",
            "integrity": integrity, "shasum": hashlib.sha1(tarball).hexdigest(),
        },
    }  # fmt: skip
    return json.dumps({"name": NPM_PACKAGE, "dist-tags": {"latest": "1.0.0"}, "versions": {"1.0.0": version}}).encode()


def _simple_index(files_host: str, data: bytes) -> bytes:
    digest = hashlib.sha256(data).hexdigest()
    link = f'<a href="https://{files_host}/packages/{WHEEL_NAME}#sha256={digest}">{WHEEL_NAME}</a>'
    return f"<!DOCTYPE html>\n<html><body>\n{link}\n</body></html>\n".encode()


def _links_page(project: str) -> bytes:
    """A project's page in PyPI's simple index as PyPI writes it (PEP 503: a title naming the project), no files."""
    title = f"Links for {project}"
    lines = [
        "<!DOCTYPE html>",
        "<html>",
        f"  <head>\n    <title>{title}</title>\n  </head>",
        f"  <body>\n    <h1>{title}</h1>\n  </body>",
        "</html>",
    ]
    return ("\n".join(lines) + "\n").encode()


def _routes() -> dict[tuple[str, str], tuple[str, bytes]]:
    demo_wheel, tarball = wheel(), npm_tarball()
    html = "text/html"
    return {
        ("pypi.org", "/simple/airlockdemo/"): (html, _simple_index("files.pythonhosted.org", demo_wheel)),
        ("pypi.org", "/simple/airlock/"): (html, _links_page("airlock")),  # README's first line fetches it
        ("files.pythonhosted.org", f"/packages/{WHEEL_NAME}"): ("application/octet-stream", demo_wheel),
        ("pkg.example", "/simple/"): (html, b'<!DOCTYPE html>\n<html><body>\n<a href="airlockdemo/">airlockdemo</a>\n'),
        ("registry.npmjs.org", f"/{NPM_PACKAGE}"): ("application/json", _packument(tarball)),
        ("registry.npmjs.org", f"/{NPM_PACKAGE}/-/{NPM_TARBALL}"): ("application/octet-stream", tarball),
    }


ROUTES = _routes()


def answer(host: str | None, path: str) -> tuple[str, bytes] | None:
    """What the registry at `host` (a Host header, a port maybe on it) serves at `path`."""
    name = (host or "").rsplit(":", 1)[0].lower()
    return ROUTES.get((name, path))
