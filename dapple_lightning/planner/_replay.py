"""The event loop of :mod:`planner._simulator`, apart from the cost model so that the cost
model itself can replay schedules it has no closed form for (zero bubble, ``_zero_bubble``).

Each stage runs its action list in order, one action at a time, each as soon as its input is
there: a forward when the previous stage's activation has crossed the link, a ``B`` (or an
unsplit backward) when the next stage's gradient has, a ``W`` at once (its ``B`` ran earlier on
the same stage). Links carry one transfer at a time in each direction, in the order they are
handed over. Each stage all-reduces its gradients after its last action and then steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dapple_lightning.schedule import Action, split_backwards

__all__ = ["COMPUTE", "Event", "replay"]

COMPUTE = ("F", "B", "W")
"""Event kinds that are a stage computing."""


@dataclass(frozen=True)
class Event:
    """One thing that happens in a step, placed in time."""

    kind: str
    """``"F"``/``"B"``/``"W"`` (compute; ``B`` is the whole backward unless the stage's list
    has a ``W`` of that micro-batch), ``"send-act"``/``"send-grad"`` (activations or gradients crossing a link),
    ``"allreduce"`` or ``"update"`` (the optimizer step after it)."""
    stage: int
    """The stage; for a transfer, the earlier stage of the link ``stage -> stage + 1``."""
    micro_batch: int | None
    start: float
    end: float


def replay(
    lists: Sequence[Sequence[Action]],
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    send: Sequence[float],
    allreduce: Sequence[float],
    update: Sequence[float],
) -> list[Event]:
    """Place every action of ``lists`` (one per stage) in time, sorted by start.

    ``backward[s]`` is stage ``s``'s whole backward; a micro-batch with a ``W`` in its stage's list
    takes ``backward[s] - weight[s]`` in its ``B`` and ``weight[s]`` in its ``W``, the others
    the whole backward in their ``B``. ``send[s]`` is one transfer across
    the link ``s -> s + 1`` (either direction).

    Raises:
        RuntimeError: If the stages' lists wait on each other forever (a schedule bug).
    """
    count = len(lists)
    micro_batches = {a.micro_batch for actions in lists for a in actions}
    # A micro-batch with a W on its stage splits its backward; the others' B is the whole one.
    split = [split_backwards(actions) for actions in lists]

    def duration(s: int, action: Action) -> float:
        if action.kind == "F":
            return forward[s]
        if action.kind == "W":
            return weight[s]
        return backward[s] - weight[s] if action.micro_batch in split[s] else backward[s]

    # arrived[s][m]: when stage s has micro-batch m's input (forward) / gradient (backward).
    activation: list[dict[int, float]] = [{} for _ in range(count)]
    gradient: list[dict[int, float]] = [{} for _ in range(count)]
    for m in micro_batches:
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
                ready = {"F": activation, "B": gradient}[action.kind][s].get(m) if action.kind != "W" else 0.0
                if ready is None:
                    break
                start = max(clock[s], ready)
                end = clock[s] = start + duration(s, action)
                events.append(Event(action.kind, s, m, start, end))
                # Hand the output to the link; each direction serves transfers in order.
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
        if allreduce[s] > 0:
            events.append(Event("allreduce", s, None, clock[s], clock[s] + allreduce[s]))
            clock[s] += allreduce[s]
        if update[s] > 0:
            events.append(Event("update", s, None, clock[s], clock[s] + update[s]))
    events.sort(key=lambda e: (e.start, e.end, e.stage))
    return events
