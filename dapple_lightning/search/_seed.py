"""The planner's picks, as the first plans a study measures.

The planner (:mod:`dapple_lightning.planner`) ranks plans with an analytic cost model in
milliseconds; the search measures plans in seconds each. Measuring the planner's top plans first
gives the sampler good points to start from and tells the user how far the cost model is from
the machine. The profile comes from the search's probe (``_probe``); the cluster is a single
node of ``world_size`` devices with rough loopback figures (:func:`local_cluster`), which is what
CPU processes on one machine are, sharing the machine's cores (:func:`compute_units`): with
more ranks busy than cores, data parallelism waits for the cores, and a pipeline that keeps
only some ranks busy at a time may beat it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import optuna

from dapple_lightning.plan import CHUNKED_SCHEDULES, SCHEDULES, ZERO_BUBBLE, Plan
from dapple_lightning.search._space import PlanSpace, describe_plan
from dapple_lightning.trials import TrialConfig

__all__ = [
    "BASELINES",
    "SeedPlan",
    "baseline_plans",
    "chunked_offers",
    "compute_units",
    "enqueue_planner_seeds",
    "local_cluster",
    "planner_seeds",
]

BASELINES = ("data_parallel", "straight")
"""Plans every search measures first, by name: the simplest alternatives a found plan must beat."""


@dataclass(frozen=True)
class SeedPlan:
    """A plan the planner proposes, with its predicted step time."""

    plan: Plan
    rank: int
    """0 for the planner's first choice."""
    predicted_step_s: float


def _memory_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16e9


