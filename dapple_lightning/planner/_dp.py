"""The DAPPLE planner: a dynamic program over plans, exact for the analytic cost model.

The search space, for a profile of ``L`` layers on a cluster of ``W`` devices:

- **stages**: any cut of the layers into contiguous stages (on profiles of more than 65
  layers, cuts at ``max_cuts`` points that split the forward + backward time evenly);
- **replication**: stage ``s`` gets ``r_s`` devices, ``sum r_s = W``: every stage but the first a
  count from :func:`replica_candidates` (any count up to 16 devices) and the first what is left,
  which keeps the search fast and still reaches plans like ``63:1``;
- **placement**: each policy of ``_placement`` (``append``, ``fresh``, ``scatter``; only
  ``append`` when servers have one device or there is one server, where they coincide);
- **micro-batches**: each ``M`` of :func:`micro_batch_candidates` (the divisors of the global
  batch, so every micro-batch has the same size) unless given; a stage may not have more
  replicas than a micro-batch has samples.

Plans whose stages exceed the device memory (``_cost``) are left out; under a memory objective
(``objective="memory"`` or ``"time-within-memory"``, see ``_objective``), so are those over the
peak it allows. With ``recompute=True`` a stage over that cap recomputes its activations when
that brings it under (and only then: ``_objective`` says why the search stays exact).

The search runs per (micro-batch count, placement policy): first with cuts at 16 points only
(cheap, and its plans bound the rest), then in full, best-looking pairs first, then, for
``top > 1``, once more keeping the runners-up (after a beam pass over the pairs whose best plan
is among the ``top``, whose runners-up bound that search; a pair the first search could not
settle is searched for its best alone first, and for its runners-up only if it has one within
the bound). Up to 16 devices (or with ``exact=True``) it is
exact; beyond, each state keeps only its 8 partial plans of lowest ``Z`` (a beam), which is
fast but may miss the optimum.

The search itself, and why it is exact, is in ``_search``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dapple_lightning.plan import SCHEDULES, Plan, Stage
from dapple_lightning.planner._cluster import GB, Cluster
from dapple_lightning.planner._cost import CostModel, Estimate
from dapple_lightning.planner._objective import check_objective, least_memory, peak_limit
from dapple_lightning.planner._placement import PLACEMENTS, place
from dapple_lightning.planner._profile import ModelProfile
from dapple_lightning.planner._search import _Search
from dapple_lightning.planner._simulator import simulated_step_s

__all__ = [
    "PlannedPlan",
    "SearchRecord",
    "best_over_micro_batches",
    "micro_batch_candidates",
    "plan_dapple",
    "replica_candidates",
]

# Relative tolerance when the planner checks its own numbers against CostModel.estimate.
_AGREE = 1e-9
# Profiles with more cut points than this get a first, coarse pass with this many.
_COARSE = 16
# Partial plans kept per state when the search is not exact.
_BEAM = 8
# Largest cluster whose stages may take any of 1..8 devices or any number of whole servers;
# beyond, only powers of two of devices or of servers (see replica_candidates).
_FINE_COUNTS = 64


@dataclass(frozen=True)
class PlannedPlan:
    """A plan with what the cost model predicts for it."""

    plan: Plan
    """The plan; stages carry explicit ``ranks`` when the placement is not consecutive ranks."""
    predicted_step_s: float
    """Predicted seconds per optimizer step."""
    stage_memory_bytes: tuple[float, ...]
    """Predicted peak bytes on one device of each stage."""
    speedup_vs_dp: float | None
    """Pure data parallelism's predicted step over this plan's, ``None`` if no such plan fits."""
    placement: str = "append"
    """Placement policy that produced the ranks."""
    method: str = "dapple"
    """What produced the plan: ``dapple``, ``pipedream``, ``straight`` or ``data-parallel``."""
    estimate: Estimate | None = field(default=None, repr=False, compare=False)
    """The full prediction (phases, per-stage times)."""
    simulated_step_s: float | None = None
    """The step as the discrete-event simulator replays it (at least the predicted pipeline
    latency, ``estimate.pipeline_s``; the replay does not model shared compute units)."""
    peak_limit_bytes: float | None = field(default=None, compare=False)
    """The per-device peak the planner's objective allowed (the device memory for ``"time"``,
    the least peak for ``"memory"``; see ``_objective``); ``None`` for plans not from the search."""
    search: SearchRecord | None = field(default=None, compare=False)
    """How the search that found the plan went: exact or not, a lower bound, its work; ``None``
    for plans not from the search."""

    @property
    def notation(self) -> str:
        return self.plan.notation

    @property
    def cuts(self) -> tuple[int, ...]:
        """Layer indices where stages begin, after the first (``()`` for one stage)."""
        return tuple(s.start for s in self.plan.stages[1:])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "plan": self.plan.to_dict(),
            "notation": self.notation,
            "placement": self.placement,
            "predicted_step_s": self.predicted_step_s,
            "speedup_vs_dp": self.speedup_vs_dp,
            "simulated_step_s": self.simulated_step_s,
            "stage_memory_bytes": list(self.stage_memory_bytes),
            "peak_limit_bytes": self.peak_limit_bytes,
        }
        if self.search is not None:
            out["search"] = dataclasses.asdict(self.search)
        if self.estimate is not None:
            est = self.estimate
            out.update(
                pivot=est.pivot_name,
                warmup_s=est.warmup_s,
                steady_s=est.steady_s,
                ending_s=est.ending_s,
                micro_batch_size=est.micro_batch_size,
                bubble_fraction=est.bubble_fraction,
                shared_compute_s=est.shared_compute_s,
            )
        return out

    @classmethod
    def predicted(
        cls, model: CostModel, est: Estimate, dp_step_s: float | None, placement: str = "append", method: str = "dapple"
    ) -> PlannedPlan:
        """``est``'s plan with ``model``'s prediction, the simulator's replay and the speedup over pure
        data parallelism's predicted step ``dp_step_s``."""
        speedup = None if dp_step_s is None or est.step_s <= 0 else dp_step_s / est.step_s
        simulated = simulated_step_s(model, est.plan, est)
        return cls(est.plan, est.step_s, est.memory_bytes, speedup, placement, method, est, simulated)


