"""A Hydra app for the sweeper tests: "trains" nothing, returns a throughput computed from the plan.

Its config mirrors the keys the dapple sweeper reads by default (``model.num_layers``,
``trainer.devices``, ``trainer.accelerator``, ``data.batch_size``) and a ``plan``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from dapple_lightning.plan import Plan

LAYER_COST = (1.0, 1.0, 2.0, 2.0, 1.0, 3.0)
FAIL_MICRO_BATCHES = 8  # plans with this many micro-batches make the job raise


def fake_samples_per_s(plan: Plan, global_batch: int) -> float:
    """A pipeline's throughput under a toy cost model: the slowest stage per replica, plus the bubble
    and a fixed cost per micro-batch. One exact answer per plan, so tests can check the sweep's values."""
    slowest = max(sum(LAYER_COST[s.start : s.end]) / s.replicas for s in plan.stages)
    m, n = plan.micro_batches, plan.num_stages
    step = slowest * (m + n - 1) / m + 0.05 * m + (0.01 if plan.schedule == "gpipe" else 0.0)
    return global_batch / step


@dataclass
class Config:
    model: dict[str, Any] = field(default_factory=lambda: {"num_layers": len(LAYER_COST)})
    trainer: dict[str, Any] = field(default_factory=lambda: {"devices": 4, "accelerator": "cpu"})
    data: dict[str, Any] = field(default_factory=lambda: {"batch_size": 16})
    plan: Any = "auto"


ConfigStore.instance().store(name="config", node=Config)


@hydra.main(version_base=None, config_name="config")
def main(cfg: DictConfig) -> float:
    plan = Plan.coerce(cfg.plan)
    if plan.micro_batches == FAIL_MICRO_BATCHES:
        raise RuntimeError(f"injected job failure (micro_batches={plan.micro_batches})")
    return fake_samples_per_s(plan, cfg.data.batch_size)


if __name__ == "__main__":
    main()
