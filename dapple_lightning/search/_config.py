"""What a plan search measures and how it runs its study: :class:`SearchConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from dapple_lightning.plan import SCHEDULES, whole
from dapple_lightning.planner import parse_memory
from dapple_lightning.search._redact import redact
from dapple_lightning.search._space import DEFAULT_MAX_PLANS
from dapple_lightning.trials import TrialConfig

__all__ = ["DEFAULT_HEARTBEAT_S", "DEFAULT_STORAGE", "SearchConfig"]

DEFAULT_STORAGE = "sqlite:///dapple_search.db"
DEFAULT_HEARTBEAT_S = 10


@dataclass(frozen=True)
class SearchConfig:
    """A plan search: what to measure (``trial``) and how to run the study."""

    trial: TrialConfig
    """The model, ranks, batch, steps and limits of every trial."""
    storage: str = DEFAULT_STORAGE
    """Optuna storage URL (``sqlite:///file.db``, ``postgresql://...``, ...); whatever the search
    shows of it has the password masked (``postgresql://user:***@host/db``)."""
    study_name: str = "dapple"
    """Study in the storage; re-running with the same name resumes it."""
    heartbeat_s: int | None = DEFAULT_HEARTBEAT_S
    """Seconds between the heartbeats a running trial records in the storage. Several workers may
    share one study: a RUNNING trial silent for three intervals lost its worker (on any host), and
    the next worker to draw a trial ends it and queues its plan again. ``None``: no heartbeat (only
    a search restarted on the same host finds its predecessor's trials, by their process ids)."""
    n_trials: int | None = 20
    """Measured trials the study should hold (not: trials to add): complete, pruned or failed ones,
    not counting interrupted trials or repeated proposals of an already measured plan (those reuse
    the earlier result and cost nothing). ``None``: the whole grid with ``sampler="grid"``, 20
    otherwise."""
    timeout_s: float | None = None
    """Stop starting trials after this many seconds of this run (the running one finishes)."""
    sampler: Literal["tpe", "random", "grid"] = "tpe"
    """``tpe`` (seeded, multivariate), ``random``, or ``grid``: every plan of the space, in order."""
    seed: int = 0
    """Seed of the sampler."""
    multi_objective: bool = False
    """Maximize samples/s and minimize peak bytes per rank (a Pareto front) instead of samples/s only."""
    micro_batches: tuple[int, ...] | None = None
    """Micro-batch counts to search; ``None``: the divisors of the global batch."""
    schedules: tuple[str, ...] = SCHEDULES
    """Schedules to search."""
    max_stages: int | None = None
    """Most stages a plan may have (with chunks, ``groups x chunks``); ``None``: ``min(layers, world
    size)`` for plans of one stage per rank group, ``layers`` for chunked ones."""
    chunks: int = 2
    """Stages per rank group of the ``interleaved`` plans searched (``schedules`` must name it)."""
    planner_seeds: int = 3
    """Measure the planner's top this-many plans first (once per study; 0: do not ask the planner)."""
    memory_limit: float | str | None = None
    """Bytes per rank (or text such as ``"6GiB"``) no planner seed is predicted to exceed;
    ``None``: the machine's memory shared evenly by the ranks."""
    baselines: tuple[str, ...] = ("data_parallel", "straight")
    """Plans measured before anything else, once per study: data parallelism and a balanced straight
    pipeline (see ``search._seed.baseline_plans``); ``()`` measures none."""
    enqueue: tuple[Any, ...] = ()
    """Plans to measure first (anything ``Plan.coerce`` takes); ones already in the study are skipped."""
    pruner: Literal["median", "none"] = "median"
    """``median``: stop a trial whose throughput at a timed step is below the median of earlier trials
    at that step (single objective only; after 3 trials)."""
    confirm_repeats: int = 1
    """Runs of each contender in the confirmation round that ends the search: the fastest plan by
    median, data parallelism and the closest rivals (at most 3 plans) are measured this many more
    times, interleaved, and the choice takes the median of each plan's runs (``search._confirm``);
    0: no round, the choice rests on single measurements. A resumed study does not repeat a round
    it has measured."""
    tpe_startup_trials: int = 10
    """Trials TPE samples at random (enqueued ones count) before it models the results (Optuna's
    default; 5 did no better in ``benchmarks/search.py``'s replays)."""
    allow_mismatch: bool = False
    """Resume a study whose fingerprint differs from this setup's (measurements will not compare)."""
    max_grid: int = DEFAULT_MAX_PLANS
    """``sampler="grid"`` refuses spaces with more plans than this."""
    progress: bool = True
    """Print one line per finished trial."""

    def __post_init__(self) -> None:
        if not isinstance(self.trial, TrialConfig):
            raise TypeError(f"trial must be a TrialConfig, got {type(self.trial).__name__}")
        if self.sampler not in ("tpe", "random", "grid"):
            raise ValueError(f"unknown sampler {self.sampler!r}; choose tpe, random or grid")
        if self.pruner not in ("median", "none"):
            raise ValueError(f"unknown pruner {self.pruner!r}; choose median or none")
        if self.n_trials is not None:
            whole(self.n_trials, "n_trials")
        if self.heartbeat_s is not None:
            whole(self.heartbeat_s, "heartbeat_s")
        unknown = set(self.baselines) - {"data_parallel", "straight"}
        if unknown:
            raise ValueError(f"baselines: {sorted(unknown)} unknown; the baselines are data_parallel and straight")
        whole(self.confirm_repeats, "confirm_repeats", 0)
        whole(self.planner_seeds, "planner_seeds", 0)
        whole(self.chunks, "chunks")
        if self.memory_limit is not None:
            object.__setattr__(self, "memory_limit", parse_memory(self.memory_limit, "memory_limit"))
        if not isinstance(self.storage, str) or "://" not in self.storage:
            shown = redact(self.storage) if isinstance(self.storage, str) else self.storage
            raise ValueError(f"storage must be an Optuna storage URL like {DEFAULT_STORAGE!r}, got {shown!r}")
        if self.micro_batches is not None:
            object.__setattr__(self, "micro_batches", tuple(self.micro_batches))
        object.__setattr__(self, "schedules", tuple(self.schedules))
        object.__setattr__(self, "enqueue", tuple(self.enqueue))

    @property
    def objectives(self) -> list[str]:
        return ["samples_per_s", "peak_bytes"] if self.multi_objective else ["samples_per_s"]

    @property
    def directions(self) -> list[str]:
        return ["maximize", "minimize"] if self.multi_objective else ["maximize"]
