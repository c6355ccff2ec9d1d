"""Choosing among plans the cost model cannot tell apart: which to measure, in what turns, and
what the measurements teach the profile.

Pure policy: the measuring itself (a plan run for a few real steps on the process group) is a
callable handed in by ``plan="auto"`` (``dapple_lightning.autoplan``), so everything here runs
and is tested without a process group.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dapple_lightning.plan import ZERO_BUBBLE, Plan
from dapple_lightning.planner._choice import MeasuredPlan, PlanChoice, choose_measured
from dapple_lightning.planner._chunks import best_chunked_offers, estimate_chunked
from dapple_lightning.planner._cluster import Cluster
from dapple_lightning.planner._cost import CostModel, estimate
from dapple_lightning.planner._dp import plan_dapple
from dapple_lightning.planner._profile import ModelProfile

__all__ = [
    "TRIAL_LIMIT",
    "TRIAL_MARGIN",
    "TRIAL_ROUNDS",
    "Measured",
    "Trial",
    "measure_and_choose",
    "measure_in_turns",
    "predicted_step",
    "refine",
    "refine_allreduce",
    "shortlist",
]


TRIAL_MARGIN = 0.1
"""Plans predicted within this share of the best plan's step are measured before one is chosen:
the cost model's error target on real machines (``docs/benchmarks.md``)."""

TRIAL_LIMIT = 3
"""Most plans measured."""

TRIAL_ROUNDS = 3
"""Turns each plan gets at most (see :func:`measure_in_turns`)."""


@dataclass(frozen=True)
class Measured:
    """What a plan's real steps took: per step, and per micro-batch pass of each stage (its
    slowest replica, median over the steps)."""

    step_s: float
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]

    @classmethod
    def median(cls, runs: Sequence[Measured]) -> Measured:
        """Each figure's median over ``runs`` (of one plan)."""
        if not runs:
            raise ValueError("no runs to take the median of")

        def each(field: str) -> tuple[float, ...]:
            return tuple(statistics.median(column) for column in zip(*(getattr(r, field) for r in runs), strict=True))

        return cls(statistics.median(r.step_s for r in runs), each("forward_s"), each("backward_s"))


@dataclass(frozen=True)
class Trial:
    """A plan run for a few real steps in ``setup``."""

    plan: Plan
    predicted_step_s: float
    """From the profile before the trials refined it."""
    measured_step_s: float
    """Median over its turns."""
    turns: int = 1
    spread: float | None = None
    """Relative, as the choice rule reads it (:attr:`MeasuredPlan.spread`)."""


def shortlist(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    optimizer_factor: float = 2.0,
    margin: float = TRIAL_MARGIN,
    limit: int = TRIAL_LIMIT,
    objective: str = "time",
    memory_margin: float = 0.1,
    chunks: bool = True,
) -> tuple[list[tuple[Plan, float]], float | None, dict[Plan, str]]:
    """The planner's best plan and the others predicted within ``margin`` of it (a share of the
    best's step), pure data parallelism (M = 1) among them when it is that close, at most
    ``limit``, fastest predicted first; and data parallelism's predicted step (``None`` when it
    does not fit in memory or the batch); and for each chunked plan shortlisted, the sentence that
    says why it was offered (the plain plan it was made from, bubble, messages and memory against
    it). A pipeline the model prices faster under ``zb-h1``
    (or ``zb-h2``, ``zb-tail``) than under DAPPLE's schedule comes in both (:func:`_zero_bubble_variants`);
    with ``chunks``, its variants with two stages per rank group that are priced faster within the
    memory budget come in too (:func:`~._chunks.best_chunked_offers`).

    ``objective`` and ``memory_margin`` are :func:`plan_dapple`'s: under a memory objective
    every plan shortlisted, data parallelism included, keeps within the peak it allows, and
    the trials only choose among those."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit!r}")
    found = plan_dapple(
        profile,
        cluster,
        global_batch,
        top=limit,
        optimizer_factor=optimizer_factor,
        objective=objective,
        memory_margin=memory_margin,
    )
    candidates = [(p.plan, p.predicted_step_s) for p in found]
    allowed = found[0].peak_limit_bytes
    model = CostModel(profile, cluster, global_batch, optimizer_factor)
    offered = best_chunked_offers(model, [p.plan for p in found], allowed) if chunks else []
    candidates += _zero_bubble_variants(model, candidates, allowed)
    candidates += [(plan, step) for plan, step, _ in offered]
    dp_plan = Plan.data_parallel(profile.num_layers, cluster.world_size)
    try:
        dp = model.estimate(dp_plan)
        dp_step = dp.step_s if dp.fits else None
    except ValueError:  # fewer samples than devices: data parallelism cannot run at all
        dp_step = None
    within = dp_step is not None and (allowed is None or max(dp.memory_bytes) <= allowed)
    if within and all(plan != dp_plan for plan, _ in candidates):
        candidates.append((dp_plan, dp_step))
    candidates.sort(key=lambda c: c[1])
    best = candidates[0][1]
    close = [c for c in candidates if c[1] * (1.0 - margin) <= best]
    chosen = close[:limit]
    # Data parallelism is worth a measurement more than a third variant of one pipeline.
    if limit > 1 and within and (dp_plan, dp_step) in close[limit:]:
        chosen[-1] = (dp_plan, dp_step)
    reasons = {plan: reason for plan, _, reason in offered}
    return chosen, dp_step, {plan: reasons[plan] for plan, _ in chosen if plan in reasons}


def _zero_bubble_variants(
    model: CostModel, candidates: Sequence[tuple[Plan, float]], allowed: float | None
) -> list[tuple[Plan, float]]:
    """Each pipeline of ``candidates`` under ``zb-h1`` where the cost model prices it faster and
    it fits (within ``allowed`` too, when given): the dynamic program searches DAPPLE's chains,
    and a zero-bubble schedule of the same stages only moves the ``W``s (more activations on
    later stages, up to the first stage's). ``zb-h2`` comes in too where it is priced faster
    than ``zb-h1`` and fits: it holds up to ``2S - 1`` micro-batches per stage, memory spent
    only where the model says it buys time. ``zb-tail`` (at most that memory) comes in wherever
    it is priced faster than DAPPLE's order: it splits only the backwards whose ``W``s move, and
    a split costs more than the model's ``B + W`` says, so next to ``zb-h2`` (priced about the
    same on two stages) the shortlist's margin and the trials decide."""
    out = []
    for plan, predicted in candidates:
        if plan.num_stages < 2 or plan.schedule != "dapple":
            continue
        best = predicted
        for name in ZERO_BUBBLE:  # zb-h1 first: zb-h2 must beat it to be worth its memory
            zb = dataclasses.replace(plan, schedule=name)
            est = model.estimate(zb)
            if not any(est.weight_s):  # no W measured: the split's gain is unknown, its cost is not
                break
            faster = est.step_s < (predicted if name == "zb-tail" else best)
            if faster and est.fits and (allowed is None or max(est.memory_bytes) <= allowed):
                out.append((zb, est.step_s))
                best = min(best, est.step_s)
    return out


