"""A discrete-event replay of one training step: the ground truth for the analytic model.

Every forward and backward (under zero bubble, its ``B`` and ``W`` apart) of every stage, every transfer and every replica group's
all-reduce is placed in time, by the rules of ``schedule.simulate``: each stage runs its
schedule list in order, one action at a time, each action as soon as its inputs are there.
On top of those rules the links are resources: the link between stages ``s`` and ``s + 1``
carries one activation at a time forwards and one gradient at a time backwards (full duplex),
each direction first come first served in micro-batch order, so a transfer may queue behind
the previous one. Each stage all-reduces its gradients once its last backward (or ``W``) is
done. The cost model replays schedules it has no closed form for (zero bubble, ``_zero_bubble``)
with the same loop (:func:`replay_end`), so this module knows the cost model only by its types.

``schedule.simulate`` takes a transfer as a fixed delay after its producer, which cannot
express a queue (the delay depends on when the producer ends); hence this replay. With
free links it places every action exactly where ``schedule.simulate`` does (tested).

The analytic model's chains are chains of this replay too, so its latency is never above the
simulated one, and equal when stages are uniform and transfers free (tested).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from dapple_lightning.plan import Plan
from dapple_lightning.schedule import Action, schedule, split_backwards

if TYPE_CHECKING:
    from dapple_lightning.planner._cost import CostModel, Estimate

__all__ = ["Event", "Simulation", "replay", "replay_end", "simulate_plan", "simulated_step_s"]


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


@dataclass(frozen=True)
class Simulation:
    """The replayed step of one plan."""

    plan: Plan
    step_s: float
    """Seconds from the first forward to the last all-reduce."""
    events: tuple[Event, ...]


def simulate_plan(model: CostModel, plan: Plan) -> Simulation:
    """Replay one step of ``plan`` with the costs of ``model`` (see the module docstring).

    Raises:
        RuntimeError: If the stages' lists wait on each other forever (a schedule bug).
    """
    events = replay(*_arguments(plan, model.estimate(plan)))
    return Simulation(plan=plan, step_s=max(e.end for e in events), events=tuple(events))


def simulated_step_s(model: CostModel, plan: Plan, estimate: Estimate | None = None) -> float:
    """``simulate_plan(model, plan).step_s`` without placing the events (``estimate``: the
    model's estimate of ``plan``, when the caller has it).

    Raises:
        RuntimeError: If the stages' lists wait on each other forever (a schedule bug).
    """
    return replay_end(*_arguments(plan, model.estimate(plan) if estimate is None else estimate))


def _arguments(plan: Plan, est: Estimate) -> tuple[Any, ...]:
    """:func:`replay`'s arguments for ``plan``: its schedule's lists and ``est``'s costs of its stages."""
    weight = est.weight_s or (0.0,) * plan.num_stages
    lists = _lists(plan.schedule, plan.num_stages, plan.micro_batches)
    return lists, est.forward_s, est.backward_s, weight, est.send_forward_s, est.allreduce_s, est.update_s


@lru_cache(maxsize=8)
def _lists(name: str, stages: int, micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    """``schedule(name, stages, micro_batches)``, kept: the planner replays its best plans one after
    another, often with the same number of stages and micro-batches."""
    return tuple(tuple(actions) for actions in schedule(name, stages, micro_batches))
