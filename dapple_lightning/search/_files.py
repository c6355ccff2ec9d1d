"""Files the search writes for others to read, replaced whole: a reader sees the old or the new."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file beside it, renamed over ``path``; the path.

    An interruption (Ctrl-C, a full disk, a kill) leaves the previous file as it was, never a
    half-written one, and no temporary file behind unless the process is killed outright.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _mode(path))  # mkstemp's file is private (0600); the result should not be
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _mode(path: Path) -> int:
    """The permissions of the file being replaced, or a new file's under the process's umask."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
