"""The fake objective of ``sweep_app.py``: a throughput computed from the plan (no training).

Separate from the app so that tests import it without registering the app's Hydra config.
"""

from __future__ import annotations

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
