"""The plan search space: every valid DAPPLE plan of a model, sampled with Optuna's define-by-run API.

A plan of ``L`` layers on ``W`` ranks with a global batch of ``B`` samples is valid when

- it has ``S`` stages, ``1 <= S <= min(L, W, max_stages)``, each holding at least one layer;
- the stage replicas add up to ``W``, each at least 1;
- every slice of every micro-batch is non-empty: ``M * max(replicas) <= B``
  (a micro-batch has at least ``B // M`` rows, split across at most ``max(replicas)`` replicas).

The space only ever produces valid plans: every range below is computed from the choices made
before it, so nothing invalid is sampled and then penalised. The parameters, in sampling order:

==================  =====================================  =========================================
name                distribution                           why this range
==================  =====================================  =========================================
``schedule``        categorical over ``schedules``         fixed
``micro_batches``   categorical over the feasible ``M``    fixed: ``M`` is kept when some stage count
                                                           can spread ``W`` ranks over stages of at
                                                           most ``B // M`` replicas
``stages``          int ``[ceil(W / (B // M)), S_max]``    fewer stages would need a stage with more
                                                           than ``B // M`` replicas
``s{S}_r{i}``       int, ``i = 0 .. S-2``, from            leaves every later stage at least 1 and at
                    ``max(1, rest - k * cap)`` to          most ``cap = B // M`` replicas
                    ``min(cap, rest - k)``                 (``rest``: ranks left, ``k``: later stages);
                                                           the last stage takes what is left
``s{S}_c{i}``       int, ``i = 1 .. S-1``, from            strictly increasing cut points that leave
                    ``c_{i-1} + 1`` to ``L - (S - i)``     every later stage at least one layer
==================  =====================================  =========================================

A chunked schedule (``interleaved``, ``zb-v``, ``v-half``; opt-in) gives each of ``G`` rank groups
``C`` stages (``C = chunks`` looped, 2 in the V layout), so its plans have their own micro-batch and
group parameters; the replicas (per rank group) and the cut points (of ``S = G x C`` stages) keep the
names above:

===========================  ==============================  ==========================================
name                         distribution                    why this range
===========================  ==============================  ==========================================
``chunks``                   int ``[C, C]``                  fixed by the space; recorded so that the
                                                             parameters alone name the plan
``{schedule}_micro_batches`` categorical over the ``M``      fixed: ``M`` is kept when some group count
                             the schedule can run            below fits it
``{schedule}_m{M}_groups``   categorical over ``G``          fixed: ``2 <= G``, ``G x C <= L`` (and
                                                             ``max_stages``), at most ``B // M``
                                                             replicas a group, and the schedule's rule:
                                                             ``M`` a multiple of ``G`` (interleaved),
                                                             ``M >= 2G`` (V)
===========================  ==============================  ==========================================

One rank group holding every stage would be data parallelism with extra hand-overs, so ``G >= 2``.

**The trade-off of conditional ranges.** The replica and cut parameters carry the stage count in
their names (``s3_c1`` exists only in trials with 3 stages), so a parameter name always means the
same thing, but their *ranges* depend on earlier choices. Optuna accepts this (a parameter's
distribution may change range between trials as long as its type does not), and TPE models each
such parameter from the past values it has seen, truncated to the current range. What is lost is
the joint model: multivariate TPE groups only parameters whose distributions are identical, so it
treats dynamic-range parameters independently. The alternative, one categorical "composition
index" per stage count, keeps every distribution fixed but throws away the order of cut points
(cutting at layer 5 or 6 is as different to TPE as cutting at 1 or 9) and becomes unwieldy for deep
models (``C(L - 1, S - 1)`` choices). Neighbouring cut points usually give neighbouring
throughputs, so we keep the order and accept independent modelling of the cuts; the benchmark in
``docs/benchmarks.md`` measures what that costs.

Placement (explicit ``ranks``) is not part of the space: stage ``s`` takes the next ``r_s`` ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from dapple_lightning.plan import (
    ALL_SCHEDULES,
    CHUNKED_SCHEDULES,
    LAYOUTS,
    SCHEDULES,
    Plan,
    whole,
)

if TYPE_CHECKING:
    import optuna

__all__ = ["DEFAULT_MAX_PLANS", "PlanSpace", "describe_plan", "params_from_plan", "plan_from_params"]

DEFAULT_MAX_PLANS = 10_000
"""Default cap of :meth:`PlanSpace.grid`: above it, measuring every plan is not an option anyway
(a short run takes seconds, so 10,000 plans take most of a day or more; what runs take here is in
docs/benchmarks.md), so the grid is refused rather than silently cut short."""


@lru_cache(maxsize=4096)
def _bounded_compositions(total: int, parts: int, cap: int) -> int:
    """Ways to write ``total`` as an ordered sum of ``parts`` integers in ``[1, cap]``."""
    if parts == 0:
        return 1 if total == 0 else 0
    low, high = max(1, total - cap * (parts - 1)), min(cap, total - (parts - 1))
    return sum(_bounded_compositions(total - r, parts - 1, cap) for r in range(low, high + 1))


@dataclass(frozen=True)
class PlanSpace:
    """Every valid plan of a model with ``num_layers`` layers on ``world_size`` ranks.

    Example::

        space = PlanSpace(num_layers=10, world_size=4, global_batch=64)
        plan = space.suggest(trial)            # inside an Optuna objective
        study.enqueue_trial(space.params(p))   # try a known plan first
    """

    num_layers: int
    """Layers of the model's pipelined ``nn.Sequential`` (``L``)."""
    world_size: int
    """Ranks the plan runs on (``W``), the sum of the stage replicas."""
    global_batch: int
    """Samples per optimizer step (``B``)."""
    micro_batches: tuple[int, ...] | None = None
    """Micro-batch counts to consider; ``None``: the divisors of ``global_batch`` (equal micro-batches,
    as the planner assumes). Counts no plan of any searched schedule can use are dropped."""
    schedules: tuple[str, ...] = SCHEDULES
    """Schedules to consider (``"dapple"``, ``"gpipe"``; opt-in the zero-bubble ``"zb-h1"``,
    ``"zb-h2"``, ``"zb-tail"`` and the chunked ``"interleaved"``, ``"zb-v"``, ``"v-half"``)."""
    max_stages: int | None = None
    """Most stages a plan may have (with chunks, ``groups x chunks``); ``None``: no limit beyond
    ``num_layers`` (and ``world_size`` rank groups)."""
    chunks: int = 2
    """Stages per rank group of the ``interleaved`` plans (looped layout); the V layout's hold 2."""

    def __post_init__(self) -> None:
        whole(self.num_layers, "num_layers")
        whole(self.world_size, "world_size")
        whole(self.global_batch, "global_batch")
        if self.max_stages is not None:
            whole(self.max_stages, "max_stages")
        whole(self.chunks, "chunks")
        schedules = tuple(self.schedules) if not isinstance(self.schedules, str) else (self.schedules,)
        if not schedules:
            raise ValueError(f"schedules is empty; choose from {list(SCHEDULES)}")
        for s in schedules:
            if s not in (*ALL_SCHEDULES, *CHUNKED_SCHEDULES):
                raise ValueError(f"unknown schedule {s!r}; choose from {[*ALL_SCHEDULES, *CHUNKED_SCHEDULES]}")
        object.__setattr__(self, "schedules", tuple(dict.fromkeys(schedules)))
        if "interleaved" in self.schedules and self.chunks < 2:
            raise ValueError(f"interleaved plans give each rank group chunks >= 2 stages; got chunks: {self.chunks}")
        if self.micro_batches is None:
            candidates = tuple(m for m in range(1, self.global_batch + 1) if self.global_batch % m == 0)
        else:
            if isinstance(self.micro_batches, str | bytes) or not isinstance(self.micro_batches, Sequence):
                raise TypeError(f"micro_batches must be a list of integers or None, got {self.micro_batches!r}")
            candidates = tuple(sorted({whole(m, "micro-batch count") for m in self.micro_batches}))
            if not candidates:
                raise ValueError("micro_batches is empty; give at least one count, or None for the divisors of B")
        candidates = tuple(m for m in candidates if m <= self.global_batch)
        for schedule in self.schedules:
            if not any(self._fits(schedule, m) for m in candidates):
                raise ValueError(self._no_count_fits(schedule, candidates))
        object.__setattr__(
            self, "micro_batches", tuple(m for m in candidates if any(self._fits(s, m) for s in self.schedules))
        )

    def _no_count_fits(self, schedule: str, candidates: tuple[int, ...]) -> str:
        if schedule not in CHUNKED_SCHEDULES:
            return (
                f"no micro-batch count of {list(candidates)} fits: with a global batch of {self.global_batch}, "
                f"{self.world_size} ranks and at most {self.stage_limit} stages, every micro-batch needs at least "
                f"{math.ceil(self.world_size / self.stage_limit)} rows; use fewer micro-batches or a larger batch"
            )
        rule = "a multiple of the group count G" if schedule == "interleaved" else "at least 2G"
        return (
            f"schedule {schedule!r} fits no micro-batch count of {list(candidates)}: its plans need at least 2 rank "
            f"groups of {self.chunks_of(schedule)} stages each (at most {self.group_limit(schedule)} groups here: "
            f"{self.num_layers} layers, {self.world_size} ranks, max_stages {self.max_stages}), a micro-batch count "
            f"{rule}, and at most {self.global_batch} // M replicas a group; search other micro-batch counts or "
            f"drop {schedule!r}"
        )

    # ---------------------------------------------------------------------------- queries

    @property
    def stage_limit(self) -> int:
        """The most stages a plan of one stage per rank group has."""
        limit = min(self.num_layers, self.world_size)
        return limit if self.max_stages is None else min(limit, self.max_stages)

    def chunks_of(self, schedule: str) -> int:
        """Stages per rank group of ``schedule``'s plans: 1, ``chunks`` (interleaved) or 2 (V layout)."""
        if schedule not in CHUNKED_SCHEDULES:
            return 1
        return 2 if schedule in LAYOUTS["v"] else self.chunks

    def group_limit(self, schedule: str) -> int:
        """The most rank groups a plan of chunked ``schedule`` has."""
        chunks = self.chunks_of(schedule)
        stages = self.num_layers if self.max_stages is None else min(self.num_layers, self.max_stages)
        return min(self.world_size, stages // chunks)

    def replica_cap(self, micro_batches: int) -> int:
        """The most replicas a stage may have with ``micro_batches`` micro-batches (``B // M``)."""
        return self.global_batch // micro_batches

    def _min_stages(self, micro_batches: int) -> int:
        # Only called for M <= B, so the cap is at least 1.
        return math.ceil(self.world_size / self.replica_cap(micro_batches))

    def stage_range(self, micro_batches: int) -> tuple[int, int]:
        """Smallest and largest stage count a plan with ``micro_batches`` micro-batches can have."""
        return self._min_stages(micro_batches), self.stage_limit

    def groups(self, schedule: str, micro_batches: int) -> tuple[int, ...]:
        """The rank-group counts of chunked ``schedule``'s plans with ``micro_batches`` (module docstring)."""
        low = max(2, self._min_stages(micro_batches))
        return tuple(
            g
            for g in range(low, self.group_limit(schedule) + 1)
            if (micro_batches % g == 0 if schedule == "interleaved" else micro_batches >= 2 * g)
        )

    def _fits(self, schedule: str, micro_batches: int) -> bool:
        if schedule in CHUNKED_SCHEDULES:
            return bool(self.groups(schedule, micro_batches))
        return self._min_stages(micro_batches) <= self.stage_limit

    def schedule_micro_batches(self, schedule: str) -> tuple[int, ...]:
        """The searched micro-batch counts ``schedule``'s plans can run."""
        return tuple(m for m in self.micro_batches or () if self._fits(schedule, m))

    def categorical_choices(self) -> dict[str, list[int]]:
        """The choices of the chunked schedules' categorical parameters, by name: a study must keep
        them (Optuna refuses a categorical whose choices change), whatever made them change."""
        out: dict[str, list[int]] = {}
        for schedule in (s for s in self.schedules if s in CHUNKED_SCHEDULES):
            out[f"{schedule}_micro_batches"] = list(self.schedule_micro_batches(schedule))
            for m in self.schedule_micro_batches(schedule):
                out[f"{schedule}_m{m}_groups"] = list(self.groups(schedule, m))
        return out

    def _shapes(self, schedule: str) -> Iterator[tuple[int, int, int, int]]:
        """``(M, groups, chunks, replica cap)`` of every plan shape of ``schedule`` in the space."""
        chunks = self.chunks_of(schedule)
        for m in self.schedule_micro_batches(schedule):
            counts = self.groups(schedule, m) if chunks > 1 else range(self._min_stages(m), self.stage_limit + 1)
            for groups in counts:
                yield m, groups, chunks, self.replica_cap(m)

    @property
    def size(self) -> int:
        """Number of distinct plans in the space (closed form, no enumeration)."""
        return sum(self.schedule_size(schedule) for schedule in self.schedules)

    def schedule_size(self, schedule: str) -> int:
        """Number of the space's plans under ``schedule`` (closed form)."""
        return sum(
            math.comb(self.num_layers - 1, g * c - 1) * _bounded_compositions(self.world_size, g, cap)
            for _, g, c, cap in self._shapes(schedule)
        )

    def to_dict(self) -> dict[str, Any]:
        chunked = {"chunks": self.chunks} if set(self.schedules) & set(CHUNKED_SCHEDULES) else {}
        return {
            "num_layers": self.num_layers,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "micro_batches": list(self.micro_batches or ()),
            "schedules": list(self.schedules),
            "max_stages": self.max_stages,
            **chunked,
        }

    # ---------------------------------------------------------------------------- sampling

    def suggest(self, trial: optuna.Trial) -> Plan:
        """Sample one valid plan with ``trial`` (define-by-run; see the module docstring for the names)."""
        schedule = trial.suggest_categorical("schedule", list(self.schedules))
        chunks = self.chunks_of(schedule)
        if chunks == 1:
            m = trial.suggest_categorical("micro_batches", list(self.micro_batches))  # type: ignore[arg-type]
            groups = trial.suggest_int("stages", *self.stage_range(m))
        else:
            trial.suggest_int("chunks", chunks, chunks)
            m = trial.suggest_categorical(f"{schedule}_micro_batches", list(self.schedule_micro_batches(schedule)))
            groups = trial.suggest_categorical(f"{schedule}_m{m}_groups", list(self.groups(schedule, m)))
        cap = self.replica_cap(m)
        replicas: list[int] = []
        rest = self.world_size
        for i in range(groups - 1):
            later = groups - 1 - i
            r = trial.suggest_int(f"s{groups}_r{i}", max(1, rest - later * cap), min(cap, rest - later))
            replicas.append(r)
            rest -= r
        replicas.append(rest)
        s = groups * chunks
        cuts = [0]
        for i in range(1, s):
            cuts.append(trial.suggest_int(f"s{s}_c{i}", cuts[-1] + 1, self.num_layers - (s - i)))
        cuts.append(self.num_layers)
        return Plan.from_cuts(cuts, replicas, m, schedule, chunks=chunks)

    def params(self, plan: Plan | Mapping[str, Any] | str) -> dict[str, Any]:
        """The parameters under which :meth:`suggest` returns ``plan``, for ``study.enqueue_trial``.

        Raises:
            ValueError: When the plan is not in this space; the message says why.
        """
        plan = Plan.coerce(plan)
        self.check(plan)
        return params_from_plan(plan)

    def check(self, plan: Plan) -> None:
        """Raise ``ValueError`` naming the reason unless ``plan`` belongs to this space."""
        if plan.num_layers != self.num_layers or plan.world_size != self.world_size:
            raise ValueError(
                f"the plan covers {plan.num_layers} layers on {plan.world_size} ranks, but the space is "
                f"{self.num_layers} layers on {self.world_size} ranks"
            )
        if plan.schedule not in self.schedules:
            raise ValueError(
                f"the plan's schedule {plan.schedule!r} is not searched (schedules: {list(self.schedules)})"
            )
        if plan.chunks != self.chunks_of(plan.schedule):
            raise ValueError(
                f"the plan gives each rank group {plan.chunks} stages; the space searches {plan.schedule!r} with "
                f"{self.chunks_of(plan.schedule)} (chunks: {self.chunks})"
            )
        if plan.micro_batches not in self.schedule_micro_batches(plan.schedule):
            raise ValueError(
                f"the plan's micro-batch count {plan.micro_batches} is not searched under {plan.schedule!r} "
                f"(micro_batches: {list(self.schedule_micro_batches(plan.schedule))})"
            )
        if plan.chunks > 1 and plan.num_groups not in self.groups(plan.schedule, plan.micro_batches):
            raise ValueError(
                f"the plan has {plan.num_groups} rank groups; with {plan.micro_batches} micro-batches the space "
                f"searches {list(self.groups(plan.schedule, plan.micro_batches))} under {plan.schedule!r}"
            )
        if plan.chunks == 1 and plan.num_stages > self.stage_limit:
            raise ValueError(f"the plan has {plan.num_stages} stages; the space allows at most {self.stage_limit}")
        widest = max(s.replicas for s in plan.stages)
        if plan.micro_batches * widest > self.global_batch:
            raise ValueError(
                f"{plan.micro_batches} micro-batches x {widest} replicas > global batch {self.global_batch}: "
                "some replica would get an empty slice"
            )

    def contains(self, plan: Plan) -> bool:
        try:
            self.check(plan)
        except ValueError:
            return False
        return True

    def plans(self) -> Iterator[Plan]:
        """Every plan of the space, in a fixed order (schedule, M, group count, replicas, cuts)."""
        for schedule in self.schedules:
            for m, groups, chunks, cap in self._shapes(schedule):
                for replicas in _compositions(self.world_size, groups, cap):
                    for inner in itertools.combinations(range(1, self.num_layers), groups * chunks - 1):
                        yield Plan.from_cuts([0, *inner, self.num_layers], replicas, m, schedule, chunks=chunks)

    def grid(self, most: int = DEFAULT_MAX_PLANS) -> list[Plan]:
        """Every plan of the space (:meth:`plans`), refused when there are more than ``most``: a grid
        cut short would not be exhaustive."""
        if self.size > most:
            raise ValueError(
                f"the grid holds {self.size} plans, more than {most}; restrict micro_batches "
                f"(now {list(self.micro_batches or ())}), schedules (now {list(self.schedules)}) or max_stages "
                f"(now {self.stage_limit}), or use the tpe sampler"
            )
        return list(self.plans())


def _compositions(total: int, parts: int, cap: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        if 1 <= total <= cap:
            yield (total,)
        return
    for r in range(max(1, total - cap * (parts - 1)), min(cap, total - (parts - 1)) + 1):
        for rest in _compositions(total - r, parts - 1, cap):
            yield (r, *rest)


def params_from_plan(plan: Plan | Mapping[str, Any] | str) -> dict[str, Any]:
    """Optuna parameters of ``plan`` in the encoding of :class:`PlanSpace`, for ``study.enqueue_trial``.

    Explicit stage ``ranks`` are dropped (the space places stage ``s`` on the next ``r_s`` ranks).
    """
    plan = Plan.coerce(plan)
    g, s, m = plan.num_groups, plan.num_stages, plan.micro_batches
    params: dict[str, Any] = {"schedule": plan.schedule}
    if plan.chunks == 1:
        params.update({"micro_batches": m, "stages": s})
    else:
        params.update({"chunks": plan.chunks, f"{plan.schedule}_micro_batches": m, f"{plan.schedule}_m{m}_groups": g})
    for i, stage in enumerate(plan.stages[: g - 1]):
        params[f"s{g}_r{i}"] = stage.replicas
    for i, stage in enumerate(plan.stages[1:], start=1):
        params[f"s{s}_c{i}"] = stage.start
    return params


def plan_from_params(params: Mapping[str, Any], *, num_layers: int, world_size: int) -> Plan:
    """The plan that parameters in the encoding of :class:`PlanSpace` describe.

    ``num_layers`` and ``world_size`` close the last stage (its end and its replicas are not
    parameters: they are what is left).
    """
    schedule = str(params.get("schedule", "dapple"))
    try:
        if schedule in CHUNKED_SCHEDULES:
            chunks = int(params["chunks"])
            m = int(params[f"{schedule}_micro_batches"])
            g = int(params[f"{schedule}_m{m}_groups"])
        else:
            chunks, m, g = 1, int(params["micro_batches"]), int(params["stages"])
        s = g * chunks
        replicas = [int(params[f"s{g}_r{i}"]) for i in range(g - 1)]
        cuts = [0, *(int(params[f"s{s}_c{i}"]) for i in range(1, s)), num_layers]
    except KeyError as e:
        raise ValueError(
            f"plan parameters lack {e.args[0]!r}; expected the names params_from_plan writes (schedule, "
            f"micro_batches, stages, s<S>_r<i>, s<S>_c<i>; chunks, <schedule>_micro_batches and "
            f"<schedule>_m<M>_groups for chunked schedules); got {sorted(params)}"
        ) from e
    last = world_size - sum(replicas)
    if last < 1:
        raise ValueError(f"replicas {replicas} leave {last} of {world_size} ranks for the last stage")
    return Plan.from_cuts(cuts, [*replicas, last], m, schedule, chunks=chunks)


def describe_plan(plan: Plan | Mapping[str, Any]) -> str:
    """One short line: replicas, cut points, micro-batches, schedule (``"2:2 cuts=5 M=4 dapple"``)."""
    return Plan.coerce(plan).describe()
