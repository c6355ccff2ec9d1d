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

from dapple_lightning.plan import ALL_SCHEDULES, SCHEDULES, Plan, Stage, whole

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
    as the planner assumes). Counts no plan can use (``M * ceil(W / S_max) > B``) are dropped."""
    schedules: tuple[str, ...] = SCHEDULES
    """Schedules to consider (``"dapple"``, ``"gpipe"``, opt-in ``"zb-h1"``, ``"zb-h2"`` and ``"zb-tail"``)."""
    max_stages: int | None = None
    """Most stages a plan may have; ``None``: ``min(num_layers, world_size)``."""

    def __post_init__(self) -> None:
        whole(self.num_layers, "num_layers")
        whole(self.world_size, "world_size")
        whole(self.global_batch, "global_batch")
        if self.max_stages is not None:
            whole(self.max_stages, "max_stages")
        schedules = tuple(self.schedules) if not isinstance(self.schedules, str) else (self.schedules,)
        if not schedules:
            raise ValueError(f"schedules is empty; choose from {list(SCHEDULES)}")
        for s in schedules:
            if s not in ALL_SCHEDULES:
                raise ValueError(f"unknown schedule {s!r}; choose from {list(ALL_SCHEDULES)}")
        object.__setattr__(self, "schedules", tuple(dict.fromkeys(schedules)))
        if self.micro_batches is None:
            candidates = tuple(m for m in range(1, self.global_batch + 1) if self.global_batch % m == 0)
        else:
            if isinstance(self.micro_batches, str | bytes) or not isinstance(self.micro_batches, Sequence):
                raise TypeError(f"micro_batches must be a list of integers or None, got {self.micro_batches!r}")
            candidates = tuple(sorted({whole(m, "micro-batch count") for m in self.micro_batches}))
            if not candidates:
                raise ValueError("micro_batches is empty; give at least one count, or None for the divisors of B")
        feasible = tuple(m for m in candidates if m <= self.global_batch and self._min_stages(m) <= self.stage_limit)
        if not feasible:
            raise ValueError(
                f"no micro-batch count of {list(candidates)} fits: with a global batch of {self.global_batch}, "
                f"{self.world_size} ranks and at most {self.stage_limit} stages, every micro-batch needs at least "
                f"{math.ceil(self.world_size / self.stage_limit)} rows; use fewer micro-batches or a larger batch"
            )
        object.__setattr__(self, "micro_batches", feasible)

    # ---------------------------------------------------------------------------- queries

    @property
    def stage_limit(self) -> int:
        """The most stages a plan of this space has."""
        limit = min(self.num_layers, self.world_size)
        return limit if self.max_stages is None else min(limit, self.max_stages)

    def replica_cap(self, micro_batches: int) -> int:
        """The most replicas a stage may have with ``micro_batches`` micro-batches (``B // M``)."""
        return self.global_batch // micro_batches

    def _min_stages(self, micro_batches: int) -> int:
        # Only called for M <= B, so the cap is at least 1.
        return math.ceil(self.world_size / self.replica_cap(micro_batches))

    def stage_range(self, micro_batches: int) -> tuple[int, int]:
        """Smallest and largest stage count a plan with ``micro_batches`` micro-batches can have."""
        return self._min_stages(micro_batches), self.stage_limit

    @property
    def size(self) -> int:
        """Number of distinct plans in the space (closed form, no enumeration)."""
        total = 0
        for m in self.micro_batches:  # type: ignore[union-attr]
            low, high = self.stage_range(m)
            for s in range(low, high + 1):
                cuts = math.comb(self.num_layers - 1, s - 1)
                total += cuts * _bounded_compositions(self.world_size, s, self.replica_cap(m))
        return total * len(self.schedules)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "world_size": self.world_size,
            "global_batch": self.global_batch,
            "micro_batches": list(self.micro_batches or ()),
            "schedules": list(self.schedules),
            "max_stages": self.max_stages,
        }

    # ---------------------------------------------------------------------------- sampling

    def suggest(self, trial: optuna.Trial) -> Plan:
        """Sample one valid plan with ``trial`` (define-by-run; see the module docstring for the names)."""
        schedule = trial.suggest_categorical("schedule", list(self.schedules))
        m = trial.suggest_categorical("micro_batches", list(self.micro_batches))  # type: ignore[arg-type]
        low, high = self.stage_range(m)
        s = trial.suggest_int("stages", low, high)
        cap = self.replica_cap(m)
        replicas: list[int] = []
        rest = self.world_size
        for i in range(s - 1):
            later = s - 1 - i
            r = trial.suggest_int(f"s{s}_r{i}", max(1, rest - later * cap), min(cap, rest - later))
            replicas.append(r)
            rest -= r
        replicas.append(rest)
        cuts = [0]
        for i in range(1, s):
            cuts.append(trial.suggest_int(f"s{s}_c{i}", cuts[-1] + 1, self.num_layers - (s - i)))
        cuts.append(self.num_layers)
        return _plan(cuts, replicas, m, schedule)

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
        if plan.micro_batches not in self.micro_batches:  # type: ignore[operator]
            raise ValueError(
                f"the plan's micro-batch count {plan.micro_batches} is not searched "
                f"(micro_batches: {list(self.micro_batches or ())})"
            )
        if plan.num_stages > self.stage_limit:
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
        """Every plan of the space, in a fixed order (schedule, M, stage count, replicas, cuts)."""
        for schedule in self.schedules:
            for m in self.micro_batches:  # type: ignore[union-attr]
                low, high = self.stage_range(m)
                cap = self.replica_cap(m)
                for s in range(low, high + 1):
                    for replicas in _compositions(self.world_size, s, cap):
                        for inner in itertools.combinations(range(1, self.num_layers), s - 1):
                            yield _plan([0, *inner, self.num_layers], list(replicas), m, schedule)

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


