"""The planning layer: profiles, clusters, the cost model, the simulator, the planner, and the
policy that chooses among plans the model cannot tell apart (:func:`shortlist`,
:func:`measure_in_turns`, :func:`refine`), and the one rule that chooses a plan from measurements,
``plan="auto"``'s and the search's alike (:func:`choose_measured`).

Pure Python: nothing here starts a process group or needs a device, except
:func:`profile_layers`, which times layers on the current device, and :func:`measure_cluster`,
which times the process group's links (both import torch only when called).
"""

from dapple_lightning.planner._baselines import baselines, data_parallel_plan, pipedream_plan, straight_plan
from dapple_lightning.planner._budget import format_bytes, over_budget, parse_memory, stage_memory_lines
from dapple_lightning.planner._choice import MIN_SPREAD, MeasuredPlan, PlanChoice, choose_measured, relative_spread
from dapple_lightning.planner._chunks import (
    ChunkedEstimate,
    best_chunked_offers,
    chunked_variants,
    estimate_chunked,
    offer_chunks,
)
from dapple_lightning.planner._clock import DeviceEvent, Stopwatch, device_clock
from dapple_lightning.planner._cluster import GB, Cluster
from dapple_lightning.planner._cost import CostModel, Estimate, Placement, estimate
from dapple_lightning.planner._decision import AutoPlan
from dapple_lightning.planner._dp import (
    PlannedPlan,
    SearchRecord,
    micro_batch_candidates,
    plan_dapple,
    replica_candidates,
)
from dapple_lightning.planner._levers import offloaded_plan, shortlist_with_levers
from dapple_lightning.planner._links import (
    MEMORY_MARGIN,
    MESSAGE_SIZES,
    compute_units,
    cores,
    device_memory,
    fit_link,
    measure_cluster,
    measure_shard_costs,
    message_sizes,
    node_ranks,
    shard_sizes,
)
from dapple_lightning.planner._measure import SETTLE_STEPS, fixed_part, fresh_leaves, profile_layers
from dapple_lightning.planner._memory import live_bytes
from dapple_lightning.planner._objective import OBJECTIVES, check_objective, peak_limit
from dapple_lightning.planner._pipedream import REFERENCE_PROFILES, load_profile, read_pipedream
from dapple_lightning.planner._placement import PLACEMENTS, allocate, place
from dapple_lightning.planner._profile import LayerProfile, ModelProfile
from dapple_lightning.planner._select import (
    TRIAL_LIMIT,
    TRIAL_MARGIN,
    TRIAL_ROUNDS,
    Measured,
    Trial,
    measure_and_choose,
    measure_in_turns,
    predicted_step,
    refine,
    refine_allreduce,
    shortlist,
)
from dapple_lightning.planner._shard_costs import Affine, ShardCosts, fit_affine
from dapple_lightning.planner._sharding import ShardPrice, shard_price, sharded_plan
from dapple_lightning.planner._simulator import Event, Simulation, simulate_plan
from dapple_lightning.planner._window import AUTO_WINDOW_MOST, WindowChoice, choose_window

__all__ = [
    "AUTO_WINDOW_MOST",
    "GB",
    "MEMORY_MARGIN",
    "MESSAGE_SIZES",
    "MIN_SPREAD",
    "OBJECTIVES",
    "PLACEMENTS",
    "REFERENCE_PROFILES",
    "SETTLE_STEPS",
    "TRIAL_LIMIT",
    "TRIAL_MARGIN",
    "TRIAL_ROUNDS",
    "Affine",
    "AutoPlan",
    "ChunkedEstimate",
    "Cluster",
    "CostModel",
    "DeviceEvent",
    "Estimate",
    "Event",
    "LayerProfile",
    "Measured",
    "MeasuredPlan",
    "ModelProfile",
    "Placement",
    "PlanChoice",
    "PlannedPlan",
    "SearchRecord",
    "ShardCosts",
    "ShardPrice",
    "Simulation",
    "Stopwatch",
    "Trial",
    "WindowChoice",
    "allocate",
    "baselines",
    "best_chunked_offers",
    "check_objective",
    "choose_measured",
    "choose_window",
    "chunked_variants",
    "compute_units",
    "cores",
    "data_parallel_plan",
    "device_clock",
    "device_memory",
    "estimate",
    "estimate_chunked",
    "fit_affine",
    "fit_link",
    "fixed_part",
    "format_bytes",
    "fresh_leaves",
    "live_bytes",
    "load_profile",
    "measure_and_choose",
    "measure_cluster",
    "measure_in_turns",
    "measure_shard_costs",
    "message_sizes",
    "micro_batch_candidates",
    "node_ranks",
    "offer_chunks",
    "offloaded_plan",
    "over_budget",
    "parse_memory",
    "peak_limit",
    "pipedream_plan",
    "place",
    "plan_dapple",
    "predicted_step",
    "profile_layers",
    "read_pipedream",
    "refine",
    "refine_allreduce",
    "relative_spread",
    "replica_candidates",
    "shard_price",
    "shard_sizes",
    "sharded_plan",
    "shortlist",
    "shortlist_with_levers",
    "simulate_plan",
    "stage_memory_lines",
    "straight_plan",
]
