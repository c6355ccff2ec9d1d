"""Every rank learns of a lost peer within seconds, not after the process group's timeout.

A killed rank closes its sockets and gloo's next receive from it fails at once. A rank that stops
without closing them (a hung or ``SIGSTOP``-ed process, a lost host) leaves its peers blocked in
a receive until ``DappleStrategy(timeout=...)``; under NCCL even a killed peer can leave a
collective waiting that long. So each rank runs a daemon thread that beats in the launcher's
c10d store (a counter per rank) and watches two peers after it in a ring, so every rank is watched
twice at O(1) store traffic per rank. A peer whose counter stands still for :data:`STALE_S`, or
a rank that raised and said so (:meth:`Heartbeat.report_failure`), is a lost peer: the watcher
writes one ``lost`` key that every rank polls, and every rank then ends.

Ending: the thread cannot raise in the main thread while it is blocked inside a gloo receive
(aborting a gloo group does not wake it). It aborts the process group where the backend can
(NCCL: the blocked collective raises and Lightning's failure path runs), gives the main thread
:data:`GRACE_S` to end the run on its own, then prints why and ends the process with status 1.
Checkpoints are written under a temporary name and renamed, so ending mid-save loses nothing.

The thread uses its own store client: the main thread's may be busy in a long wait (a barrier),
and beats queued behind it would look like a dead rank.

A Python thread beats only when it gets the GIL: a call that holds it for seconds (pickling a
stage's state for ``send_object_list``) silences a rank that is alive. On the watcher's machine
``/proc`` tells a running process from a dead one; across machines a rank announces such work
first (:func:`long_host_work`): it leaves a lease in the store, and its watchers grant it that
many seconds of silence, counted on their own clocks from its last beat. A rank that dies inside
the lease is lost once it runs out (at once where ``/proc`` shows it gone); elsewhere nothing
changes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from itertools import count
from pathlib import Path

import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment

__all__ = [
    "GRACE_S",
    "INTERVAL_S",
    "PEERS_END_WITHIN_S",
    "SILENT",
    "STALE_S",
    "Heartbeat",
    "attempt",
    "end_rank",
    "launcher_client",
    "long_host_work",
    "watch_peers",
]

INTERVAL_S = 0.4
"""How often a rank beats and looks at its peers."""
STALE_S = 2.8
"""A peer whose beat has not moved for this long is lost (a few dozen missed beats: a loaded
machine or a long call that holds the GIL is not mistaken for a dead rank)."""
GRACE_S = 1.0
"""How long the main thread gets, once a peer is known lost, to end the run through its own error."""
PEERS_END_WITHIN_S = STALE_S + 3 * INTERVAL_S + GRACE_S
"""The heartbeat's own slowest path from a lost rank to the end of its peers, with no delay from the
machine: up to one look before a watcher sees the lost rank's last beat, :data:`STALE_S` of silence, one
more look to judge it, one look for the other peers to read the verdict, then their :data:`GRACE_S`. A
loaded machine adds its scheduling delays; only the process group's timeout bounds a heartbeat that fails."""
_RUNNING = frozenset("RSDI")
"""/proc states of a live process: running, sleeping (a blocked receive), in the kernel, idle."""
_STOPPED = frozenset("Tt")
"""/proc states of a stopped process (SIGSTOP, a debugger)."""
_LEFT = 1 << 40
"""Added to a rank's counter when it leaves cleanly: its watchers stop watching it."""
_GONE = "X"
"""/proc's state letter of a dead process; also what a process of this machine with no /proc entry is."""
_runs = count()  # one namespace per run of a process (fit, then test, in one script); the same on every rank
_running: Heartbeat | None = None
"""This process's started heartbeat, until it stops (for :func:`long_host_work`)."""


