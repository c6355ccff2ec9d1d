"""The smallest offload window whose transfers hide behind compute (STRONGHOLD's choice).

An offloaded stage (``offload: W``) moves its layers through one worker that reads and writes in
the order asked: when layer ``i`` starts, the layers that left the window are written out and the
layers up to ``W - 1`` ahead are read in, and layer ``i`` waits for its own read. A window is tried
by replaying one forward sweep (parameters read, nothing written) and one backward sweep
(parameters and gradients read, gradients written) from measured per-layer times, which says how
long each layer waits. :func:`choose_window` takes the smallest window (of at most :data:`AUTO_WINDOW_MOST` layers) whose
waits stay within a share of the compute, or, when none does, the one that waits least, naming the
layers that still wait. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["AUTO_WINDOW_MOST", "WindowChoice", "choose_window"]

AUTO_WINDOW_MOST = 4
"""The largest window :func:`choose_window` picks (``offload: auto``), so that the memory budget can
price an ``auto`` stage before its window is measured. One worker moves the layers one after the
other, so once a window holds the next layer's read its queue is full: a wider one hides more only
where a few layers move much more than they compute (their neighbours' compute absorbs the burst)."""


@dataclass(frozen=True)
class WindowChoice:
    """A window and what it costs: the seconds layers wait for transfers per forward + backward."""

    window: int
    wait_s: float
    """Seconds layers wait for transfers per forward + backward (the first read of each sweep aside)."""
    compute_s: float
    stalls: tuple[int, ...]
    """Layers that wait for their transfer at this window (by index in the stage)."""

    @property
    def hidden(self) -> bool:
        return not self.stalls

    def describe(self) -> str:
        if self.hidden:
            return f"offload window {self.window}: transfers hide behind compute"
        return (
            f"offload window {self.window}: layers {list(self.stalls)} wait for their transfers "
            f"({self.wait_s * 1e3:.1f} ms per forward + backward against {self.compute_s * 1e3:.1f} ms of compute)"
        )


def _sweep(order: Sequence[int], compute: Sequence[float], read: Sequence[float], write: Sequence[float], window: int):
    """Per layer of ``order``: how long it waits; the worker reads and writes one thing at a time."""
    now = worker = 0.0
    ready: dict[int, float] = {}
    waits = {}
    for at, i in enumerate(order):
        wanted = order[at : at + window]
        for j in [j for j in ready if j not in wanted]:  # out first, then in
            worker = max(worker, now) + write[j]
            del ready[j]
        for j in wanted:
            if j not in ready:
                worker = max(worker, now) + read[j]
                ready[j] = worker
        start = max(now, ready[i])
        waits[i] = start - now
        now = start + compute[i]
    return waits


def choose_window(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    read_s: Sequence[float],
    write_s: Sequence[float],
    *,
    tolerance: float = 0.05,
    most: int = AUTO_WINDOW_MOST,
) -> WindowChoice:
    """The smallest window up to ``most`` layers whose layers wait at most ``tolerance`` of the compute
    (and each layer at most that share of its own), else the window up to ``most`` that waits least,
    naming the layers that wait. The first layer of each sweep waits for its own read under any
    window: that wait is not counted. ``read_s``/``write_s``: one layer's parameters (as many bytes
    as its gradients) read from and written to the tier."""
    n = len(forward_s)
    if n == 0 or not len(backward_s) == len(read_s) == len(write_s) == n:
        raise ValueError(
            "choose_window needs one forward, backward, read and write time per layer (at least one layer)"
        )
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ValueError(f"choose_window's most is the largest window in layers, an integer >= 1, got {most!r}")
    compute = sum(forward_s) + sum(backward_s)
    best: WindowChoice | None = None
    for window in range(1, min(n, most) + 1):
        # Forward reads parameters and writes nothing (they did not change); backward reads
        # parameters and gradients and writes the gradients back.
        forward = _sweep(range(n), forward_s, read_s, [0.0] * n, window)
        backward = _sweep(range(n - 1, -1, -1), backward_s, [2 * r for r in read_s], write_s, window)
        forward[0] = backward[n - 1] = 0.0  # nothing is in memory when a sweep starts
        waits = {i: forward[i] + backward[i] for i in range(n)}
        total = sum(waits.values())
        stalls = tuple(i for i in range(n) if waits[i] > tolerance * (forward_s[i] + backward_s[i]))
        choice = WindowChoice(window, total, compute, stalls)
        if total <= tolerance * compute and not stalls:
            return choice
        if best is None or total < best.wait_s - 1e-12:
            best = choice
    assert best is not None
    return best