def measure_in_turns(
    plans: Sequence[Plan],
    trial: Callable[[Plan], Measured],
    *,
    rounds: int = TRIAL_ROUNDS,
) -> list[list[Measured]]:
    """Each plan's measurements (``trial(plan)``, a few real steps), taken in turns: in every
    round each plan still in the running gets one turn, in an order rotated from round to round,
    so that the machine drifting (other load, clocks, memory) weighs on all of them alike rather
    than on whichever came last. After a round, a plan that the choice rule
    (:func:`choose_measured`) already tells apart from the fastest, slower by more than their
    spreads, gets no more turns; one plan left ends the rounds.

    Close plans can differ by less than a machine drifts from one turn to the next, and one run
    of each in a row then ranks them in the order of the drift; ``docs/benchmarks.md`` ("Trials
    in turns") has the case that led here.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds!r}")
    runs: list[list[Measured]] = [[] for _ in plans]
    running = list(range(len(plans)))
    for turn in range(rounds):
        shift = turn % max(len(running), 1)
        for i in running[shift:] + running[:shift]:
            runs[i].append(trial(plans[i]))
        so_far = {i: _as_measured(plans[i], runs[i], i) for i in running}
        leader = max(so_far.values(), key=lambda m: (m.median, -m.order))
        running = [i for i in running if not leader.beats(so_far[i])]
        if len(running) <= 1:
            break
    return runs


def _as_measured(plan: Plan, runs: Sequence[Measured], order: int, global_batch: int = 1) -> MeasuredPlan:
    """A plan's turns as the choice rule reads them: samples/s per turn (no spread within a turn
    is recorded, so :data:`MIN_SPREAD` is assumed)."""
    return MeasuredPlan(plan, tuple(global_batch / m.step_s for m in runs), order=order)


def measure_and_choose(
    close: Sequence[tuple[Plan, float]],
    trial: Callable[[Plan], Measured],
    *,
    global_batch: int,
) -> tuple[PlanChoice, tuple[Trial, ...], list[tuple[Plan, Measured]]]:
    """``plan="auto"``'s trials: the shortlist ``close`` (plans and their predicted steps, from
    :func:`shortlist`) measured in turns (:func:`measure_in_turns`), each turn read as samples/s
    and a plan's place in the shortlist as its order, and chosen by the one rule every path that
    measures plans uses (:func:`choose_measured`). Returns the choice, each plan's :class:`Trial`,
    and each plan's median measurement (for :func:`refine`), in the shortlist's order."""
    plans = [plan for plan, _ in close]
    turns = measure_in_turns(plans, trial)
    measured = [_as_measured(p, t, i, global_batch) for i, (p, t) in enumerate(zip(plans, turns, strict=True))]
    choice = choose_measured(measured)
    runs = [(plan, Measured.median(t)) for plan, t in zip(plans, turns, strict=True)]
    trials = tuple(
        Trial(plan, predicted, median.step_s, len(t), m.spread)
        for (plan, predicted), (_, median), t, m in zip(close, runs, turns, measured, strict=True)
    )
    return choice, trials, runs


def refine(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    runs: list[tuple[Plan, Measured]],
    *,
    optimizer_factor: float = 2.0,
) -> ModelProfile:
    """``profile`` with each layer's times scaled by how its stages' passes measured in ``runs``
    against the prediction (the mean ratio over the stages that held the layer, forward and
    backward apart).

    Layers timed one by one miss what a stage pays inside a running pipeline: the other
    processes' work on shared cores and caches, the transport's copies, the runtime's own
    steps (how much, on the VGG example: ``docs/benchmarks.md``, "Planner: predicted vs
    measured").
    """
    ratios: list[tuple[list[float], list[float]]] = [([], []) for _ in profile.layers]
    model = CostModel(profile, cluster, global_batch, optimizer_factor)
    for plan, measured in runs:
        forward_s, backward_s = _predicted_passes(model, plan)
        for stage, f_real, b_real, f_model, b_model in zip(
            plan.stages, measured.forward_s, measured.backward_s, forward_s, backward_s
        ):
            for layer in range(stage.start, stage.end):
                if f_model > 0 and f_real > 0:
                    ratios[layer][0].append(f_real / f_model)
                if b_model > 0 and b_real > 0:
                    ratios[layer][1].append(b_real / b_model)
    data = profile.to_dict()
    for layer, (forward, backward) in zip(data["layers"], ratios, strict=True):
        f = statistics.fmean(forward) if forward else 1.0
        b = statistics.fmean(backward) if backward else 1.0
        for key, factor in (("forward_s", f), ("forward_fixed_s", f), ("backward_s", b), ("backward_fixed_s", b),
                            ("accumulate_s", b), ("weight_s", b)):  # fmt: skip
            if layer.get(key) is not None:
                layer[key] *= factor
    return ModelProfile.from_dict(data)


def _predicted_passes(model: CostModel, plan: Plan) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Each stage's predicted forward and backward of one micro-batch: the estimate's, or for a
    chunked plan (which :meth:`CostModel.estimate` does not price) the passes its replay times."""
    if plan.chunks == 1:
        predicted = model.estimate(plan)
        return predicted.forward_s, predicted.backward_s
    m = plan.micro_batches
    passes = [model.passes(s.start, s.end, m, model.samples(m, s.replicas)) for s in plan.stages]
    return tuple(f for f, _ in passes), tuple(b for _, b in passes)


def predicted_step(
    plan: Plan, profile: ModelProfile, cluster: Cluster, global_batch: int, *, optimizer_factor: float = 2.0
) -> tuple[float, tuple[float, ...]]:
    """``plan``'s predicted step and peak bytes per rank of each stage, chunked plans included
    (:func:`~._chunks.estimate_chunked`, whose peaks are per rank group: each stage gets its group's)."""
    model = CostModel(profile, cluster, global_batch, optimizer_factor)
    if plan.chunks == 1:
        predicted = model.estimate(plan)
        return predicted.step_s, predicted.memory_bytes
    chunked = estimate_chunked(model, plan)
    return chunked.step_s, tuple(chunked.memory_bytes[plan.group_of_stage(s)] for s in range(plan.num_stages))


def refine_allreduce(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    runs: list[tuple[Plan, Measured]],
    *,
    optimizer_factor: float = 2.0,
) -> Cluster:
    """``cluster`` with the all-reduce bandwidth that replicated one-stage plans in ``runs``
    showed (the slowest): what their steps took beyond their passes and optimizer step is the
    gradient all-reduce as training runs it (in buckets, on busy cores), which a lone timed
    all-reduce flatters. Unchanged without such runs, or where they beat the prediction."""
    nbytes = sum(layer.param_bytes for layer in profile.layers)
    found: list[tuple[float, int]] = []
    for plan, measured in runs:
        replicas = plan.stages[0].replicas
        if plan.num_stages != 1 or replicas < 2 or nbytes <= 0:
            continue
        servers = cluster.span(plan.stage_ranks(0))
        est = estimate(plan, profile, cluster, global_batch, optimizer_factor=optimizer_factor)
        passes = plan.micro_batches * (measured.forward_s[0] + measured.backward_s[0])
        seconds = measured.step_s - passes - est.update_s[0]
        if seconds <= est.allreduce_s[0]:
            continue
        # A ring moves 2 (r - 1) / r of the bytes over each link, after a fixed latency part.
        _, fixed = cluster.allreduce_coefficients(replicas, servers)
        found.append((2 * (replicas - 1) / replicas * nbytes / (seconds - fixed), servers))
    if not found:
        return cluster
    bandwidth, servers = min(found)
    return dataclasses.replace(cluster, **{"intra_allreduce_bw" if servers <= 1 else "inter_allreduce_bw": bandwidth})
