"""The cost model's price of a plan with several stages per rank group (chunks), and the chunked
variants of a plain plan worth offering.

Chunks trade transfers for bubble: with ``C`` stages per group a micro-batch crosses ``C`` times
as many cuts (those between two stages of one rank are free, handed over in the process), while
the warm-up and cooldown shrink to about ``1/C`` (interleaved) or vanish into ``W``s (the V
family). Memory moves too: interleaved holds more chunk micro-batches on the first groups than
1F1B holds stage micro-batches; ZB-V holds 1F1B's first-stage peak on every group; V-Half about
half of it.

Nothing here is a formula: the schedule's per-group lists are replayed event by event
(:func:`dapple_lightning.schedule.simulate`) with each stage's profiled forward, backward (split
into ``B`` and ``W`` under the V family, ``W`` from the profile's ``weight_s``) and the transfer
of each cut between two groups; a group then sums its stages' gradients (all-reduce over its
replicas) and updates them. Memory per group is its stages' parameters, gradients and optimizer
state plus the peak over the replay's order of the activations its live chunk micro-batches
keep.

:func:`offer_chunks` is what ``plan="auto"`` and the search call with a plain plan they priced:
the chunked variants of its replication (same rank groups, each group's layers cut in two) that
are predicted faster within the memory budget, each with the sentence their report prints.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dapple_lightning.plan import LAYOUTS, Plan, balanced_cuts
from dapple_lightning.planner._budget import format_bytes
from dapple_lightning.planner._zero_bubble import stage_weight
from dapple_lightning.schedule import Action, chunked_schedule, simulate

if TYPE_CHECKING:
    from dapple_lightning.planner._cost import CostModel, Estimate

__all__ = ["ChunkedEstimate", "best_chunked_offers", "chunked_variants", "estimate_chunked", "offer_chunks"]


@dataclass(frozen=True)
class ChunkedEstimate:
    """The predicted step of a chunked plan, its bubble, messages and memory per rank group."""

    plan: Plan
    step_s: float
    pipeline_s: float
    """When the last group's last pass ends (before the gradients' sum and the update)."""
    bubble_fraction: float
    """Idle share of the pipeline part of the step, averaged over the groups."""
    messages: int
    """Point-to-point messages per step between ranks (local hand-overs not counted)."""
    memory_bytes: tuple[float, ...]
    """Peak bytes per device of each rank group."""
    memory_limit: float

    @property
    def fits(self) -> bool:
        return max(self.memory_bytes) <= self.memory_limit


def estimate_chunked(model: CostModel, plan: Plan) -> ChunkedEstimate:
    """``model``'s estimate of ``plan``, a plan with chunks (see the module docstring)."""
    if plan.chunks == 1:
        raise ValueError("estimate_chunked prices plans with chunks > 1; use CostModel.estimate for the others")
    model.check(plan)
    m, stages, groups = plan.micro_batches, plan.stages, plan.num_groups
    places = model.placements(plan)
    samples = [model.samples(m, s.replicas) for s in stages]
    passes = [model.passes(s.start, s.end, m, n) for s, n in zip(stages, samples, strict=True)]
    split = plan.schedule != "interleaved"
    weight = [
        min(stage_weight(model, s.start, s.end, n), passes[k][1]) if split else 0.0
        for k, (s, n) in enumerate(zip(stages, samples, strict=True))
    ]
    lists = chunked_schedule(plan.schedule, groups, plan.chunks, m)

    def duration(_: int, action: Action) -> float:
        forward, backward = passes[action.stage]
        return {"F": forward, "B": backward - weight[action.stage], "W": weight[action.stage]}[action.kind]

    def transfer(src: int, dst: int, action: Action) -> float:
        if src == dst:
            return 0.0  # two stages of one rank: handed over in the process
        s = action.stage  # the receiving stage: its input's cut (F), its output's (B)
        if action.kind == "F":
            return model.transfer(stages[s].start, m, places[s - 1], places[s])
        return model.transfer(stages[s].end, m, places[s + 1], places[s])

    timed = simulate(lists, duration, transfer)
    pipeline = max(t.end for t in timed)
    busy = [sum(t.end - t.start for t in timed if t.rank == g) for g in range(groups)]
    closing = [0.0] * groups
    for s, stage in enumerate(stages):
        g = plan.group_of_stage(s)
        closing[g] += model.allreduce(stage.start, stage.end, places[s]) + model.update(stage.start, stage.end)
    ends = [max(t.end for t in timed if t.rank == g) + closing[g] for g in range(groups)]
    # One activation and one gradient per micro-batch (per piece on replicas) across each cut between groups.
    messages = 2 * m * sum(plan.group_of_stage(s) != plan.group_of_stage(s + 1) for s in range(plan.num_stages - 1))
    return ChunkedEstimate(
        plan=plan,
        step_s=max(ends),
        pipeline_s=pipeline,
        bubble_fraction=1 - sum(busy) / (groups * pipeline) if pipeline else 0.0,
        messages=messages,
        memory_bytes=tuple(_group_memory(model, plan, samples, lists[g], g) for g in range(groups)),
        memory_limit=model.cluster.memory_bytes,
    )


