"""A private PostgreSQL server for tests: ``initdb`` into a temporary folder, ``pg_ctl start`` on a free port.

Debian's ``postgresql`` package (``.ci/run`` installs it) puts the server under
``/usr/lib/postgresql/VERSION/bin``. The server refuses to run as root, so as root it runs as the
package's ``postgres`` user (``runuser``). :func:`server` is a context manager giving the URL of
the cluster's ``postgres`` database (trust login, no password), stopped and removed at the end;
:func:`unavailable` says why there is none, or ``None``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

INSTALL = "apt-get install -y postgresql (what .ci/run does)"


def _bin_dir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def _as_server_user() -> list[str]:
    """The prefix that runs a server command as a user PostgreSQL accepts (not root)."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


def unavailable() -> str | None:
    """Why no server can be started here, or ``None`` when one can."""
    if _bin_dir() is None:
        return f"the PostgreSQL server is not installed: {INSTALL}"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no postgres user for the server to run as"
        if shutil.which("runuser") is None:
            return "running as root and runuser (util-linux) is missing to start the server as postgres"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server() -> Iterator[str]:
    """A fresh cluster on a free local port; the SQLAlchemy URL of its ``postgres`` database."""
    bin_dir, run_as = _bin_dir(), _as_server_user()
    assert bin_dir is not None, unavailable()
    # Not under pytest's tmp_path: its parent is private to root, and the server runs as postgres.
    folder = Path(tempfile.mkdtemp(prefix="dapple-pg-"))
    if run_as:
        shutil.chown(folder, "postgres", "postgres")
    data, log, port = folder / "data", folder / "server.log", _free_port()
    quiet = {"check": True, "capture_output": True, "text": True}
    try:
        subprocess.run(
            [*run_as, str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync"], **quiet
        )
        options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
        started = subprocess.run(
            [
                *run_as,
                str(bin_dir / "pg_ctl"),
                "-D",
                str(data),
                "-o",
                options,
                "-l",
                str(log),
                "-w",
                "-t",
                "60",
                "start",
            ],
            capture_output=True,
            text=True,
        )
        if started.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {started.stderr}\n{log.read_text() if log.exists() else ''}")
        try:
            yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
        finally:
            subprocess.run(
                [*run_as, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"], **quiet
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