def compute_units(trial: TrialConfig) -> int | None:
    """How many of a trial's ranks can compute at once on this host: ``None`` for ranks on GPUs
    (each has its own), else the cores this process may use over the threads of one rank."""
    from dapple_lightning.planner import cores

    if trial.leases_devices:
        return None
    return max(1, cores() // trial.threads)


def local_cluster(world_size: int, units: int | None = None, memory_limit: float | None = None) -> Any:
    """One node of ``world_size`` devices joined by loopback: ~2 GB/s point to point, ~1 GB/s
    all-reduce links, 50 us per message, the machine's memory shared evenly or ``memory_limit``
    bytes per rank (rough figures: the
    planner's ranking matters here, not its absolute times), ``units`` compute units shared by
    the devices (``None``: independent devices, see :func:`compute_units`)."""
    from dapple_lightning.planner import Cluster

    return Cluster(
        nodes=1,
        devices_per_node=world_size,
        intra_p2p_bw=2e9,
        inter_p2p_bw=2e9,
        intra_allreduce_bw=1e9,
        inter_allreduce_bw=1e9,
        latency_s=50e-6,
        memory_bytes=_memory_bytes() / world_size if memory_limit is None else memory_limit,
        compute_units=units,
    )


EXHAUSTIVE = 20_000
"""Spaces of at most this many plans are ranked plan by plan with the cost model; larger ones by
the planner's dynamic program."""
CHUNKED_EXHAUSTIVE = 2_000
"""The most chunked plans ranked plan by plan: each is priced by replaying its schedule, many times
slower than a plain plan's closed form (the figures: docs/benchmarks.md). Beyond it the chunked
plans are not ranked; they come in as the chunked variants of the seeded pipelines."""


def _runs_as(plan: Plan) -> tuple[Any, ...]:
    """What tells plans apart when they run: one stage or one micro-batch runs alike under every
    schedule, so such plans are measured once (as the space's first schedule that ranks best)."""
    alike = plan.chunks == 1 and (plan.num_stages == 1 or plan.micro_batches == 1)
    return (plan.stages, plan.micro_batches, None if alike else plan.schedule)


def planner_seeds(
    profile: dict[str, Any], space: PlanSpace, top: int, units: int | None = None, memory_limit: float | None = None
) -> list[SeedPlan]:
    """The cost model's best ``top`` plans of ``space``, best first, on :func:`local_cluster`;
    none predicted over ``memory_limit`` bytes per rank (``None``: the machine's memory shared).

    A space of up to :data:`EXHAUSTIVE` plans of one stage per rank group is ranked whole (each
    estimate takes microseconds), its chunked plans with them when there are at most
    :data:`CHUNKED_EXHAUSTIVE` (each is a replay of its schedule; beyond that they are left to the
    offers, :func:`chunked_offers`); a larger one is searched by
    :func:`~dapple_lightning.planner.plan_dapple`, which knows nothing of the space's stage limit,
    so it is asked for more plans and those outside are skipped.

    Raises:
        ValueError: When no plan of the space fits in memory (the planner's message says why), or
            the space holds only chunked plans, more than are ranked one by one.
    """
    from dapple_lightning.planner import plan_dapple

    model = _cost_model(profile, space, units, memory_limit)
    cluster = model.cluster
    chunked = sum(space.schedule_size(s) for s in space.schedules if s in CHUNKED_SCHEDULES)
    if space.size - chunked <= EXHAUSTIVE:
        rank_chunked = chunked <= CHUNKED_EXHAUSTIVE
        if not rank_chunked and chunked == space.size:
            raise ValueError(
                f"the space holds {chunked} chunked plans and no other, more than the {CHUNKED_EXHAUSTIVE} the cost "
                "model replays one by one; add dapple to the searched schedules: its pipelines are ranked, and "
                "their chunked variants offered"
            )
        estimates = [_estimate(model, p) for p in space.plans() if rank_chunked or p.chunks == 1]
        ranked = sorted((e for e in estimates if e.fits), key=lambda e: e.step_s)
        if not ranked:
            least = min(max(e.memory_bytes) for e in estimates)
            raise ValueError(
                f"no plan of the space fits in {cluster.memory_bytes / 1e9:.3g} GB per rank; the "
                f"smallest needs {least / 1e9:.3g} GB"
            )
        out, seen = [], set()
        for rank, e in enumerate(ranked):
            if (key := _runs_as(e.plan)) not in seen:
                seen.add(key)
                out.append(SeedPlan(e.plan, rank, e.step_s))
        return out[:top]
    planned = plan_dapple(
        model.profile,
        cluster,
        space.global_batch,
        top=max(5 * top, 20),
        micro_batches=list(space.micro_batches or ()),
        # The program searches chains of schedules with a closed form; zero bubble reuses DAPPLE's.
        schedule=next((s for s in space.schedules if s in SCHEDULES), "dapple"),
    )
    # A space of zero-bubble schedules alone gets DAPPLE's plans under its first one.
    zero_bubble = next((s for s in space.schedules if s in ZERO_BUBBLE), "zb-h1")
    out: list[SeedPlan] = []
    for rank, p in enumerate(planned):
        # The space places stage s on the next r_s ranks; on one node every placement is alike.
        schedule = p.plan.schedule if p.plan.schedule in space.schedules else zero_bubble
        plan = Plan(tuple(replace(s, ranks=None) for s in p.plan.stages), p.plan.micro_batches, schedule)
        if space.contains(plan) and plan not in (s.plan for s in out):
            step = p.predicted_step_s if schedule == p.plan.schedule else model.estimate(plan).step_s
            out.append(SeedPlan(plan, rank, step))
    return out[:top]


def _cost_model(profile: dict[str, Any], space: PlanSpace, units: int | None, memory_limit: float | None) -> Any:
    """The cost model of ``profile`` on :func:`local_cluster` at the space's global batch."""
    from dapple_lightning.planner import CostModel, ModelProfile

    model_profile = ModelProfile.from_dict(profile)  # a bad profile is named before a bad cluster
    return CostModel(model_profile, local_cluster(space.world_size, units, memory_limit), space.global_batch)


def _estimate(model: Any, plan: Plan) -> Any:
    """The cost model's estimate of ``plan``, chunked or not (both have ``step_s``, ``memory_bytes``, ``fits``)."""
    if plan.chunks == 1:
        return model.estimate(plan)
    from dapple_lightning.planner import estimate_chunked

    return estimate_chunked(model, plan)


def chunked_offers(
    profile: dict[str, Any],
    space: PlanSpace,
    seeds: list[SeedPlan],
    units: int | None = None,
    memory_limit: float | None = None,
) -> list[tuple[Plan, float, str]]:
    """For each pipeline among ``seeds`` under DAPPLE's schedule, its fastest variant with two stages
    per rank group that the cost model predicts faster within the memory budget
    (``planner.best_chunked_offers``, as ``plan="auto"`` offers them), with its predicted step and
    the sentence saying why; each plan once. A space that searches chunked schedules gets only
    variants it holds (its chunk count, schedules, micro-batch and group counts), which the search
    seeds; another gets them all, which the search reports (``enqueue_planner_seeds``). A seed under
    another schedule than DAPPLE's is offered as DAPPLE's pipeline of the same stages."""
    from dapple_lightning.planner import best_chunked_offers

    model = _cost_model(profile, space, units, memory_limit)
    pipelines = dict.fromkeys(Plan(s.plan.stages, s.plan.micro_batches) for s in seeds if s.plan.chunks == 1)
    searched = set(space.schedules) & set(CHUNKED_SCHEDULES)
    keep = space.contains if searched else None
    return best_chunked_offers(model, pipelines, looped_chunks=space.chunks, keep=keep)


def memory_refusal(profile: dict[str, Any], space: PlanSpace, memory_limit: float) -> Callable[[Plan], str | None]:
    """For each plan, why it is predicted over ``memory_limit`` bytes per rank, or ``None`` when it fits.

    The search runs this before a trial, so that a plan the sampler proposes over the budget ends
    as infeasible without being run (the planner's seeds are never over it)."""
    from dapple_lightning.planner import over_budget

    model = _cost_model(profile, space, None, memory_limit)

    def refusal(plan: Plan) -> str | None:
        return over_budget(plan, _estimate(model, plan).memory_bytes, memory_limit)

    return refusal


def enqueue_planner_seeds(
    study: optuna.Study,
    space: PlanSpace,
    profile: dict[str, Any] | None,
    top: int,
    units: int | None,
    say: Callable[[str], None],
    missing: str = "no profile",
    memory_limit: float | None = None,
) -> None:
    """Queue the planner's ``top`` picks (:func:`planner_seeds`) with their predictions as trial
    attributes, and record in the study what was seeded, or why nothing was (``missing``: why
    there is no ``profile``), so that a resumed study does not profile again."""
    if profile is None:
        reason = missing
    else:
        try:
            seeds = planner_seeds(profile, space, top, units, memory_limit)
        except ValueError as e:
            reason = f"planner found no plan ({e})"
        else:
            for s in seeds:
                attrs = {"source": "planner", "planner_rank": s.rank, "predicted_step_s": s.predicted_step_s}
                study.enqueue_trial(space.params(s.plan), user_attrs=attrs, skip_if_exists=True)
                say(f"planner pick #{s.rank}: {describe_plan(s.plan)} (predicted {s.predicted_step_s:.3g} s/step)")
            study.set_user_attr("planner_seeded", [describe_plan(s.plan) for s in seeds])
            offers = chunked_offers(profile, space, seeds, units, memory_limit)
            picked = [s.plan for s in seeds]
            for plan, step, why in offers:
                offered = f"planner offers {plan.describe()} (predicted {step:.3g} s/step)"
                if not space.contains(plan):
                    say(
                        f"{offered}, not seeded: the space searches no chunked schedule; add {plan.schedule} to the "
                        f"searched schedules{f' (and chunks: {plan.chunks})' if plan.chunks != 2 else ''} to "
                        f"measure it. Why: {why}"
                    )
                elif plan in picked:
                    say(f"{offered}: one of the planner's picks already. Why: {why}")
                else:
                    attrs = {"source": "planner", "planner_offer": why, "predicted_step_s": step}
                    study.enqueue_trial(space.params(plan), user_attrs=attrs, skip_if_exists=True)
                    say(f"{offered}, seeded. Why: {why}")
            study.set_user_attr("planner_chunked_offers", [plan.to_dict() for plan, _, _ in offers])
            return
    say(f"not seeding with the planner: {reason}")
    study.set_user_attr("planner_seeded", reason)


def baseline_plans(space: PlanSpace, names: tuple[str, ...] = BASELINES) -> list[tuple[str, Plan]]:
    """The named baselines that lie in ``space``: ``data_parallel`` (one stage on every rank, one
    micro-batch) and ``straight`` (one rank per stage, layers split evenly, ``2 x stages`` micro-batches)."""
    out = []
    for name in names:
        if name == "data_parallel":
            plan = Plan.data_parallel(space.num_layers, space.world_size)
        elif name == "straight":
            if space.world_size < 2 or space.world_size > space.num_layers:
                continue
            plan = Plan.straight(space.num_layers, space.world_size)
        else:
            raise ValueError(f"unknown baseline {name!r}; the baselines are {list(BASELINES)}")
        try:
            space.params(plan)
        except ValueError:
            continue  # not a plan of this space (e.g. its micro-batch count is excluded)
        out.append((name, plan))
    return out