def _group_memory(model: CostModel, plan: Plan, samples: Sequence[int], actions: Sequence[Action], group: int) -> float:
    """A device of ``group``: its stages' static bytes plus the peak of what its live chunk micro-batches keep."""
    mine = [s for s in range(plan.num_stages) if plan.group_of_stage(s) == group]
    static = sum(model.memory.static_bytes(plan.stages[s].start, plan.stages[s].end) for s in mine)
    kept = {s: model.memory.kept_bytes(plan.stages[s].start, plan.stages[s].end, samples[s]) for s in mine}
    has_w = {(a.stage, a.micro_batch) for a in actions if a.kind == "W"}
    live = peak = 0.0
    for action in actions:
        if action.kind == "F":
            live += kept[action.stage]
        elif action.kind == "W" or (action.stage, action.micro_batch) not in has_w:
            live -= kept[action.stage]
        peak = max(peak, live)
    return static + peak


def chunked_variants(model: CostModel, plan: Plan, looped_chunks: int = 2) -> list[Plan]:
    """Plans with the replication of ``plan`` (one stage per group) and several stages per group:
    each layout with each of its schedules, ``looped_chunks`` stages per group looped and 2 in the
    V, the layers re-cut into stages of equal compute. Variants whose micro-batch count the
    schedule cannot run are left out."""
    if plan.chunks != 1:
        return []
    groups = plan.num_stages
    replicas, ranks = [s.replicas for s in plan.stages], [s.ranks for s in plan.stages]
    weights = [sum(model.compute(i, i + 1, model.profile.profile_batch_size)) for i in range(model.num_layers)]
    out = []
    for layout, schedules in LAYOUTS.items():
        chunks = looped_chunks if layout == "looped" else 2
        if chunks * groups > model.num_layers:
            continue
        cuts = balanced_cuts(weights, chunks * groups)
        for name in schedules:
            try:
                out.append(
                    Plan.from_cuts(cuts, replicas, plan.micro_batches, name, chunks=chunks, layout=layout, ranks=ranks)
                )
            except ValueError:
                continue  # e.g. interleaved with M not a multiple of G
    return out


def offer_chunks(
    model: CostModel,
    baseline: Estimate,
    looped_chunks: int = 2,
    keep: Callable[[Plan], bool] | None = None,
) -> list[tuple[ChunkedEstimate, str]]:
    """The chunked variants of ``baseline``'s plan (those ``keep`` keeps) predicted faster than it
    within the memory budget, fastest first, each with the reason a report prints."""
    offers = []
    for variant in chunked_variants(model, baseline.plan, looped_chunks):
        if keep is not None and not keep(variant):
            continue
        estimate = estimate_chunked(model, variant)
        if estimate.fits and estimate.step_s < baseline.step_s:
            offers.append((estimate, _reason(estimate, baseline)))
    return sorted(offers, key=lambda offer: offer[0].step_s)


def best_chunked_offers(
    model: CostModel,
    plans: Iterable[Plan],
    allowed: float | None = None,
    *,
    looped_chunks: int = 2,
    keep: Callable[[Plan], bool] | None = None,
) -> list[tuple[Plan, float, str]]:
    """The fastest chunked variant (:func:`offer_chunks`) of each pipeline among ``plans`` under
    DAPPLE's schedule whose stages neither recompute nor are offloaded (chunked plans run neither),
    priced faster than it within the memory budget (and ``allowed``, when given), with its
    predicted step and the sentence saying why; each plan once (two pipelines may re-cut to one).
    One per pipeline: its other layouts and schedules are priced slower, and the trials have a few
    turns to spend."""
    out: list[tuple[Plan, float, str]] = []
    for plan in plans:
        if plan.num_stages < 2 or plan.schedule != "dapple" or plan.chunks != 1:
            continue
        if any(stage.recompute or stage.offload is not None for stage in plan.stages):
            continue
        for chunked, reason in offer_chunks(model, model.estimate(plan), looped_chunks, keep):
            if allowed is None or max(chunked.memory_bytes) <= allowed:
                if all(chunked.plan != offered for offered, _, _ in out):
                    out.append((chunked.plan, chunked.step_s, reason))
                break
    return out


def _reason(chunked: ChunkedEstimate, baseline: Estimate) -> str:
    plan = chunked.plan
    return (
        f"{plan.schedule} with {plan.chunks} stages per group ({plan.layout}): predicted {chunked.step_s:.4g} s/step "
        f"against {baseline.step_s:.4g} s under {baseline.plan.schedule} (bubble {chunked.bubble_fraction:.0%} against "
        f"{baseline.bubble_fraction:.0%}; {chunked.messages} messages between ranks per step), peak memory "
        f"{format_bytes(max(chunked.memory_bytes))} per device within {format_bytes(chunked.memory_limit)}"
    )
