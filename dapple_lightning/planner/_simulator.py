"""A discrete-event replay of one training step: the ground truth for the analytic model.

Every forward and backward of every stage, every transfer and every replica group's
all-reduce is placed in time, by the rules of ``schedule.simulate``: each stage runs its
schedule list in order, one action at a time, each action as soon as its inputs are there.
On top of those rules the links are resources: the link between stages ``s`` and ``s + 1``
carries one activation at a time forwards and one gradient at a time backwards (full duplex),
each direction first come first served in micro-batch order, so a transfer may queue behind
the previous one. Each stage all-reduces its gradients once its last backward is done.

``schedule.simulate`` takes a transfer as a fixed delay after its producer, which cannot
express a queue (the delay depends on when the producer ends); hence this replay. With
free links it places every action exactly where ``schedule.simulate`` does (tested).

The analytic model's chains are chains of this replay too, so its latency is never above the
simulated one, and equal when stages are uniform and transfers free (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from dapple_lightning.plan import Plan
from dapple_lightning.planner._cost import CostModel
from dapple_lightning.schedule import schedule

__all__ = ["Event", "Simulation", "simulate_plan"]


@dataclass(frozen=True)
class Event:
    """One thing that happens in a step, placed in time."""

    kind: str
    """``"F"``/``"B"`` (compute), ``"send-act"``/``"send-grad"`` (activations or gradients
    crossing a link), ``"allreduce"`` or ``"update"`` (the optimizer step after it)."""
    stage: int
    """The stage; for a transfer, the earlier stage of the link ``stage -> stage + 1``."""
    micro_batch: int | None
    start: float
    end: float


@dataclass(frozen=True)
class Simulation:
    """The replayed step of one plan."""

    plan: Plan
    step_s: float
    """Seconds from the first forward to the last all-reduce."""
    events: tuple[Event, ...]

    def busy_s(self, stage: int) -> float:
        """Compute seconds of ``stage`` (forwards and backwards)."""
        return sum(e.end - e.start for e in self.events if e.stage == stage and e.kind in ("F", "B"))

    @property
    def bubble_fraction(self) -> float:
        """Share of the stages' time spent not computing (all-reduce counts as not computing)."""
        count = self.plan.num_stages
        busy = sum(self.busy_s(s) for s in range(count))
        return 1.0 - busy / (count * self.step_s) if self.step_s > 0 else 0.0


def simulate_plan(model: CostModel, plan: Plan) -> Simulation:
    """Replay one step of ``plan`` with the costs of ``model`` (see the module docstring).

    Raises:
        RuntimeError: If the stages' lists wait on each other forever (a schedule bug).
    """
    est = model.estimate(plan)
    count = plan.num_stages
    lists = schedule(plan.schedule, count, plan.micro_batches)
    fwd, bwd, send = est.forward_s, est.backward_s, est.send_forward_s
    # arrived[s][m]: when stage s has micro-batch m's input (forward) / gradient (backward).
    activation: list[dict[int, float]] = [{} for _ in range(count)]
    gradient: list[dict[int, float]] = [{} for _ in range(count)]
    for m in range(plan.micro_batches):
        activation[0][m] = 0.0
        gradient[count - 1][m] = 0.0
    forward_free = [0.0] * max(0, count - 1)
    backward_free = [0.0] * max(0, count - 1)
    clock = [0.0] * count
    cursor = [0] * count
    events: list[Event] = []
    remaining = sum(len(x) for x in lists)
    while remaining:
        progressed = False
        for s in range(count):
            while cursor[s] < len(lists[s]):
                action = lists[s][cursor[s]]
                m = action.micro_batch
                ready = (activation if action.kind == "F" else gradient)[s].get(m)
                if ready is None:
                    break
                start = max(clock[s], ready)
                end = start + (fwd[s] if action.kind == "F" else bwd[s])
                clock[s] = end
                events.append(Event(action.kind, s, m, start, end))
                # Hand the output to the link; each direction serves micro-batches in order.
                if action.kind == "F" and s < count - 1:
                    begin = max(end, forward_free[s])
                    forward_free[s] = activation[s + 1][m] = begin + send[s]
                    if send[s] > 0:
                        events.append(Event("send-act", s, m, begin, begin + send[s]))
                elif action.kind == "B" and s > 0:
                    begin = max(end, backward_free[s - 1])
                    backward_free[s - 1] = gradient[s - 1][m] = begin + send[s - 1]
                    if send[s - 1] > 0:
                        events.append(Event("send-grad", s - 1, m, begin, begin + send[s - 1]))
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(lists[s][cursor[s]]) for s in range(count) if cursor[s] < len(lists[s])}
            raise RuntimeError(f"schedule deadlocks: stages wait on each other at {stuck}")
    for s in range(count):
        if est.allreduce_s[s] > 0:
            events.append(Event("allreduce", s, None, clock[s], clock[s] + est.allreduce_s[s]))
            clock[s] += est.allreduce_s[s]
        if est.update_s[s] > 0:
            events.append(Event("update", s, None, clock[s], clock[s] + est.update_s[s]))
    events.sort(key=lambda e: (e.start, e.end, e.stage))
    return Simulation(plan=plan, step_s=max(e.end for e in events), events=tuple(events))