class Heartbeat:
    """Beats for this rank, watches peers, and ends this process when one is lost (see the module docstring).

    Args:
        rank, world_size: this rank and the number of ranks.
        address, port: the c10d store the launcher (torchrun's agent, or Lightning's rank 0) serves.
        backend: the world's backend; groups are aborted on loss where it is not gloo.
        timeout: the process group's timeout; a peer that never beat at all is lost after it.
        namespace: the store keys' prefix, the same on every rank of one run and new for each run.
        on_lost: called with the reason when the main thread did not end the run itself; by default it
            prints the reason and ends the process with status 1.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        address: str,
        port: int,
        backend: str,
        timeout: timedelta,
        *,
        namespace: str,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self._on_lost = on_lost or self._exit
        self._never_beat_s = timeout.total_seconds()
        self._prefix = f"dapple/heartbeat/{namespace}"
        self._store = launcher_client(address, port, timedelta(seconds=STALE_S))
        self._watched = sorted({(rank + k) % world_size for k in (1, 2)} - {rank})
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dapple-heartbeat-{rank}", daemon=True)
        self.lost: str | None = None
        """Why this rank is ending, once a peer is known lost."""

    def start(self) -> Heartbeat:
        global _running
        self._store.set(self._key(f"pid/{self.rank}"), f"{_process_space()} {os.getpid()}")
        self._beat(1)
        self._thread.start()
        _running = self
        return self

    @contextlib.contextmanager
    def busy(self, seconds: float) -> Iterator[None]:
        """Inside: this rank may beat no more for up to ``seconds`` (see :func:`long_host_work`)."""
        lease = self._key(f"busy/{self.rank}")
        self._store.set(lease, repr(float(seconds)))
        try:
            yield
        finally:
            self._try(lambda: self._beat(1))  # a beat first: a watcher never sees silence without the lease
            self._try(lambda: self._store.set(lease, ""))

    def report_failure(self, reason: str) -> None:
        """This rank failed (collective-free): every peer learns it at its next look, not after a timeout.

        This rank's own watching ends here: its main thread is already unwinding through Lightning's
        failure path, which must print the error however long the loggers and teardown take."""
        self._try(lambda: self._say_lost(f"rank {self.rank} failed: {reason}"))
        self._stopped.set()

    def stop(self, *, failed: bool) -> None:
        """End the thread; a clean leave tells the watchers not to wait for this rank's beats.

        After a clean leave the caller must wait for every rank to have stopped (a barrier) before the
        process ends: the store may live in this process (rank 0's under Lightning's launcher), and a
        peer's thread that still polls it would take its going for a lost launcher."""
        global _running
        if _running is self:
            _running = None
        self._stopped.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * INTERVAL_S + STALE_S)
        if not failed:
            self._try(lambda: self._beat(_LEFT))

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        last = {peer: (0, time.monotonic()) for peer in self._watched}
        started = time.monotonic()
        while not self._stopped.wait(INTERVAL_S):
            reported = False
            try:
                self._beat(1)
                if reported := self._store.check([self._key("lost")]):
                    lost: str | None = self._store.get(self._key("lost")).decode()
                    if self._stopped.is_set():  # this rank reported it, racing report_failure
                        return
                else:
                    lost = self._look(last, started)
            except Exception as e:  # the store is gone or stalled: its host (torchrun's agent, rank 0) is lost
                lost = f"the launcher's store did not answer ({type(e).__name__}: {e})"
            if lost is not None:
                self._end(lost, reported=reported)
                return

    def _look(self, last: dict[int, tuple[int, float]], started: float) -> str | None:
        now = time.monotonic()
        for peer in list(last):
            beats = self._store.add(self._key(f"beat/{peer}"), 0)
            if beats >= _LEFT:
                del last[peer]  # left cleanly
            elif beats != last[peer][0]:
                last[peer] = (beats, now)
            elif (beats > 0 and now - last[peer][1] > STALE_S) or (beats == 0 and now - started > self._never_beat_s):
                pid, state = self._state_of(peer)
                if state in _RUNNING and now - last[peer][1] <= self._never_beat_s:
                    # On this machine and running: a call holding the GIL starves its beats, it is not
                    # lost (the process group's timeout still bounds a real hang).
                    continue
                if state is None and now - last[peer][1] <= self._lease(peer):
                    continue  # on another machine, inside the long host work it announced
                silent_s = now - last[peer][1]
                reason = f"rank {peer} sent no heartbeat for {silent_s:.1f} s (killed, stopped or its host lost)"
                reason = self._say_lost(reason)
                if state in _STOPPED:
                    # No launcher reaps a stopped process (torchrun waits 30 s after its SIGTERM,
                    # Lightning's launcher leaves it), and nothing can use it any more.
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                return reason
        return None

    def _state_of(self, peer: int) -> tuple[int, str | None]:
        """The peer's process id and its state letter in /proc (``R``, ``S``, ``T``, ...) when it runs in
        this machine's process space, ``None`` otherwise (another host, or gone)."""
        space, pid = self._store.get(self._key(f"pid/{peer}")).decode().split()
        if space != _process_space() or space == "?" or int(pid) == os.getpid():
            return int(pid), None
        try:  # the state follows the command name, which is in parentheses and may hold spaces
            return int(pid), Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            return int(pid), _GONE
        except IndexError:
            return int(pid), None

    def _lease(self, peer: int) -> float:
        """The seconds of silence ``peer`` announced (:meth:`busy`); 0 outside such work."""
        key = self._key(f"busy/{peer}")
        if not self._store.check([key]):
            return 0.0
        value = self._store.get(key).decode()
        return float(value) if value else 0.0

    def _say_lost(self, reason: str) -> str:
        """Record why the run is lost unless a reason is there already; the first one, which every rank reports."""
        return self._store.compare_set(self._key("lost"), "", reason).decode()

    def _end(self, reason: str, *, reported: bool) -> None:
        self.lost = reason
        if self.backend != "gloo":  # NCCL's blocked collective raises; gloo's receive would not wake
            self._try(dist.distributed_c10d._abort_process_group)
        # A failed rank's peers see its error as a closed connection, as do NCCL's once aborted: they get
        # time to end through their own error. Under gloo a hung peer leaves the main thread blocked for good.
        if (reported or self.backend != "gloo") and self._stopped.wait(GRACE_S):
            return
        self._on_lost(reason)

    def _exit(self, reason: str) -> None:
        end_rank(self.rank, f"{reason}. The failed rank's own error, if any, is in its output.")

    # ------------------------------------------------------------------ the store

    def _key(self, name: str) -> str:
        return f"{self._prefix}/{name}"

    def _beat(self, amount: int) -> None:
        self._store.add(self._key(f"beat/{self.rank}"), amount)

    @staticmethod
    def _try(action) -> None:
        with contextlib.suppress(Exception):  # best effort on the way out: the store or group may be gone
            action()


