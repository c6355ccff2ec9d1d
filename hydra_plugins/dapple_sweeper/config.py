"""``hydra/sweeper=dapple``: the sweeper's config, registered in Hydra's ConfigStore.

Defaults fit the examples' configs (``model.num_layers``, ``trainer.devices``, ``data.batch_size``,
``trainer.accelerator``); another app sets ``hydra.sweeper.space.*`` to its own keys or values::

    python examples/gpt.py -m hydra/sweeper=dapple hydra.sweeper.n_trials=30 \\
        hydra.sweeper.storage=sqlite:///gpt_sweep.db hydra.sweeper.study_name=gpt
"""

# No `from __future__ import annotations`: Hydra's plugin scanner runs this module before it is in
# sys.modules, where dataclasses would look up string annotations; OmegaConf also needs real types.
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II


@dataclass
class PlanSpaceConf:
    """The plans to search (see ``dapple_lightning.search.PlanSpace``)."""

    num_layers: int = II("model.num_layers")
    """Layers of the model's pipelined Sequential."""
    world_size: int = II("trainer.devices")
    """Ranks every plan runs on."""
    global_batch: int = II("data.batch_size")
    """Samples per optimizer step."""
    device: str = II("trainer.accelerator")
    """Recorded in the study's fingerprint."""
    micro_batches: list[int] | None = None
    """Micro-batch counts; null: the divisors of the global batch."""
    schedules: list[str] = field(default_factory=lambda: ["dapple", "gpipe"])
    """Add interleaved, zb-v or v-half to search plans with several stages per rank group."""
    max_stages: int | None = None
    chunks: int = 2
    """Stages per rank group of the interleaved plans."""


@dataclass
class DappleSweeperConf:
    _target_: str = "hydra_plugins.dapple_sweeper.dapple_sweeper.DappleSweeper"
    space: PlanSpaceConf = field(default_factory=PlanSpaceConf)
    storage: str = "sqlite:///dapple_sweep.db"
    """Optuna storage URL; the study resumes when the sweep runs again."""
    study_name: str = "dapple-sweep"
    n_trials: int = 20
    """Finished trials the study should hold (a resumed sweep runs only what is missing)."""
    n_jobs: int = 1
    """Jobs handed to the launcher at once."""
    sampler: str = "tpe"
    """tpe (seeded, multivariate) or random."""
    seed: int = 0
    directions: list[str] = field(default_factory=lambda: ["maximize"])
    """What the job's return value means: samples/s -> maximize, a loss -> minimize."""
    metrics: list[str] | None = None
    """Keys of a mapping the job returns, one per direction (null: the job returns a number)."""
    plan_key: str = "plan"
    """Config key the sampled plan is written to (as ``++plan={...}``)."""
    allow_mismatch: bool = False
    """Resume a study made for another model size, world size or batch."""
    enqueue: list[Any] = field(default_factory=list)
    """Plans (mappings or YAML paths) to run first."""
    baselines: list[str] = field(default_factory=lambda: ["data_parallel", "straight"])
    """Measured before anything else: data parallelism and a balanced straight pipeline. A plan
    must beat data parallelism by more than the measurements' spread to be chosen over it."""
    heartbeat_s: int | None = 10
    """Each running trial beats this often; a worker finding one silent for 3 beats ends it and
    queues its plan again (null: no heartbeat)."""
    confirm_repeats: int = 1
    """At the end, the fastest plan by median, data parallelism and the closest rival (at most 3)
    run this many more jobs each, interleaved; the choice takes each plan's median (0: off)."""
    model: str | None = None
    """``module:function`` (importable from the app's directory) that takes a job's config and
    returns ``(LightningModule, train DataLoader)``: the planner profiles it in a child process and
    its top picks run after the baselines (null: no planner seeds; the examples name theirs)."""
    planner_seeds: int = 3
    """How many of the planner's picks to queue when ``model`` is set."""


ConfigStore.instance().store(group="hydra/sweeper", name="dapple", node=DappleSweeperConf, provider="dapple_lightning")
