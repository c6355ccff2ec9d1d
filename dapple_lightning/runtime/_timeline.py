"""Per-rank event recording and Chrome trace export (opens in Perfetto and chrome://tracing).

Each rank records spans (forward, backward, send, receive, all-reduce) with its stage and
micro-batch, and samples of the memory it holds after each pass (a counter track). :func:`write_chrome_trace` turns the spans of all ranks into one trace-event JSON
file with one process track per rank, and :func:`bubble_fractions` summarises how much of a
step each stage spent idle.

On CUDA the host only queues work: a span timed on the host's clock would measure kernel
launches, and the trials that time plans with these spans (``plan="auto"``) would choose by
them. There a span records two CUDA events on the current stream instead (the profiler's clock,
``planner.device_clock``), and the spans are resolved when :attr:`Timeline.events` is read, with
one wait for the device then (and one per :data:`RESOLVE_EVERY` steps, which bounds the events
held): no step waits for the device to time itself.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dapple_lightning.planner import DeviceEvent, device_clock

__all__ = ["DeviceEvent", "Event", "Timeline", "bubble_fractions", "write_chrome_trace"]

COMPUTE = ("forward", "backward", "backward-input", "backward-weight")
RESOLVE_EVERY = 64
"""Steps whose device spans a timeline holds unresolved at most."""


@dataclass(frozen=True)
class Event:
    """One span on one rank. Times are seconds since the epoch (comparable across local ranks)."""

    name: str
    rank: int
    stage: int
    micro_batch: int
    start: float
    end: float
    step: int = 0
    value: float | None = None
    """Set for a sample of a counter track (``start == end``), not a span: bytes in use."""


class Timeline:
    """Collects events of one rank; disabled timelines cost one attribute check per span.

    Args:
        rank, stage: what every event is labelled with.
        enabled: record spans at all.
        clock: makes the device events that time spans (see :class:`DeviceEvent`); ``None``
            times them on the host until :meth:`time_on` names a CUDA device.
    """

    def __init__(
        self, rank: int, stage: int, enabled: bool = True, *, clock: Callable[[], DeviceEvent] | None = None
    ) -> None:
        self.rank, self.stage, self.enabled = rank, stage, enabled
        self._events: list[Event] = []
        self.counters: list[Event] = []
        """Samples of counter tracks (:meth:`counter`), apart from the spans in :attr:`events`."""
        self.step = 0
        # perf_counter is monotonic and fine-grained; anchor it to wall time once so that the
        # spans of different processes on one machine line up.
        self._offset = time.time() - time.perf_counter()
        self._clock = clock
        self._pending: list[tuple[str, int, DeviceEvent, DeviceEvent, int]] = []
        """Spans on the device clock, resolved into :attr:`events` when those are read."""

    @property
    def events(self) -> list[Event]:
        """The spans recorded so far, in order (those on the device clock resolved now, with one wait)."""
        self._resolve()
        return self._events

    def time_on(self, device: torch.device) -> None:
        """Time spans with CUDA events when the work runs on a CUDA device (unless given a clock)."""
        if self._clock is None:
            self._clock = device_clock(device)

    @contextmanager
    def span(self, name: str, micro_batch: int = -1) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        if self._clock is not None:
            begin = self._clock()
            begin.record()
            try:
                yield
            finally:
                finish = self._clock()
                finish.record()
                self._pending.append((name, micro_batch, begin, finish, self.step))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            self._events.append(
                Event(name, self.rank, self.stage, micro_batch, start + self._offset, end + self._offset, self.step)
            )

    def counter(self, name: str, value: float) -> None:
        """A sample of the counter track ``name`` (memory in use), timed now on the host's clock:
        on CUDA, where spans are timed on the device, it marks when the host queued the work."""
        if self.enabled:
            now = time.perf_counter() + self._offset
            self.counters.append(Event(name, self.rank, self.stage, -1, now, now, self.step, value))

    def end_step(self) -> None:
        """The step is over: count it (its device spans stay unresolved, see :attr:`events`)."""
        self.step += 1
        if self._pending and self.step - self._pending[0][4] >= RESOLVE_EVERY:
            self._resolve()

    def _resolve(self) -> None:
        """The device spans into :attr:`events`: one event recorded now and waited for marks when the
        device finished them; every span's times are counted back from it, on the wall clock the host
        reads at that moment."""
        if not self._pending:
            return
        assert self._clock is not None
        now = self._clock()
        now.record()
        now.synchronize()
        wall = time.time()
        for name, micro_batch, begin, finish, step in self._pending:
            start = wall - begin.elapsed_time(now) / 1e3
            end = wall - finish.elapsed_time(now) / 1e3
            self._events.append(Event(name, self.rank, self.stage, micro_batch, start, end, step))
        self._pending.clear()

    def abandon(self) -> None:
        """Forget the step's unresolved spans (it failed; the device may not answer). Those of earlier
        steps are dropped too: resolving them would wait for the device."""
        self._pending.clear()


def write_chrome_trace(events: Iterable[Event], path: str | Path) -> Path:
    """Write the events of every rank as Chrome trace-event JSON, one track (``pid``) per rank,
    with its counter samples (memory) as counter events on that rank's process."""
    events = sorted(events, key=lambda e: (e.rank, e.start))
    origin = min((e.start for e in events), default=0.0)
    trace: list[dict] = []
    for rank in sorted({e.rank for e in events}):
        stage = next(e.stage for e in events if e.rank == rank)
        trace.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank} (stage {stage})"},
            }
        )
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for e in events:
        if e.value is not None:  # a counter track of its own on the rank's process (Perfetto draws it)
            ts = (e.start - origin) * 1e6
            trace.append({"name": e.name, "ph": "C", "pid": e.rank, "tid": 0, "ts": ts, "args": {"bytes": e.value}})
            continue
        label = e.name if e.micro_batch < 0 else f"{e.name} {e.micro_batch}"
        trace.append(
            {
                "name": label,
                "cat": e.name,
                "ph": "X",
                "pid": e.rank,
                "tid": 0,
                "ts": (e.start - origin) * 1e6,
                "dur": max(e.end - e.start, 0.0) * 1e6,
                "args": {k: v for k, v in asdict(e).items() if k in ("stage", "micro_batch", "step")},
            }
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    os.replace(tmp, path)  # a crash mid-write keeps the previous trace whole
    return path


def bubble_fractions(events: Sequence[Event]) -> dict[int, float]:
    """Per stage: the share of each step's wall time its ranks spent outside forward/backward.

    A step's wall time runs from the first event to the last event of that step over all
    ranks; the fraction is averaged over the stage's ranks and the recorded steps.
    """
    steps = sorted({e.step for e in events})
    per_stage: dict[int, list[float]] = {}
    for step in steps:
        in_step = [e for e in events if e.step == step]
        span = max(e.end for e in in_step) - min(e.start for e in in_step)
        if span <= 0:
            continue
        for rank in sorted({e.rank for e in in_step}):
            mine = [e for e in in_step if e.rank == rank]
            busy = sum(e.end - e.start for e in mine if e.name in COMPUTE)
            per_stage.setdefault(mine[0].stage, []).append(1.0 - busy / span)
    return {s: sum(v) / len(v) for s, v in sorted(per_stage.items())}