def end_rank(rank: int, why: str) -> None:
    """End this process at once with status 1, saying ``why`` on stderr after its output so far."""
    sys.stdout.flush()
    sys.stderr.write(f"dapple: rank {rank} ends: {why}\n")
    sys.stderr.flush()
    os._exit(1)


def _process_space() -> str:
    """Where a process id means the same process as here: this boot of this machine and this PID
    namespace (containers on one host have their own); ``"?"`` where that cannot be read."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return "?"


class _Silent:
    """No peers to watch (one rank, or before the process group exists)."""

    def report_failure(self, reason: str) -> None:
        pass

    def stop(self, *, failed: bool) -> None:
        pass


SILENT = _Silent()


def attempt() -> str:
    """This launch's part of a store key: torchrun's agent keeps its store across restarts, so each
    run and each attempt in it has keys of its own."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"


def launcher_client(address: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A connection of this thread's own to the launcher's store (torchrun's agent, or rank 0 under
    Lightning's launcher): a client's operations run one at a time, so a thread that must not wait
    behind another's blocking call needs its own."""
    return dist.TCPStore(address, port, is_master=False, timeout=timeout, wait_for_workers=False)


def long_host_work(seconds: float) -> contextlib.AbstractContextManager[None]:
    """Around host work that may hold the GIL for seconds (pickling a stage's state): this process's
    heartbeat (if one runs) has its watchers grant it up to ``seconds`` of silence meanwhile, so that
    across machines it is not taken for a lost rank; a rank that dies inside is lost when they run out."""
    return _running.busy(seconds) if _running is not None else contextlib.nullcontext()


def watch_peers(
    env: ClusterEnvironment,
    rank: int,
    world_size: int,
    backend: str,
    timeout: timedelta,
    on_lost: Callable[[str], None] | None = None,
) -> Heartbeat | _Silent:
    """A started :class:`Heartbeat` on the launcher's store (``on_lost``: see :class:`Heartbeat`);
    :data:`SILENT` for a single rank."""
    if world_size == 1:
        return SILENT
    namespace = f"{attempt()}/{next(_runs)}"
    heartbeat = Heartbeat(
        rank, world_size, env.main_address, env.main_port, backend, timeout, namespace=namespace, on_lost=on_lost
    )
    return heartbeat.start()
