"""Spans time the device's work: on CUDA from events resolved when read (no step waits for the device),
on CPU from the host clock."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import Pipeline, Timeline, _timeline, p2p_groups, write_chrome_trace
from dapple_lightning.surgery import partition

from distributed import run_ranks
from user_steps import LossStep


class DeviceClock:
    """Device events on a clock the test moves (``step`` seconds further at every record)."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step, self.waits = 0.0, step, 0

    def event(self) -> _Event:
        return _Event(self)


class _Event:
    def __init__(self, clock: DeviceClock) -> None:
        self.clock, self.at = clock, None

    def record(self) -> None:
        self.at = self.clock.now
        self.clock.now += self.clock.step

    def synchronize(self) -> None:
        self.clock.waits += 1

    def elapsed_time(self, end: _Event) -> float:
        assert self.at is not None and end.at is not None, "an event read before it was recorded"
        return (end.at - self.at) * 1e3


def _no_host_clock() -> float:
    raise AssertionError("a span on a device clock read the host's perf_counter")


def test_device_spans_resolve_from_events_when_read(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = DeviceClock()
    timeline = Timeline(0, 1, clock=clock.event)
    with monkeypatch.context() as patched:
        patched.setattr(_timeline.time, "perf_counter", _no_host_clock)
        with timeline.span("forward", 0):
            clock.now += 2.0  # the device ran this long, whatever the host did meanwhile
        clock.now += 0.5
        with timeline.span("backward", 0):
            clock.now += 3.0
        timeline.end_step()
        assert clock.waits == 0  # nothing waits for the device inside the step, nor at its end
    forward, backward = timeline.events
    assert clock.waits == 1
    assert (forward.name, forward.stage, forward.micro_batch, forward.step) == ("forward", 1, 0, 0)
    assert forward.end - forward.start == pytest.approx(2.0)
    assert backward.end - backward.start == pytest.approx(3.0)
    assert backward.start - forward.end == pytest.approx(0.5)
    assert timeline.step == 1


def test_host_spans_keep_the_host_clock_on_cpu() -> None:
    timeline = Timeline(0, 0)
    timeline.time_on(torch.device("cpu"))
    with timeline.span("forward", 3):
        pass
    (event,) = timeline.events  # recorded at once, before the step ends
    assert event.name == "forward" and event.micro_batch == 3 and event.end >= event.start


def test_held_spans_are_resolved_every_few_steps() -> None:
    clock = DeviceClock(step=1.0)
    timeline = Timeline(0, 0, clock=clock.event)
    for _ in range(_timeline.RESOLVE_EVERY * 2 + 1):
        with timeline.span("forward", 0):
            pass
        timeline.end_step()
    assert clock.waits == 2 and len(timeline._pending) == 1
    assert [e.step for e in timeline.events] == list(range(_timeline.RESOLVE_EVERY * 2 + 1))


def test_an_abandoned_step_leaves_no_spans() -> None:
    clock = DeviceClock(step=1.0)
    timeline = Timeline(0, 0, clock=clock.event)
    with timeline.span("forward", 0):
        pass
    timeline.abandon()
    timeline.end_step()
    assert timeline.events == [] and clock.waits == 0 and timeline.step == 1


def timed_steps(rank: int, world_size: int, steps: int) -> tuple[list[tuple[str, int, float]], int]:
    plan = Plan(stages=[{"layers": [0, 2], "replicas": 1}, {"layers": [2, 3], "replicas": 1}], micro_batches=2)
    torch.manual_seed(0)
    stage = partition(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), plan, rank)
    clock = DeviceClock(step=1.0)  # every span lasts exactly 1 s on this clock
    pipe = Pipeline(
        plan,
        rank,
        stage,
        device=torch.device("cpu"),
        timeline=Timeline(rank, rank, clock=clock.event),
        p2p_groups=p2p_groups(),
    )
    x, y = torch.randn(4, 4), torch.randn(4, 2)

    def forward(m, rows):
        return nn.functional.mse_loss(stage(x[rows.start : rows.stop]), y[rows.start : rows.stop]) / 2

    for _ in range(steps):
        pipe.run(4, LossStep(forward))
    assert clock.waits == 0  # the steps never waited for the device to time themselves
    return [(e.name, e.step, e.end - e.start) for e in pipe.timeline.events], clock.waits


def test_a_pipeline_resolves_its_spans_once_when_read() -> None:
    for events, waits in run_ranks(timed_steps, 2, 2):
        assert waits == 1
        assert {step for _, step, _ in events} == {0, 1}
        assert {name for name, _, _ in events} >= {"forward", "backward", "send", "recv"}
        assert all(seconds == pytest.approx(1.0) for _, _, seconds in events)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_spans_come_from_cuda_events(monkeypatch: pytest.MonkeyPatch) -> None:
    timeline = Timeline(0, 0)
    timeline.time_on(torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")
    with monkeypatch.context() as patched:
        patched.setattr(_timeline.time, "perf_counter", _no_host_clock)
        with timeline.span("forward", 0):
            for _ in range(8):
                a = a @ a / a.norm()
        with timeline.span("backward", 0):
            a = a @ a
        timeline.end_step()
    forward, backward = timeline.events
    assert forward.start <= forward.end <= backward.start <= backward.end


def test_memory_samples_become_a_counter_track_of_the_rank(tmp_path) -> None:
    import json

    timeline = Timeline(rank=1, stage=0)
    with timeline.span("forward", 0):
        pass
    timeline.counter("memory", 4096)
    assert [e.name for e in timeline.events] == ["forward"]  # the spans alone
    path = write_chrome_trace([*timeline.events, *timeline.counters], tmp_path / "t.json")
    events = json.loads(path.read_text())["traceEvents"]
    (sample,) = [e for e in events if e["ph"] == "C"]
    assert sample["name"] == "memory" and sample["pid"] == 1 and sample["args"] == {"bytes": 4096}
    assert [e["name"] for e in events if e["ph"] == "X"] == ["forward 0"]
    disabled = Timeline(rank=0, stage=0, enabled=False)
    disabled.counter("memory", 1)
    assert disabled.counters == []
