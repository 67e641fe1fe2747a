"""A throwaway PostgreSQL server for the batch store's tests: Debian's `postgresql` package
(`make test-tools` installs it), a cluster made in a temporary directory, listening on a free
port of 127.0.0.1 with a password, and removed afterwards. Missing, it fails the tests that
need it (never a skip: the PostgreSQL store would go untested)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from app.background import free_port

USER = "ngrammys"
# a cluster for tests: durability off (a crash only loses a test's data), small and quick
SERVER_OPTIONS = "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"


def server_binaries() -> Path:
    """The directory of `initdb` and `pg_ctl`: pg_config's, Debian's, or on the PATH."""
    candidates = []
    if pg_config := shutil.which("pg_config"):
        bindir = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        candidates.append(bindir.stdout.strip())
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    if initdb := shutil.which("initdb"):
        candidates.append(str(Path(initdb).parent))
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").is_file():
            return Path(candidate)
    pytest.fail(
        "PostgreSQL's server programs (initdb, pg_ctl) are not installed; the PostgreSQL batch "
        "store's tests need them: `make test-tools` installs Debian's postgresql package",
        pytrace=False,
    )


@dataclass
class PostgresServer:
    port: int
    password: str
    run_as: list[str]
    bin: Path
    data: Path

    @property
    def options(self) -> str:
        return f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data} {SERVER_OPTIONS}"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}:{self.password}@127.0.0.1:{self.port}/{database}"

    def admin(self, sql: str) -> None:
        """Run `sql` on the server's own database (CREATE or DROP DATABASE, ...)."""
        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(sql.encode())

    def new_database(self) -> str:
        """The URL of a new, empty database."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.admin(f"CREATE DATABASE {name}")
        return self.url(name)

    def pg_ctl(self, *args: str) -> None:
        subprocess.run(
            [*self.run_as, str(self.bin / "pg_ctl"), "-D", str(self.data / "db"), *args],
            check=True,
            stdout=subprocess.DEVNULL,
        )

    def start(self) -> None:
        self.pg_ctl("-l", str(self.data / "log"), "-w", "-o", self.options, "start")

    def stop(self, mode: str = "fast") -> None:
        self.pg_ctl("-m", mode, "-w", "stop")


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server of its own (initdb refuses root: as root, it runs as Debian's
    `postgres` user, in a directory that user owns)."""
    bin_dir = server_binaries()
    data = Path(tempfile.mkdtemp(prefix="ngrammys-pg-"))
    run_as: list[str] = []
    if os.geteuid() == 0:
        shutil.chown(data, "postgres", "postgres")
        run_as = ["runuser", "-u", "postgres", "--"]
    password = f"pw-{uuid.uuid4().hex}"
    password_file = data / "password"
    password_file.write_text(password)
    password_file.chmod(0o644)
    server = PostgresServer(free_port(), password, run_as, bin_dir, data)
    try:
        subprocess.run(
            [
                *run_as,
                str(bin_dir / "initdb"),
                "-D",
                str(data / "db"),
                "-U",
                USER,
                f"--pwfile={password_file}",
                "--auth=scram-sha-256",
                "--encoding=UTF8",
                "--no-sync",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        server.start()
        try:
            yield server
        finally:
            server.stop("immediate")
    finally:
        shutil.rmtree(data, ignore_errors=True)
