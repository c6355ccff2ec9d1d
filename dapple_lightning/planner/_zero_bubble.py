"""The cost model's estimate of a zero-bubble (``zb-h1``, ``zb-h2``, ``zb-tail``) plan: replayed, not a formula.

ZB-H1 keeps DAPPLE's order of forwards and input backwards (``B``) and defers the weights'
backwards (``W``) into what would be bubbles (ZB-H2 runs more forwards ahead and defers more
``W``s); the step depends on where each ``W`` lands, which
the chains of ``_cost`` do not express. So the estimate takes DAPPLE's per-stage costs of the
same stages (forward, whole backward, transfers, all-reduce, update), splits each backward into
``B = backward - W`` and ``W`` (the profile's ``weight_s`` summed over the stage's layers and
scaled with its samples; without ``weight_s`` a stage's ``W`` is 0, so nothing is gained over
DAPPLE's order), and replays the schedule's lists event by event (``_simulator``). Memory: each
stage keeps the schedule's peak of live micro-batches (``schedule.peak_in_flight``: a
micro-batch lives from its forward to its ``W``, or to its ``B`` where it has none): ``min(S, M)``
on every stage under ZB-H1, the first stage's DAPPLE depth, ``min(2S - 1, M)`` under ZB-H2, at
most that under zb-tail, which ``memory_limit`` then prices (a plan that fits under ZB-H1 may not
under ZB-H2). A micro-batch without a ``W`` in its stage's list runs its whole backward in its
``B``. Between its ``B`` and its ``W`` a micro-batch holds, instead of its graph, the linear layers'
weight-gradient store (each call's input, which its ``kept`` counts, and its output's gradient, about
what the op after it saves) and the other weights' gradients: priced as its ``kept``, which it holds
until its ``W``. On top, ``W`` makes the stored gradients one weight at a time
(``runtime._linear_split.WeightGrads``): its transient is at most the stage's largest layer's
parameter bytes, added to the stage's peak (:func:`weight_transient`). The phases stay DAPPLE's (its pivot, ``T_w`` and ``T_s``); ``T_e`` is the rest of the
replayed step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from dapple_lightning.plan import Plan
from dapple_lightning.planner._simulator import replay_end
from dapple_lightning.schedule import peak_in_flight, schedule

if TYPE_CHECKING:
    from dapple_lightning.planner._cost import CostModel, Estimate

__all__ = ["stage_weight", "weight_transient", "zero_bubble"]


def stage_weight(model: CostModel, start: int, end: int, samples: int) -> float:
    """Seconds of the weights' backward (``W``) of layers ``[start, end)`` on ``samples`` samples:
    the layers' ``weight_s`` (0 where not measured), scaled linearly from the profile batch."""
    total = sum(layer.weight_s or 0.0 for layer in model.profile.layers[start:end])
    return total * samples / model.profile.profile_batch_size


def weight_transient(model: CostModel, start: int, end: int) -> float:
    """Bytes ``W`` of layers ``[start, end)`` makes at once beyond what stays: one stored weight's
    gradient, at most the largest layer's parameter bytes (a layer holds one or more weights)."""
    return float(max((layer.param_bytes for layer in model.profile.layers[start:end]), default=0))


def zero_bubble(model: CostModel, plan: Plan) -> Estimate:
    """``model``'s estimate of ``plan`` under its zero-bubble schedule (see the module docstring)."""
    base = model.estimate(replace(plan, schedule="dapple"))
    count, m = plan.num_stages, plan.micro_batches
    lists = schedule(plan.schedule, count, m)
    weight = tuple(
        min(stage_weight(model, s.start, s.end, n), b) for s, n, b in zip(plan.stages, base.samples, base.backward_s)
    )
    pipeline = replay_end(
        lists, base.forward_s, base.backward_s, weight, base.send_forward_s, base.allreduce_s, base.update_s
    )
    step = max(pipeline, base.shared_compute_s)
    memory = tuple(
        model.memory.stage_bytes(s.start, s.end, n, peak_in_flight(actions), s.replicas, m)
        + weight_transient(model, s.start, s.end)
        for s, n, actions in zip(plan.stages, base.samples, lists)
    )
    return replace(
        base,
        plan=plan,
        step_s=step,
        ending_s=step - base.warmup_s - base.steady_s,
        memory_bytes=memory,
        pipeline_s=pipeline,
        weight_s=weight,
    )
