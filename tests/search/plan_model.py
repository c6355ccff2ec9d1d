"""A factory whose module logs the plan it runs under (spawned ranks import it by name)."""

from __future__ import annotations

from typing import Any

import torch

from dapple_lightning.search.testing import MLP, mlp


class PlanLoggingMLP(MLP):
    """Logs the plan's shape, so a test in the parent process can see which plan the ranks ran."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        plan = self.trainer.strategy.plan
        self.log("plan_micro_batches", float(plan.micro_batches))
        self.log("plan_stages", float(plan.num_stages))
        self.log("plan_first_cut", float(plan.stages[1].start if plan.num_stages > 1 else 0))
        return super().training_step(batch, batch_idx)


def factory(batch_size: int) -> tuple[PlanLoggingMLP, Any]:
    _, loader = mlp(batch_size)
    return PlanLoggingMLP(), loader