def _plan(cuts: Sequence[int], replicas: Sequence[int], micro_batches: int, schedule: str) -> Plan:
    stages = tuple(Stage(a, b, r) for (a, b), r in zip(itertools.pairwise(cuts), replicas))
    return Plan(stages=stages, micro_batches=micro_batches, schedule=schedule)


def params_from_plan(plan: Plan | Mapping[str, Any] | str) -> dict[str, Any]:
    """Optuna parameters of ``plan`` in the encoding of :class:`PlanSpace`, for ``study.enqueue_trial``.

    Explicit stage ``ranks`` are dropped (the space places stage ``s`` on the next ``r_s`` ranks).
    """
    plan = Plan.coerce(plan)
    s = plan.num_stages
    params: dict[str, Any] = {"schedule": plan.schedule, "micro_batches": plan.micro_batches, "stages": s}
    for i, stage in enumerate(plan.stages[:-1]):
        params[f"s{s}_r{i}"] = stage.replicas
    for i, stage in enumerate(plan.stages[1:], start=1):
        params[f"s{s}_c{i}"] = stage.start
    return params


def plan_from_params(params: Mapping[str, Any], *, num_layers: int, world_size: int) -> Plan:
    """The plan that parameters in the encoding of :class:`PlanSpace` describe.

    ``num_layers`` and ``world_size`` close the last stage (its end and its replicas are not
    parameters: they are what is left).
    """
    try:
        s = int(params["stages"])
        m = int(params["micro_batches"])
        schedule = str(params.get("schedule", "dapple"))
        replicas = [int(params[f"s{s}_r{i}"]) for i in range(s - 1)]
        cuts = [0, *(int(params[f"s{s}_c{i}"]) for i in range(1, s)), num_layers]
    except KeyError as e:
        raise ValueError(
            f"plan parameters lack {e.args[0]!r}; expected stages, micro_batches, schedule and s<S>_r<i>, "
            f"s<S>_c<i> as written by params_from_plan; got {sorted(params)}"
        ) from e
    last = world_size - sum(replicas)
    if last < 1:
        raise ValueError(f"replicas {replicas} leave {last} of {world_size} ranks for the last stage")
    return _plan(cuts, [*replicas, last], m, schedule)


def describe_plan(plan: Plan | Mapping[str, Any]) -> str:
    """One short line: replicas, cut points, micro-batches, schedule (``"2:2 cuts=5 M=4 dapple"``)."""
    return Plan.coerce(plan).describe()
