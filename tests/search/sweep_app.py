"""A Hydra app for the sweeper tests: "trains" nothing, returns a throughput computed from the plan.

Its config mirrors the keys the dapple sweeper reads by default (``model.num_layers``,
``trainer.devices``, ``trainer.accelerator``, ``data.batch_size``) and a ``plan``, which may name a
study's plan (``optuna://...``) as the examples' apps do. It can open the ``sqlite+password``
storage of ``password_dialect``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import hydra
import password_dialect  # noqa: F401 (registers the sqlite+password storage)
from fake_objective import FAIL_MICRO_BATCHES, LAYER_COST, fake_samples_per_s
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from dapple_lightning.plan import Plan
from dapple_lightning.search import resolve_plan_spec


@dataclass
class Config:
    model: dict[str, Any] = field(default_factory=lambda: {"num_layers": len(LAYER_COST)})
    trainer: dict[str, Any] = field(default_factory=lambda: {"devices": 4, "accelerator": "cpu"})
    data: dict[str, Any] = field(default_factory=lambda: {"batch_size": 16})
    plan: Any = "auto"


ConfigStore.instance().store(name="config", node=Config)


@hydra.main(version_base=None, config_name="config")
def main(cfg: DictConfig) -> float:
    plan = Plan.coerce(resolve_plan_spec(cfg.plan))
    if plan.micro_batches == FAIL_MICRO_BATCHES:
        raise RuntimeError(f"injected job failure (micro_batches={plan.micro_batches})")
    return fake_samples_per_s(plan, cfg.data.batch_size)


def search_model(cfg: DictConfig) -> Any:
    """What the planner profiles for this app (``hydra.sweeper.model=sweep_app:search_model``): an
    MLP with as many layers as the config says."""
    from dapple_lightning.search.testing import mlp

    return mlp(batch_size=cfg.data.batch_size, layers=cfg.model.num_layers // 2)


if __name__ == "__main__":
    main()
