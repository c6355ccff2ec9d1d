"""A discrete-event replay of one training step: the ground truth for the analytic model.

Every forward and backward (under zero bubble, its ``B`` and ``W`` apart) of every stage, every transfer and every replica group's
all-reduce is placed in time, by the rules of ``schedule.simulate``: each stage runs its
schedule list in order, one action at a time, each action as soon as its inputs are there.
On top of those rules the links are resources: the link between stages ``s`` and ``s + 1``
carries one activation at a time forwards and one gradient at a time backwards (full duplex),
each direction first come first served in micro-batch order, so a transfer may queue behind
the previous one. Each stage all-reduces its gradients once its last backward (or ``W``) is
done. The loop itself is ``_replay``'s, which the cost model uses for zero bubble.

``schedule.simulate`` takes a transfer as a fixed delay after its producer, which cannot
express a queue (the delay depends on when the producer ends); hence this replay. With
free links it places every action exactly where ``schedule.simulate`` does (tested).

The analytic model's chains are chains of this replay too, so its latency is never above the
simulated one, and equal when stages are uniform and transfers free (tested).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from dapple_lightning.plan import Plan
from dapple_lightning.planner._cost import CostModel, Estimate
from dapple_lightning.planner._replay import COMPUTE, Event, replay, replay_end
from dapple_lightning.schedule import Action, schedule

__all__ = ["Event", "Simulation", "simulate_plan", "simulated_step_s"]


@dataclass(frozen=True)
class Simulation:
    """The replayed step of one plan."""

    plan: Plan
    step_s: float
    """Seconds from the first forward to the last all-reduce."""
    events: tuple[Event, ...]

    def busy_s(self, stage: int) -> float:
        """Compute seconds of ``stage`` (forwards, backwards and weight backwards)."""
        return sum(e.end - e.start for e in self.events if e.stage == stage and e.kind in COMPUTE)

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
    lists = schedule(plan.schedule, plan.num_stages, plan.micro_batches)
    weight = est.weight_s or (0.0,) * plan.num_stages
    events = replay(lists, est.forward_s, est.backward_s, weight, est.send_forward_s, est.allreduce_s, est.update_s)
    return Simulation(plan=plan, step_s=max(e.end for e in events), events=tuple(events))


def simulated_step_s(model: CostModel, plan: Plan, estimate: Estimate | None = None) -> float:
    """``simulate_plan(model, plan).step_s`` without placing the events (``estimate``: the
    model's estimate of ``plan``, when the caller has it).

    Raises:
        RuntimeError: If the stages' lists wait on each other forever (a schedule bug).
    """
    est = model.estimate(plan) if estimate is None else estimate
    lists = _lists(plan.schedule, plan.num_stages, plan.micro_batches)
    weight = est.weight_s or (0.0,) * plan.num_stages
    return replay_end(lists, est.forward_s, est.backward_s, weight, est.send_forward_s, est.allreduce_s, est.update_s)


@lru_cache(maxsize=8)
def _lists(name: str, stages: int, micro_batches: int) -> tuple[tuple[Action, ...], ...]:
    """``schedule(name, stages, micro_batches)``, kept: the planner replays its best plans one after
    another, often with the same number of stages and micro-batches."""
    return tuple(tuple(actions) for actions in schedule(name, stages, micro_batches))
