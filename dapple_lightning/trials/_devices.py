"""The GPUs of one host, leased to one trial at a time: concurrent trials never share a device.

Several search workers may run on one host (``search run`` started twice on one study). Each of
their GPU trials leases ``world_size`` of the host's devices before it starts and hands its
processes ``CUDA_VISIBLE_DEVICES`` naming exactly those; a trial that finds too few free waits,
saying so, until another trial ends.

The lease is one lock file per device in a directory every process of the user on this host
agrees on (:func:`lock_dir`: ``DAPPLE_DEVICE_LOCK_DIR``, else ``$TMPDIR/dapple-devices-<uid>``),
held with ``flock``. The kernel releases a flock when the last descriptor of it closes, so a
lease ends with its trial, and with its worker however that worker dies (SIGKILL included):
no stale lock is ever left to clean up. A held file names its holder (pid and a note), which
the waiting message shows.

Which devices the host has (:func:`host_devices`), first found wins:

- ``DAPPLE_HOST_GPUS``: comma-separated device ids, e.g. ``0,1,2,3`` (tests name GPUs a CPU host
  does not have; a user can keep some GPUs out of the search);
- the parent's ``CUDA_VISIBLE_DEVICES``: its entries, as given (indices or ``GPU-<uuid>``);
- ``torch.cuda.device_count()``: ``0`` to ``n - 1``.

Workers that share devices must name them the same way (all by index or all by UUID), since a
device's lock file is named after its id.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["HOST_GPUS_ENV", "LOCK_DIR_ENV", "host_devices", "lease_devices", "lock_dir"]

HOST_GPUS_ENV = "DAPPLE_HOST_GPUS"
LOCK_DIR_ENV = "DAPPLE_DEVICE_LOCK_DIR"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def host_devices() -> tuple[str, ...]:
    """The device ids of this host that trials may lease (see the module docstring)."""
    for name in (HOST_GPUS_ENV, "CUDA_VISIBLE_DEVICES"):
        text = os.environ.get(name)
        if text is not None:
            return tuple(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    import torch

    return tuple(str(i) for i in range(torch.cuda.device_count()))


def lock_dir() -> Path:
    """Where the lock files of this host's devices live (made when missing)."""
    folder = os.environ.get(LOCK_DIR_ENV) or os.path.join(tempfile.gettempdir(), f"dapple-devices-{os.getuid()}")
    path = Path(folder)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding ``path``'s exclusive flock, or ``None`` when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def _acquire(devices: tuple[str, ...], count: int, folder: Path, note: str) -> dict[str, int] | None:
    """Lock ``count`` of ``devices`` at once, or none (taking no partial lease avoids two trials
    each holding half of what both need)."""
    held: dict[str, int] = {}
    for device in devices:
        fd = _try_lock(folder / f"{_SAFE.sub('_', device)}.lock")
        if fd is None:
            continue
        held[device] = fd
        if len(held) == count:
            break
    if len(held) < count:
        for fd in held.values():
            os.close(fd)
        return None
    for fd in held.values():
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} {note}".strip().encode(), 0)
    return held


def _busy(devices: tuple[str, ...], folder: Path) -> str:
    """Who holds which device, for the waiting message."""
    by_holder: dict[str, list[str]] = {}
    for device in devices:
        path = folder / f"{_SAFE.sub('_', device)}.lock"
        fd = _try_lock(path)
        if fd is None:
            by_holder.setdefault(_holder(path), []).append(device)
        else:
            os.close(fd)
    return "; ".join(f"{','.join(d)} held by {h}" for h, d in by_holder.items()) or "none held now"


@contextlib.contextmanager
def lease_devices(
    count: int, *, note: str = "", on_wait: Callable[[str], None] | None = None
) -> Iterator[tuple[str, ...]]:
    """Hold ``count`` of this host's devices, exclusively among processes of this host, for the ``with`` block.

    Args:
        count: devices needed (the trial's ranks).
        note: what the lease is for (shown to those waiting on it).
        on_wait: called with a message when the lease has to wait, and every 30 s while it still
            waits.

    Yields:
        The leased ids, in the host's order: the value of ``CUDA_VISIBLE_DEVICES`` is
        ``",".join(ids)``.

    Raises:
        ValueError: The host has fewer than ``count`` devices.
    """
    devices = host_devices()
    if count > len(devices):
        raise ValueError(
            f"the trial needs {count} GPUs, this host has {len(devices)} ({','.join(devices) or 'none'}); "
            f"run fewer ranks (--devices), or name the host's GPUs in {HOST_GPUS_ENV}=0,1,..."
        )
    folder = lock_dir()
    started = time.monotonic()
    reported = None
    while (held := _acquire(devices, count, folder, note)) is None:
        now = time.monotonic()
        if on_wait is not None and (reported is None or now - reported >= 30.0):
            waited = f" (waited {now - started:.0f} s)" if reported is not None else ""
            on_wait(f"waiting for {count} free GPUs of {len(devices)} on this host{waited}: {_busy(devices, folder)}")
            reported = now
        time.sleep(0.2)  # polling the locks: a lease may end in any other process
    try:
        yield tuple(d for d in devices if d in held)
    finally:
        for fd in held.values():
            os.close(fd)
