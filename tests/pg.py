"""A real PostgreSQL server for the tests: Debian's `postgresql` package, run as the `postgres` user from a temporary
folder, listening on a unix socket only (nothing on the network), removed at the end (atexit too).

    server = PostgresServer.start()
    url = server.create_database("t1")      # postgresql://postgres@/t1?host=<socket folder>
    server.stop("immediate")                # as a crash would; server.start_again() brings it back
    server.remove()

fsync is off: what is committed reaches the kernel (and so survives the server's crash, `stop("immediate")`), but
no disk waits for it — the tests need a server's behaviour, not a machine's crash safety.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

USER = "postgres"
BIN_GLOB = "/usr/lib/postgresql/*/bin"


@functools.cache
def bin_dir() -> Path | None:
    """The newest installed server's programs (Debian keeps them off PATH)."""
    found = [Path(d) for d in glob.glob(BIN_GLOB) if (Path(d) / "initdb").is_file()]
    return max(found, key=lambda d: int(d.parent.name)) if found else None


@functools.cache
def problem() -> str | None:
    """Why no test server can run here, or None."""
    if os.geteuid() != 0:
        return "not running as root (the server runs as the postgres user)"
    if bin_dir() is None:
        return f"no PostgreSQL server installed ({BIN_GLOB}/initdb): apt-get install postgresql"
    if shutil.which("runuser") is None:
        return "`runuser` not found"
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return f"no {USER} user"
    return None


class PostgresServer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.socket_dir = root / "socket"
        self.log = root / "server.log"
        self._databases = 0

    @classmethod
    def start(cls) -> PostgresServer:
        root = Path(tempfile.mkdtemp(prefix="airlock-pg-"))
        server = cls(root)
        atexit.register(server.remove)
        user = pwd.getpwnam(USER)
        server.socket_dir.mkdir()
        for path in (root, server.socket_dir):
            os.chown(path, user.pw_uid, user.pw_gid)
        server._as_postgres("initdb", "-D", str(server.data), "-A", "trust", "-U", USER, "--no-sync", "-E", "UTF8")
        server.start_again()
        return server

    def _as_postgres(self, program: str, *args: str) -> None:
        programs = bin_dir()
        assert programs is not None
        done = subprocess.run(
            ["runuser", "-u", USER, "--", str(programs / program), *args],
            capture_output=True, text=True, timeout=60, check=False, cwd=self.root,
        )  # fmt: skip
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{program} failed: {done.stderr.strip() or done.stdout.strip()}\n{log}")

    def start_again(self) -> None:
        options = (
            f"-c listen_addresses='' -k {self.socket_dir} -c fsync=off -c full_page_writes=off -c max_connections=200"
        )
        self._as_postgres("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "30", "-o", options, "start")

    def stop(self, mode: str = "fast") -> None:
        """`immediate` is a crash: every connection dropped, nothing shut down in order."""
        self._as_postgres("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def url(self, database: str) -> str:
        return f"postgresql://{USER}@/{database}?host={self.socket_dir}"

    def create_database(self, prefix: str = "t") -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        self._databases += 1
        name = f"{prefix}{self._databases}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
        return self.url(name)

    def emptied_database(self, name: str = "broker") -> str:
        """`name`, empty again (its schema dropped and made anew: a fifth of a second less than a new database);
        its URL. Whoever used it last has closed its connections."""
        import psycopg

        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchall():
                conn.execute(f'CREATE DATABASE "{name}"')  # type: ignore[arg-type]
                return self.url(name)
        with psycopg.connect(self.url(name), autocommit=True) as conn:
            conn.execute("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
        return self.url(name)

    def password_database(self, role: str, password: str) -> str:
        """A fresh database owned by `role`, which logs in only with `password` (SCRAM: a line ahead of the trust
        lines of pg_hba.conf, the server reloaded); its URL, with no password in it."""
        import psycopg

        self._databases += 1
        name = f"pw{self._databases}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchall():
                conn.execute(f'CREATE ROLE "{role}" LOGIN')  # type: ignore[arg-type]
            conn.execute(f"ALTER ROLE \"{role}\" PASSWORD '{password}'")  # type: ignore[arg-type]
            conn.execute(f'CREATE DATABASE "{name}" OWNER "{role}"')  # type: ignore[arg-type]
        hba = self.data / "pg_hba.conf"
        hba.write_text(f"local {name} {role} scram-sha-256\n" + hba.read_text())  # the file keeps its owner
        self._as_postgres("pg_ctl", "-D", str(self.data), "reload")
        url = f"postgresql://{role}@/{name}?host={self.socket_dir}"
        deadline = time.monotonic() + 10
        while True:  # the reload is a signal: the postmaster reads the file a moment later
            try:
                psycopg.connect(url, password=f"not-{password}", connect_timeout=2).close()
            except psycopg.OperationalError:
                return url
            assert time.monotonic() < deadline, "pg_hba.conf reloaded, yet no password asked"
            time.sleep(0.05)

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def remove(self) -> None:
        if self.running():
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)