@dataclass(frozen=True)
class SearchRecord:
    """What one :func:`plan_dapple` search did, for its plans' readers and for tests of its work.

    The counts are deterministic (the same on any machine), so a change that multiplies the
    planner's work shows in them whatever the machine's speed.
    """

    exact: bool
    """Whether the search kept every partial plan that could still win (then its best plan is
    optimal over the search space), or a beam of them."""
    lower_bound_s: float
    """A step time no plan of the search space beats: the cluster's devices sharing the model's
    total compute evenly (every plan's busiest stage does at least that share); under a beam,
    at least the least over the space of a plan's largest stage all-reduce and passes
    (``_lower_bound``). Compare it with a beam's best plan for the most it can be off the optimum."""
    states: int
    """States (layer, free devices) whose stages the search priced."""
    stages_priced: int
    """Stages (layers on a placement, at a micro-batch count) whose costs it computed."""
    partial_plans: int
    """Partial plans it priced: a stage put in front of a partial plan (its unit of work)."""
    kept: int
    """Partial plans it kept when priced."""

    def gap(self, step_s: float) -> float:
        """How far ``step_s`` may be above the optimum, as a share of it: at most this (0 when exact)."""
        if self.exact:
            return 0.0
        return step_s / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else math.inf


def micro_batch_candidates(global_batch: int) -> tuple[int, ...]:
    """Default micro-batch counts: the divisors of the global batch (equal micro-batches)."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    return tuple(m for m in range(1, global_batch + 1) if global_batch % m == 0)


def replica_candidates(cluster: Cluster) -> tuple[int, ...]:
    """Replica counts the planner gives stages other than the first (which takes the rest).

    Every count up to 16 devices; up to 64, 1..8, multiples of ``max(8, devices per server)``
    and powers of two, so that stages can fill servers or halves of them; beyond, powers of two
    and powers of two times ``max(8, devices per server)``: on thousands of devices every
    multiple of a server would make the search grow with the cluster (the first stage still
    takes whatever is left, and the search record states the beam's gap to a lower bound).
    """
    world = cluster.world_size
    if world <= 16:
        return tuple(range(1, world + 1))
    powers = {2**k for k in range(world.bit_length()) if 2**k <= world}
    step = max(8, cluster.devices_per_node)
    if world > _FINE_COUNTS:
        # Thousands of devices: a stage's size doubles from one device, or from whole servers.
        servers = {step * 2**k for k in range(world.bit_length()) if step * 2**k <= world}
        return tuple(sorted(powers | servers))
    counts = set(range(1, 9)) | set(range(step, world + 1, step)) | powers
    return tuple(sorted(c for c in counts if c <= world))


def best_over_micro_batches(model: CostModel, plans: Iterable[Plan]) -> Estimate | None:
    """The fastest plan of ``plans`` that fits in memory and the batch, or ``None``."""
    best: Estimate | None = None
    for plan in plans:
        try:
            est = model.estimate(plan)
        except ValueError:
            continue  # e.g. more replicas than a micro-batch has samples
        if est.fits and (best is None or est.step_s < best.step_s):
            best = est
    return best


def _data_parallel_step(model: CostModel, candidates: Sequence[int]) -> float | None:
    world = model.cluster.world_size
    plans = (Plan.data_parallel(model.num_layers, world, m) for m in candidates)
    best = best_over_micro_batches(model, plans)
    return None if best is None else best.step_s


def _even_cuts(model: CostModel, count: int) -> list[int]:
    """At most ``count`` cut points that split the layers' forward+backward time evenly."""
    pf, pb, *_ = model.prefix_sums()
    total = pf[-1] + pb[-1]
    layers = model.num_layers
    if total <= 0:
        return list(range(1, layers, -(-(layers - 1) // count)))
    cuts: set[int] = set()
    i = 1
    for q in range(1, count + 1):
        goal = total * q / (count + 1)
        while i < layers - 1 and pf[i] + pb[i] < goal:
            i += 1
        cuts.add(i)
    return sorted(cuts)


def _build(spec: Sequence[tuple[int, int, int, bool]], ranks: Sequence[tuple[int, ...]], m: int, schedule: str) -> Plan:
    consecutive = list(range(sum(r for _, _, r, _ in spec)))
    flat = [rank for group in ranks for rank in group]
    explicit = flat != consecutive
    stages = tuple(Stage(a, b, r, tuple(rk) if explicit else None, again) for (a, b, r, again), rk in zip(spec, ranks))
    return Plan(stages=stages, micro_batches=m, schedule=schedule)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while entered (as it was after); a decorator too.

    A search allocates partial plans by the hundred thousand and keeps most to its end, so the
    collector's passes, set off by allocations, walk them again and again and find nothing:
    partial plans point only to shorter ones, so reference counting frees all of them.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collector_paused()
def plan_dapple(
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    top: int = 1,
    micro_batches: Sequence[int] | None = None,
    placements: Sequence[str] | None = None,
    schedule: str = "dapple",
    optimizer_factor: float = 2.0,
    replicas: Sequence[int] | None = None,
    max_cuts: int | None = 64,
    exact: bool | None = None,
    objective: str = "time",
    memory_margin: float = 0.1,
    recompute: bool = False,
) -> list[PlannedPlan]:
    """The ``top`` best plans under the cost model of ``_cost`` for ``objective``, fastest first.

    Args:
        profile: Per-layer costs of the model.
        cluster: Devices, links and memory.
        global_batch: Samples per optimizer step.
        top: How many distinct plans to return (under ``"memory"``, at most the plans that tie
            on the least peak).
        micro_batches: Micro-batch counts to consider; default :func:`micro_batch_candidates`.
        placements: Placement policies to consider; default all of ``PLACEMENTS`` that differ on
            this cluster.
        schedule: ``"dapple"`` or ``"gpipe"`` (same latency, different memory).
        optimizer_factor: Optimizer state bytes per parameter byte (Adam: 2).
        replicas: Replica counts for stages after the first; default :func:`replica_candidates`.
        max_cuts: With more layers than ``max_cuts + 1``, stages begin only at ``max_cuts``
            points that split the forward+backward time evenly (the search is exact over those
            plans); ``None`` allows every layer, slower on long profiles.
        exact: Keep every partial plan that may still win (exact for the cost model), or only
            the few of lowest ``Z`` per state (a beam of ``_BEAM``: fast, not guaranteed
            optimal). ``None``: exact up to 16 devices.
        objective: ``"time"``: the fastest plans that fit in device memory (DAPPLE's);
            ``"memory"``: the plans of least per-device peak memory, the fastest of them first
            (mCAP's); ``"time-within-memory"``: the fastest plans whose peak is at most
            ``1 + memory_margin`` times the least (see ``_objective``).
        memory_margin: Share above the least peak that ``"time-within-memory"`` allows.
        recompute: Let a stage recompute its activations (``Stage.recompute``) where it would
            not fit otherwise: it then keeps only its layers' inputs per micro-batch, and its
            backward runs its forward again. Stages that fit never recompute (it is only slower).

    Raises:
        ValueError: When no plan fits in device memory; the message gives the least memory
            any plan of the search space needs.
    """
    check_objective(objective, memory_margin)
    model = CostModel(profile, cluster, global_batch, optimizer_factor)
    candidates, placements, counts = _arguments(model, top, micro_batches, placements, schedule, replicas, max_cuts)
    cuts = None if max_cuts is None or profile.num_layers - 1 <= max_cuts else _even_cuts(model, max_cuts)
    limit = cluster.memory_bytes
    seeds: list[tuple[float, tuple[Any, ...], tuple[Any, ...]]] = []
    if objective != "time":
        least, frugal = least_memory(model, candidates, counts, schedule, cuts, recompute)
        if frugal is None or not least <= limit:
            raise ValueError(_no_fit_message(model, least, frugal))
        limit = peak_limit(least, limit, objective, memory_margin)
        seeds = _seeds(model, frugal, placements, limit)
    if exact is None:
        exact = cluster.world_size <= 16
    runs = [(m, policy) for m in candidates for policy in placements]
    # The dynamic program minimises the pipeline's latency; where devices share compute units the
    # cost model's step also has a bound from total work, so more plans are kept and re-ranked.
    wide = 4 * top + 16 if cluster.shares_compute else top
    beam = None if exact else _BEAM
    search = _search(model, runs, cuts, counts, schedule, wide, beam, limit, seeds, recompute)
    if not search.top.items:
        raise ValueError(_no_fit_message(model, *least_memory(model, candidates, counts, schedule, cuts, recompute)))
    planned = _planned(model, search, _data_parallel_step(model, candidates), schedule)
    record = _record(model, search, exact, candidates, counts, cuts)
    planned = [dataclasses.replace(p, peak_limit_bytes=limit, search=record) for p in planned]
    return sorted(planned, key=lambda p: p.predicted_step_s)[:top]


def _arguments(
    model: CostModel,
    top: int,
    micro_batches: Sequence[int] | None,
    placements: Sequence[str] | None,
    schedule: str,
    replicas: Sequence[int] | None,
    max_cuts: int | None,
) -> tuple[tuple[int, ...], Sequence[str], tuple[int, ...]]:
    """:func:`plan_dapple`'s arguments checked: its micro-batch counts, placement policies and
    replica counts, defaults filled in."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an integer >= 1, got {top!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {list(SCHEDULES)}")
    cluster = model.cluster
    candidates = _micro_batches(micro_batches, model.global_batch)
    if placements is None:
        same = cluster.nodes == 1 or cluster.devices_per_node == 1
        placements = ("append",) if same else PLACEMENTS
    for p in placements:
        if p not in PLACEMENTS:
            raise ValueError(f"unknown placement policy {p!r}; choose from {list(PLACEMENTS)}")
    counts = tuple(replicas) if replicas is not None else replica_candidates(cluster)
    if not counts or any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in counts):
        raise ValueError(f"replica counts must be integers >= 1, got {list(counts)}")
    if max_cuts is not None and (isinstance(max_cuts, bool) or not isinstance(max_cuts, int) or max_cuts < 1):
        raise ValueError(f"max_cuts must be an integer >= 1 or None (every layer), got {max_cuts!r}")
    return candidates, placements, counts


def _search(
    model: CostModel,
    runs: list[tuple[int, str]],
    cuts: Sequence[int] | None,
    counts: Sequence[int],
    schedule: str,
    top: int,
    beam: int | None,
    memory_cap: float,
    seeds: Sequence[tuple[float, tuple[Any, ...], tuple[Any, ...]]] = (),
    recompute: bool = False,
) -> _Search:
    """The search over every (micro-batch count, placement policy) of ``runs``, its ``top`` best
    plans in its ``top``; stages over ``memory_cap`` bytes per device are left out.

    Branch and bound needs a good bound early. A first pass lets stages begin only at a few cut
    points spread evenly over the work; its plans are plans of the full space, so the full pass
    may cut anything slower than them and stays exact (under a beam, that pass is greedy: it only
    ranks). A greedy pass over every cut point of the pair the first pass ranks best tightens
    that bound. The full pass visits the (micro-batches,
    placement) pairs best first, so that its bound is tight from the start. ``seeds`` are plans of
    the space under ``memory_cap`` offered before any pass: under a tight cap the coarse pass
    may find none, and without them the full pass would start unbounded.
    """
    runs = list(runs)
    search = _Search(model, 1, counts, schedule, beam, memory_cap, recompute)
    for z, key, payload in seeds:
        search.top.offer(z, key, payload)
    rank: dict[tuple[int, str], float] = {}
    if len(cuts if cuts is not None else range(1, model.num_layers)) > _COARSE:
        coarse = _even_cuts(model, _COARSE)
        if cuts is not None:
            # Stay inside the search space: the nearest allowed cut points.
            coarse = sorted({min(cuts, key=lambda a, c=c: (abs(a - c), a)) for c in coarse})
        # Under a beam the coarse pass only ranks the runs and sets a first bound: greedy will do.
        search.beam = None if beam is None else 1
        for m, policy in runs:
            rank[(m, policy)] = search.run(policy, m, coarse)
        runs.sort(key=lambda run: rank[run])
    if runs:
        # A greedy pass (one partial plan per state) over every cut point of the most promising
        # run: its plan is a real plan of the space, so its latency bounds the full passes from
        # the start (the coarse cut points alone often find plans well above the optimum).
        search.beam = 1
        m, policy = runs[0]
        search.run(policy, m, cuts)
    search.beam = beam
    done: dict[tuple[int, str], float] = {}
    for m, policy in runs:
        rank[(m, policy)] = min(rank.get((m, policy), math.inf), search.run(policy, m, cuts))
        done[(m, policy)] = search.end_bound
    if top == 1 or not search.top.items:
        return search
    return _runners_up(search, runs, rank, done, cuts, top, beam)


def _runners_up(
    search: _Search,
    runs: list[tuple[int, str]],
    rank: dict[tuple[int, str], float],
    done: dict[tuple[int, str], float],
    cuts: Sequence[int] | None,
    top: int,
    beam: int | None,
) -> _Search:
    """``search`` (``top`` 1) again for the ``top`` best, keeping the partial plans that fewer than
    ``top`` others beat. ``rank``: the latency of the best plan each run offered in either pass;
    ``done``: the bound when its full pass ended.

    Every plan the first search met is a real plan, so the ``top``-th of those bounds the second
    search from the start; and a run is skipped when the first search found all of its plans
    below that bound (its own bound never fell under it) and none was.
    """
    seen = search.top.seen
    runs.sort(key=lambda run: rank[run])
    # A beam pass over the runs whose best plan is among the `top` so far finds runners-up
    # cheaply. They are real plans, so their `top`-th latency bounds the exact passes from the
    # start; only that bound is passed on: offered there as plans, they would change which of
    # plans tied on latency the exact passes return.
    scout = _again(search, seen, top, top if beam is None else min(top, beam))
    for m, policy in runs:
        if rank[(m, policy)] <= scout.top.bound:
            scout.run(policy, m, cuts)
    search = _again(scout, seen, top, beam)
    if len(scout.top.items) >= top:
        search.top.limit(scout.top.bound)
    bound = search.top.bound
    probe: _Search | None = None
    for m, policy in runs:
        if rank[(m, policy)] > bound and done[(m, policy)] >= bound:
            continue
        if beam is None and rank[(m, policy)] > search.top.bound:
            # The first search proved only that this run has no plan below `done`. Whether it has
            # one within the bound, a search for its best alone decides, keeping fewer partial
            # plans (one that beats a suffix drops it); only if it has is the run searched for its
            # runners-up. (Under a beam the answer would depend on how many each front keeps.)
            if probe is None:
                probe = search.sibling(1, None)
            probe.bounded(search.top.bound)
            if probe.run(policy, m, cuts) == math.inf:
                continue
        search.run(policy, m, cuts)
    if probe is not None:
        search.counts_in(probe)
    return search


def _again(earlier: _Search, seen: dict[tuple[Any, ...], tuple[float, Any]], top: int, beam: int | None) -> _Search:
    """A search for the ``top`` best that continues ``earlier``'s work, ``seen``'s plans offered."""
    search = earlier.sibling(top, beam)
    search.before = earlier.work()
    for key, (z, payload) in seen.items():
        search.top.offer(z, key, payload)
    return search


def _record(
    model: CostModel,
    search: _Search,
    exact: bool,
    candidates: Sequence[int],
    counts: Sequence[int],
    cuts: Sequence[int] | None,
) -> SearchRecord:
    """The :class:`SearchRecord` of ``search`` (its counts summed over every search of ``top > 1``)."""
    forward_fixed, backward_fixed, forward_var, backward_var, _ = model.affine_prefix_sums()
    per_sample = (forward_var[-1] + backward_var[-1]) / model.profile.profile_batch_size
    # Every sample passes every layer once per step; each micro-batch pays the fixed costs once.
    work = model.global_batch * per_sample + min(candidates) * (forward_fixed[-1] + backward_fixed[-1])
    lower = work / model.cluster.world_size
    if not exact:
        # A beam's gap is only as good as its bound: each stage's all-reduce and passes too. Imported
        # here: the bound needs numpy, whose import starts BLAS threads that would spin beside an
        # exact search, which has no use for it.
        from dapple_lightning.planner._lower_bound import stage_bound

        lower = max(lower, stage_bound(model, candidates, counts, cuts))
    return SearchRecord(exact, lower, *search.work())


def _seeds(
    model: CostModel, plan: Plan, placements: Sequence[str], cap: float
) -> list[tuple[float, tuple[Any, ...], tuple[Any, ...]]]:
    """``plan`` (consecutive ranks) under each placement policy, as the search offers plans
    (latency, key, payload): real plans of the space whose latencies bound the search. As in
    the search, a stage of it recomputes only when it would not fit under ``cap`` otherwise."""
    plain = model.estimate(
        dataclasses.replace(plan, stages=[dataclasses.replace(s, recompute=False) for s in plan.stages])
    )
    spec = tuple((s.start, s.end, s.replicas, mem > cap) for s, mem in zip(plan.stages, plain.memory_bytes))
    m = plan.micro_batches
    out: list[tuple[float, tuple[Any, ...], tuple[Any, ...]]] = []
    for policy in placements:
        ranks = place(model.cluster, policy, [r for _, _, r, _ in spec])
        est = model.estimate(_build(spec, ranks, m, plan.schedule))
        out.append((est.pipeline_s, (m, spec, ranks), (policy, m, spec, ranks)))
    return out


def _planned(model: CostModel, search: _Search, dp_step: float | None, schedule: str) -> list[PlannedPlan]:
    """The plans ``search`` kept, fastest first, each checked against :meth:`CostModel.estimate`
    (they share the recurrence, so they agree to rounding) and replayed by the simulator."""
    out: list[PlannedPlan] = []
    for z, _, (policy, m, spec, ranks) in search.top.items:
        plan = _build(spec, ranks, m, schedule)
        est = model.estimate(plan)
        if not math.isclose(est.pipeline_s, z, rel_tol=_AGREE, abs_tol=1e-15):
            raise RuntimeError(f"planner and cost model disagree on {plan.to_dict()}: {z} vs {est.pipeline_s}")
        # Consecutive ranks are what "append" gives, whichever policy found the plan first.
        label = policy if plan.stages[0].ranks is not None else "append"
        out.append(PlannedPlan.predicted(model, est, dp_step, label))
    return out


def _micro_batches(micro_batches: Sequence[int] | None, global_batch: int) -> tuple[int, ...]:
    if micro_batches is None:
        return micro_batch_candidates(global_batch)
    values = tuple(micro_batches)
    if not values:
        raise ValueError("micro_batches is empty; give at least one count or None for the default")
    for m in values:
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= global_batch:
            raise ValueError(f"micro-batch count {m!r} must be an integer in 1..{global_batch} (the global batch)")
    return tuple(sorted(set(values)))


def _no_fit_message(model: CostModel, need: float, plan: Plan | None) -> str:
    """Why no plan fits, from the least memory any plan of the space needs and one such plan (:func:`least_memory`)."""
    cap = model.cluster.memory_bytes
    if plan is None:
        return (
            f"no plan fits: a global batch of {model.global_batch} cannot feed {model.cluster.world_size} "
            "devices with the micro-batch counts given; use a larger global batch or fewer micro-batches"
        )
    return (
        f"no plan fits in {cap / GB:.2f} GB per device: the least memory any plan needs is {need / GB:.2f} GB "
        f"per device (stages {plan.notation}, cuts {[s.start for s in plan.stages[1:]]}, "
        f"{plan.micro_batches} micro-batches); raise the device memory (--memory-gb), add devices, "
        "or use a smaller global batch or optimizer state"
    )
