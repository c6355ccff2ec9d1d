"""The event loop of :mod:`planner._simulator`, apart from the cost model so that the cost
model itself can replay schedules it has no closed form for (zero bubble, ``_zero_bubble``).

Each stage runs its action list in order, one action at a time, each as soon as its input is
there: a forward when the previous stage's activation has crossed the link, a ``B`` (or an
unsplit backward) when the next stage's gradient has, a ``W`` at once (its ``B`` ran earlier on
the same stage). Links carry one transfer at a time in each direction, in the order they are
handed over. Each stage all-reduces its gradients after its last action and then steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dapple_lightning.schedule import Action, split_backwards

__all__ = ["COMPUTE", "Event", "replay", "replay_end"]

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
    placed: list[tuple[str, int, int | None, float, float]] = []
    _place(lists, forward, backward, weight, send, allreduce, update, placed)
    events = [Event(*event) for event in placed]
    events.sort(key=lambda e: (e.start, e.end, e.stage))
    return events


def replay_end(
    lists: Sequence[Sequence[Action]],
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    send: Sequence[float],
    allreduce: Sequence[float],
    update: Sequence[float],
) -> float:
    """When the last event of :func:`replay` (same arguments) ends, without building the events.

    Raises:
        RuntimeError: If the stages' lists wait on each other forever (a schedule bug).
    """
    return _place(lists, forward, backward, weight, send, allreduce, update, None)


def _place(
    lists: Sequence[Sequence[Action]],
    forward: Sequence[float],
    backward: Sequence[float],
    weight: Sequence[float],
    send: Sequence[float],
    allreduce: Sequence[float],
    update: Sequence[float],
    placed: list[tuple[str, int, int | None, float, float]] | None,
) -> float:
    """The replay of :func:`replay`: appends each event to ``placed`` (kind, stage, micro-batch,
    start, end) unless it is ``None``, and returns when the last one ends."""
    count = len(lists)
    steps = _timed(lists, forward, backward, weight)
    # activation[s][m] / gradient[s][m]: when stage s has micro-batch m's input / gradient.
    activation: list[dict[int, float]] = [{} for _ in range(count)]
    gradient: list[dict[int, float]] = [{} for _ in range(count)]
    for actions in steps:
        for _, m, _ in actions:
            activation[0][m] = 0.0
            gradient[count - 1][m] = 0.0
    forward_free = [0.0] * max(0, count - 1)
    backward_free = [0.0] * max(0, count - 1)
    clock = [0.0] * count
    cursor = [0] * count
    last = -math.inf
    remaining = sum(len(x) for x in steps)
    while remaining:
        progressed = False
        for s in range(count):
            actions, at, now = steps[s], cursor[s], clock[s]
            inputs, grads = activation[s], gradient[s]
            while at < len(actions):
                kind, m, seconds = actions[at]
                ready = inputs.get(m) if kind == "F" else grads.get(m) if kind == "B" else 0.0
                if ready is None:
                    break
                start = max(now, ready)
                end = now = start + seconds
                if end > last:
                    last = end
                if placed is not None:
                    placed.append((kind, s, m, start, end))
                # Hand the output to the link; each direction serves transfers in order.
                if kind == "F" and s < count - 1:
                    begin = max(end, forward_free[s])
                    forward_free[s] = activation[s + 1][m] = arrive = begin + send[s]
                    if send[s] > 0:
                        last = max(last, arrive)
                        if placed is not None:
                            placed.append(("send-act", s, m, begin, arrive))
                elif kind == "B" and s > 0:
                    begin = max(end, backward_free[s - 1])
                    backward_free[s - 1] = gradient[s - 1][m] = arrive = begin + send[s - 1]
                    if send[s - 1] > 0:
                        last = max(last, arrive)
                        if placed is not None:
                            placed.append(("send-grad", s - 1, m, begin, arrive))
                at += 1
                remaining -= 1
                progressed = True
            cursor[s], clock[s] = at, now
        if not progressed:
            stuck = {s: str(lists[s][cursor[s]]) for s in range(count) if cursor[s] < len(lists[s])}
            raise RuntimeError(f"schedule deadlocks: stages wait on each other at {stuck}")
    for s in range(count):
        if allreduce[s] > 0:
            end = clock[s] + allreduce[s]
            last = max(last, end)
            if placed is not None:
                placed.append(("allreduce", s, None, clock[s], end))
            clock[s] = end
        if update[s] > 0:
            end = clock[s] + update[s]
            last = max(last, end)
            if placed is not None:
                placed.append(("update", s, None, clock[s], end))
    return last


def _timed(
    lists: Sequence[Sequence[Action]], forward: Sequence[float], backward: Sequence[float], weight: Sequence[float]
) -> list[list[tuple[str, int, float]]]:
    """Each stage's actions as (kind, micro-batch, seconds). A micro-batch with a ``W`` on its
    stage splits its backward; the others' ``B`` is the whole one."""
    steps: list[list[tuple[str, int, float]]] = []
    for s, actions in enumerate(lists):
        split = split_backwards(actions)
        seconds = {"F": forward[s], "W": weight[s]}
        steps.append(
            [
                (a.kind, a.micro_batch, seconds[a.kind] if a.kind != "B" else
                 backward[s] - weight[s] if a.micro_batch in split else backward[s])
                for a in actions
            ]
        )  # fmt: skip
    return steps
