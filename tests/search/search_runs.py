"""Running the search's command line as a user does, in a subprocess, and looking at what it left."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MLP = "dapple_lightning.search.testing:mlp"

# `python -m dapple_lightning.search`, after registering the sqlite+password storage.
_CLI = "import sys, password_dialect; from dapple_lightning.search._cli import main; sys.exit(main(sys.argv[1:]))"


def cli(*args: str) -> list[str]:
    """The command line of ``python -m dapple_lightning.search ARGS`` that can open ``sqlite+password``."""
    return [sys.executable, "-c", _CLI, *args]


def env(**extra: str) -> dict[str, str]:
    """This environment, with the repository (Hydra's plugin) and the test helpers importable."""
    paths = [str(ROOT), str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths), **extra)


def poll(condition, timeout: float, what: str):
    """Call ``condition`` until it returns something truthy, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)  # polling with a deadline
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def processes_with(marker: str) -> list[int]:
    """Running processes (zombies do not count) whose environment holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :].split()[0] not in ("Z", "X") and marker.encode() in environ:
            found.append(int(entry.name))
    return found


def text_files(folder: Path) -> dict[Path, str]:
    """Every file under ``folder``, as text."""
    return {p: p.read_bytes().decode(errors="replace") for p in folder.rglob("*") if p.is_file()}
