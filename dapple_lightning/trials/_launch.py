"""Starting a trial's (or the probe's) processes: ``exec`` a fresh interpreter, or ``fork`` the template.

Either way the child leads a new session, so its process group holds everything it starts and
:func:`kill_group` ends all of it; either way it notices when the search process dies and kills
its own group. The difference is start-up cost (see ``_zygote``): ``exec`` pays the torch and
Lightning imports in every rank of every trial, ``fork`` once per search. Inside, a trial's leader
runs PyTorch's elastic agent either way (``_leader``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["Handle", "child_env", "default_launcher", "group_alive", "kill_group", "launch", "proc_stat"]

Kind = Literal["trial", "probe"]
_READY_TIMEOUT_S = 600.0


def default_launcher() -> str:
    """``fork`` where forking after importing torch is safe (Linux), ``exec`` elsewhere."""
    return "fork" if sys.platform.startswith("linux") else "exec"


def child_env() -> dict[str, str]:
    """The environment of the search's child processes: ours, with the working directory on
    ``PYTHONPATH`` (so that factories next to the command import as they do here)."""
    env = dict(os.environ)
    paths = [os.getcwd(), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def proc_stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces): state,
    ppid, pgrp, ... (``proc(5)``, from its third field on); ``None`` where it cannot be read (no
    such process, or no ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as ended)."""
    fields = proc_stat(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return not Path("/proc").is_dir()
    return fields[0] not in ("Z", "X")


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count).

    Reads ``/proc`` on Linux (a zombie still counts for ``killpg(pgid, 0)``); elsewhere asks
    ``killpg``.
    """
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        fields = proc_stat(entry.name) if entry.name.isdigit() else None
        if fields is not None and len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def kill_group(pgid: int, term_wait_s: float = 3.0, kill_wait_s: float = 10.0) -> None:
    """SIGTERM the group, give it ``term_wait_s`` to exit, then SIGKILL what is left and wait (up
    to ``kill_wait_s``) until it is gone: callers count on no process of it being left."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + term_wait_s
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.05)  # polling with a deadline
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + kill_wait_s
    while time.monotonic() < deadline and group_alive(pgid):
        time.sleep(0.02)  # a killed process takes a moment to exit on a loaded machine


def _tail(text: str, lines: int = 12) -> str:
    """The last ``lines`` non-blank lines of a child's stderr: where its error is."""
    kept = [line for line in text.strip().splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


@dataclass
class Handle:
    """A started trial or probe: its process group, the channel of its events, its exit code."""

    pgid: int
    events_fd: int | None
    """Readable end of the events channel (a pipe with ``exec``: EOF at the end; a FIFO with ``fork``)."""
    _proc: subprocess.Popen | None = None
    _exit_file: Path | None = None
    returncode: int | None = None

    def poll(self) -> int | None:
        """The leader's exit code once it ended, else ``None`` (``-9`` if it vanished without one)."""
        if self.returncode is not None:
            return self.returncode
        if self._proc is not None:
            self.returncode = self._proc.poll()
        elif not _alive(self.pgid):
            assert self._exit_file is not None
            try:
                self.returncode = int(self._exit_file.read_text())
            except (OSError, ValueError):
                self.returncode = -signal.SIGKILL
        return self.returncode

    def close(self) -> None:
        """Kill whatever of the group is left and release the channel."""
        if self.poll() is None or group_alive(self.pgid):
            kill_group(self.pgid)
        if self._proc is not None:
            self._proc.wait()
            if self._proc.stdout is not None:
                self._proc.stdout.close()
        elif self.events_fd is not None:
            os.close(self.events_fd)
        self.events_fd = None
        if self.returncode is None:
            self.poll()


# ----------------------------------------------------------------------------------- the template


class _Template:
    """The ``_zygote`` process of this search process (one per interpreter and environment)."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [python, "-m", "dapple_lightning.trials._zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            start_new_session=True,
            env=env,
        )
        self._ready = False
        self._buffer = b""

    def _readline(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the trial template (pid {self.proc.pid}) did not answer in {timeout:g} s")
                if not sel.select(timeout=min(left, 1.0)):
                    if self.proc.poll() is not None:
                        raise RuntimeError(self._died())
                    continue
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise RuntimeError(self._died())
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def _died(self) -> str:
        code = self.proc.wait()
        self._stderr.seek(0)
        return f"the trial template exited (code {code}):\n" + _tail(self._stderr.read().decode(errors="replace"))

    def start(self, kind: Kind, spec_path: Path, events_path: Path) -> int:
        if not self._ready:
            if self._readline(_READY_TIMEOUT_S) != "ready":
                raise RuntimeError("the trial template sent an unexpected greeting")
            self._ready = True
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps([kind, str(spec_path), str(events_path)]) + "\n").encode())
        self.proc.stdin.flush()
        return int(self._readline(60.0))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the template's signal to exit
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


_templates: dict[tuple[str, str, str], _Template] = {}


def _template(python: str) -> _Template:
    env = child_env()
    key = (python, os.getcwd(), env["PYTHONPATH"])
    template = _templates.get(key)
    if template is None or not template.alive():
        template = _templates[key] = _Template(python, env)
    return template


@atexit.register
def _close_templates() -> None:
    for template in _templates.values():
        template.close()
    _templates.clear()


# ------------------------------------------------------------------------------------- launching


def launch(kind: Kind, spec_path: Path, *, launcher: str, python: str) -> Handle:
    """Start a trial (``kind="trial"``) or a probe for the spec at ``spec_path``; its handle.

    Both write their files into the spec's directory. With ``fork`` the events channel is a
    FIFO there, opened read-write so that it never reports EOF before the writer connects.
    """
    out = spec_path.parent
    if launcher == "exec":
        module = "_leader" if kind == "trial" else "_probe"
        proc = subprocess.Popen(
            [python, "-m", f"dapple_lightning.trials.{module}", str(spec_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=open(out / "supervisor.err", "wb"),  # noqa: SIM115 (the child holds it)
            start_new_session=True,
            env=child_env(),
        )
        assert proc.stdout is not None
        return Handle(pgid=proc.pid, events_fd=proc.stdout.fileno(), _proc=proc)
    if launcher != "fork":
        raise ValueError(f"unknown launcher {launcher!r}; choose fork or exec")
    events = out / "events"
    os.mkfifo(events)
    fd = os.open(events, os.O_RDWR | os.O_NONBLOCK)
    try:
        pid = _template(python).start(kind, spec_path, events)
    except BaseException:
        os.close(fd)
        raise
    return Handle(pgid=pid, events_fd=fd, _exit_file=out / "leader_exit")
