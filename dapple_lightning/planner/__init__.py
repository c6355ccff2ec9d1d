"""The planning layer: profiles, clusters, the cost model, the simulator and the planner.

Pure Python: nothing here starts a process group or needs a device, except
:func:`profile_layers`, which times layers on the current device (and imports torch only
when called).
"""

from dapple_lightning.planner._baselines import baselines, data_parallel_plan, pipedream_plan, straight_plan
from dapple_lightning.planner._cluster import GB, Cluster
from dapple_lightning.planner._cost import CostModel, Estimate, Placement, estimate
from dapple_lightning.planner._dp import (
    PlannedPlan,
    best_over_micro_batches,
    least_memory,
    micro_batch_candidates,
    plan_dapple,
    replica_candidates,
)
from dapple_lightning.planner._measure import profile_layers
from dapple_lightning.planner._placement import PLACEMENTS, allocate, place
from dapple_lightning.planner._profile import LayerProfile, ModelProfile, load_profile, read_pipedream
from dapple_lightning.planner._simulator import Event, Simulation, simulate_plan

__all__ = [
    "GB",
    "PLACEMENTS",
    "Cluster",
    "CostModel",
    "Estimate",
    "Event",
    "LayerProfile",
    "ModelProfile",
    "Placement",
    "PlannedPlan",
    "Simulation",
    "allocate",
    "baselines",
    "best_over_micro_batches",
    "data_parallel_plan",
    "estimate",
    "least_memory",
    "load_profile",
    "micro_batch_candidates",
    "pipedream_plan",
    "place",
    "plan_dapple",
    "profile_layers",
    "read_pipedream",
    "replica_candidates",
    "simulate_plan",
    "straight_plan",
]
