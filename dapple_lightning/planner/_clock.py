"""Timing device work: CUDA events on a CUDA device, the host's clock elsewhere.

On CUDA the host only queues kernels: ``perf_counter`` around a layer measures its launches, and
a ``synchronize`` before and after each layer (to make the host clock honest) stalls the queue
that training keeps full. A CUDA event pair recorded on the current stream times what the device
did between them; the host waits once, when it reads the times. The profiler's layers and
optimizer steps (``planner._measure``) and the runtime's timeline (``runtime.Timeline``, whose
spans feed ``plan="auto"``'s trials) take their events from :func:`device_clock`.

Elsewhere the work runs as the host calls it (CPU), or the device is synchronised around each
span (other accelerators), and the host's ``perf_counter`` times it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

__all__ = ["DeviceEvent", "Stopwatch", "device_clock"]


class DeviceEvent(Protocol):
    """What a span needs of a device event (``torch.cuda.Event(enable_timing=True)`` has it)."""

    def record(self) -> Any: ...

    def synchronize(self) -> Any: ...

    def elapsed_time(self, end_event: Any) -> float:
        """Milliseconds from this event to ``end_event``."""
        ...


def device_clock(device: torch.device) -> Callable[[], DeviceEvent] | None:
    """Makes timing events for work on ``device``: CUDA events on a CUDA device, else ``None`` (time on the host)."""
    if device.type != "cuda":
        return None
    import torch

    return lambda: torch.cuda.Event(enable_timing=True)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize()


class Stopwatch:
    """Seconds of spans of work on ``device``, read together once the work is done: timed by
    :func:`device_clock`'s events (CUDA events on CUDA), or where it has none (``clock`` is
    ``None``), each span synchronises the device and reads the host's clock."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock = device_clock(device)
        self._spans: list[float | tuple[DeviceEvent, DeviceEvent]] = []

    @contextmanager
    def span(self) -> Iterator[None]:
        """Time the work queued inside the block (no wait for the device on an event clock)."""
        if self.clock is not None:
            begin = self.clock()
            begin.record()
            yield
            finish = self.clock()
            finish.record()
            self._spans.append((begin, finish))
            return
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self._spans.append(time.perf_counter() - start)

    def seconds(self) -> list[float]:
        """Every span's seconds since the last call, in the order they began (one wait for the device)."""
        spans, self._spans = self._spans, []
        events = [span for span in spans if not isinstance(span, float)]
        if events:
            events[-1][1].synchronize()  # the last span's end: every earlier event is done too (one stream)
        return [span if isinstance(span, float) else span[0].elapsed_time(span[1]) / 1e3 for span in spans]
