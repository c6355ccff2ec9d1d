"""``plan="auto"``: profile the user's layers, measure the process group, let the planner choose.

Runs inside the strategy's ``setup`` on every rank, before the model is partitioned:

1. draw one global batch from the training DataLoader (the RNG states that decide the data
   order are saved and restored, so training still sees the batches it would have seen);
2. run the user's ``training_step`` until it reaches the Sequential, to learn the
   Sequential's input (for a ModuleList of blocks or a chain of containers, through every
   layer, to learn what each is called with: its activation and side inputs);
3. time every layer's forward and backward on this rank's device, run as a chain at two batch
   sizes (so that small micro-batches are priced at what they cost), what adding into
   existing gradients costs, and the user's optimizer's step over each layer's parameters
   (all ranks at once, as training steps them; the ranks' times are averaged, so every rank
   plans from the same numbers);
4. time point-to-point and all-reduce messages on the real process group;
5. run the DAPPLE planner on rank 0 and broadcast its choice; when other plans are predicted
   within the model's error of it (see ``planner.shortlist``), run them for a few real steps,
   in turns (see ``planner.measure_in_turns``), and choose by the rule every path that measures
   plans uses (``planner.choose_measured``): the fastest median, unless a simpler plan is within
   the measurements' noise of it.

Which plans to measure, in what turns and what the measurements teach the profile is the
planner's pure policy (``dapple_lightning.planner``); this module does the measuring.
"""

from __future__ import annotations

import copy
import inspect
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple_lightning.microbatch import map_tensors
from dapple_lightning.plan import ZERO_BUBBLE, Plan
from dapple_lightning.planner import (
    TRIAL_MARGIN,
    AutoPlan,
    Cluster,
    Measured,
    ModelProfile,
    Stopwatch,
    Trial,
    check_objective,
    estimate,
    fixed_part,
    fresh_leaves,
    measure_and_choose,
    measure_cluster,
    message_sizes,
    predicted_step,
    profile_layers,
    refine,
    refine_allreduce,
    shard_sizes,
    shortlist_with_levers,
)
from dapple_lightning.surgery import standing_in

__all__ = [
    "AutoPlan",
    "choose_plan",
    "draw_batch",
    "optimizer_factory",
    "small_batch_of",
    "time_step_around",
    "time_step_outside",
]


@contextmanager
def _preserved_rng(dataloader: Any):
    """Restore every RNG that decides the data order after drawing a batch for profiling."""
    cpu = torch.get_rng_state()
    sampler = getattr(dataloader, "sampler", None)
    generator = getattr(sampler, "generator", None)
    gen_state = generator.get_state() if isinstance(generator, torch.Generator) else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if gen_state is not None:
            generator.set_state(gen_state)


def _batch_rows(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.dim() else 1
    if isinstance(value, list | tuple) and value:
        return _batch_rows(value[0])
    return 1


def draw_batch(dataloader: Any) -> Any:
    """The first batch of ``dataloader``, leaving the order of later iterations as it was."""
    with _preserved_rng(dataloader):
        iterator = iter(dataloader)
        try:
            return next(iterator)
        finally:
            del iterator


class _Replay(nn.Module):
    """Stands in for the container (or one of its layers): returns a stored output on every call.

    The last layer's output comes as fresh leaves, so that the step's backward ends there.
    Earlier layers' outputs come as they were recorded (without autograd): the user's code between
    layers and containers (a loop unpacking a block's tuple, pooling and flattening before the next
    container) runs on what it had in the step, with its shapes, rather than on a stand-in value it
    may not accept (``x.view(-1, 256 * 6 * 6)`` of the first layer's input).
    """

    def __init__(self, output: Any, *, leaves: bool = True) -> None:
        super().__init__()
        self.output = output
        self.leaves = leaves

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return fresh_leaves(self.output) if self.leaves else self.output


def _replaying(containers: Sequence[nn.Module], outputs: Sequence[Any]) -> tuple[nn.Module, ...]:
    """What stands in for each of ``containers`` while the step around them is timed: one of its
    own class and length (the user's loop and the container's own forward run through it as they
    would), whose layer ``i`` returns ``outputs[i]``, what layer ``i`` returned in the step."""
    count = sum(len(c) for c in containers)
    if len(outputs) != count:
        raise ValueError(f"the containers hold {count} layers but {len(outputs)} outputs were recorded")
    replays = iter(_Replay(out, leaves=index == count - 1) for index, out in enumerate(outputs))
    stand_ins = []
    for container in containers:
        stand_in = copy.copy(container)
        stand_in.__dict__["_modules"] = OrderedDict((name, next(replays)) for name, _ in container.named_children())
        stand_ins.append(stand_in)
    return tuple(stand_ins)


def time_step_outside(
    module: nn.Module,
    set_sequential: Callable[[nn.Module], None],
    sequential: nn.Module,
    step: Callable[[], Any],
    sequential_input: Any,
) -> tuple[float, float]:
    """Median forward and backward seconds of the user's step outside the Sequential (the loss,
    metrics, logging calls): the last stage runs them for every micro-batch, as if they were one
    more layer. ``step`` runs the training step on the batch whose Sequential input is
    ``sequential_input``; the Sequential is replaced by a replay of its output."""
    with torch.no_grad():
        output = sequential(sequential_input)
    with standing_in(set_sequential, sequential, _Replay(output)):
        return _time_step(module, step, _device_of(sequential_input))


def time_step_around(
    module: nn.Module,
    put: Callable[[Sequence[nn.Module]], None],
    containers: Sequence[nn.Module],
    step: Callable[[], Any],
    outputs: Sequence[Any],
) -> tuple[float, float]:
    """:func:`time_step_outside` for layers that the user's code calls one by one (the blocks of a
    ModuleList, the layers of a chain of containers), given what each layer returned in the step
    on its batch (``outputs``, in plan order); ``put`` puts modules at the containers' paths. No
    layer computes: each replays its output, so the step's own code (before, between and after
    the containers) is what is timed; the forward of code between containers is counted, its
    backward is not (it ends at the last layer's replay)."""
    with standing_in(put, tuple(containers), _replaying(containers, outputs)):
        return _time_step(module, step, _device_of(outputs))


def _device_of(value: Any) -> torch.device:
    found: list[torch.device] = []
    map_tensors(value, lambda t: found.append(t.device))
    return found[0] if found else torch.device("cpu")


def _time_step(
    module: nn.Module, step: Callable[[], Any], device: torch.device, repeats: int = 3, warmup: int = 1
) -> tuple[float, float]:
    """Median forward and backward seconds of ``step`` and its loss's backward (CUDA events on
    CUDA, read once at the end; see ``planner.Stopwatch``)."""
    watch = Stopwatch(device)
    try:
        for _ in range(warmup + repeats):
            with watch.span():
                result = step()
            loss = result.get("loss") if isinstance(result, dict) else result
            with watch.span():
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    loss.backward()
        spans = watch.seconds()[2 * warmup :]
    finally:
        module.zero_grad(set_to_none=True)
    return statistics.median(spans[0::2]), statistics.median(spans[1::2])


def _with_step_outside(
    profile: ModelProfile, big: tuple[int, float, float], small: tuple[int, float, float] | None
) -> ModelProfile:
    """``profile`` with the step's own time (at two batch sizes) added to its last layer."""
    data = profile.to_dict()
    last = data["layers"][-1]
    _, fwd, bwd = big
    last["forward_s"] += fwd
    last["backward_s"] += bwd
    if small is not None:
        last["forward_fixed_s"] += fixed_part(fwd, small[1], big[0], small[0])
        last["backward_fixed_s"] += fixed_part(bwd, small[2], big[0], small[0])
    return ModelProfile.from_dict(data)


_TIMES = ("forward_s", "backward_s", "forward_fixed_s", "backward_fixed_s", "update_s", "accumulate_s", "weight_s")


def _averaged(profile: ModelProfile, device: torch.device) -> ModelProfile:
    """The ranks' mean times, so that every rank plans from the same numbers (reduced on ``device``,
    the process group's)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return profile
    times = torch.tensor(
        [[getattr(layer, key) or 0.0 for key in _TIMES] for layer in profile.layers], dtype=torch.float64, device=device
    ).reshape(-1)
    dist.all_reduce(times)
    times = (times / dist.get_world_size()).reshape(-1, len(_TIMES)).cpu().tolist()
    data = profile.to_dict()
    for layer, values in zip(data["layers"], times):
        layer.update(zip(_TIMES, values))
        for part in ("forward", "backward"):  # a mean of fixed parts can round above the mean time
            layer[f"{part}_fixed_s"] = min(layer[f"{part}_fixed_s"], layer[f"{part}_s"])
        layer["weight_s"] = min(layer["weight_s"], layer["backward_s"])
    return ModelProfile.from_dict(data)


def optimizer_factory(module: nn.Module) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None:
    """Builds the kind of optimizer the module's ``configure_optimizers`` returns (its first one,
    with its defaults) over given parameters, for timing optimizer steps; ``None`` if there is none."""
    configure = getattr(module, "configure_optimizers", None)
    if configure is None:
        return None
    found = _first_optimizer(configure())
    if found is None:
        return None
    kind = type(found)
    # ``defaults`` may hold settings the constructor does not take (AdamW's decoupled_weight_decay).
    accepted = inspect.signature(kind.__init__).parameters
    defaults = {k: v for k, v in found.defaults.items() if k in accepted}

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return kind(params, **defaults)

    build([nn.Parameter(torch.zeros(1))])  # fail here, where the caller can do without, not mid-profile
    return build


def _first_optimizer(value: Any) -> torch.optim.Optimizer | None:
    if isinstance(value, torch.optim.Optimizer):
        return value
    if isinstance(value, dict):
        return _first_optimizer(value.get("optimizer"))
    if isinstance(value, list | tuple):
        for item in value:
            found = _first_optimizer(item)
            if found is not None:
                return found
    return None


def small_batch_of(rows: int) -> int | None:
    """The smaller batch the profile also times the layers at (see ``planner.profile_layers``'
    ``small_batch``) when it profiles ``rows`` rows; ``None`` for a single row."""
    return max(1, rows // 8) if rows > 1 else None


def _shortlist_on_rank_zero(
    profile: ModelProfile, cluster: Cluster, global_batch: int, **options: Any
) -> tuple[list[tuple[Plan, float]], float | None, str | None, dict[Plan, str]]:
    """``planner.shortlist_with_levers`` with ``options``, run on rank 0 alone and broadcast: the
    search runs once, and every rank trials the same plans in the same order."""
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        close, dp_step, lever, offers = shortlist_with_levers(profile, cluster, global_batch, **options)
        plans = [(plan.to_dict(), predicted) for plan, predicted in close]
        box = [(plans, dp_step, lever, [(plan.to_dict(), why) for plan, why in offers.items()])]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, 0)
    close = [(Plan.coerce(plan), predicted) for plan, predicted in box[0][0]]
    return close, box[0][1], box[0][2], {Plan.coerce(plan): why for plan, why in box[0][3]}


def windows(param_bytes: Sequence[int], window_bytes: int | None) -> list[range]:
    """Consecutive layers whose parameters take at most ``window_bytes`` together (a layer larger
    than that alone); one window of every layer when ``window_bytes`` is ``None``."""
    if window_bytes is None:
        return [range(len(param_bytes))]
    out, start, total = [], 0, 0
    for index, size in enumerate(param_bytes):
        if index > start and total + size > window_bytes:
            out.append(range(start, index))
            start, total = index, 0
        total += size
    return [*out, range(start, len(param_bytes))]


def profile_in_windows(
    layers: Sequence[nn.Module],
    sample_input: Any,
    *,
    hold: Callable[[Sequence[int]], None] | None = None,
    window_bytes: int | None = None,
    **kwargs: Any,
) -> ModelProfile:
    """``planner.profile_layers`` over the chain ``layers`` one window of them at a time (see
    :func:`windows`), ``hold(window)`` bringing that window's layers to the device first: profiling
    then holds one window, not the model. Each window runs as a chain of its own, on the previous
    window's output (computed without autograd); the profiles are joined in order, each layer
    named by its index in the whole chain."""
    parts = windows([sum(p.numel() * p.element_size() for p in m.parameters()) for m in layers], window_bytes)
    profiles, value = [], sample_input
    for window in parts:
        if hold is not None:
            hold(window)
        modules = [layers[i] for i in window]
        profiles.append(profile_layers(modules, value, **kwargs))
        if window is not parts[-1]:
            with torch.no_grad():
                value = map_tensors(value, lambda t: t.clone())  # a layer that changes its input in place
                for module in modules:
                    value = module(value)
    if hold is not None:
        hold([])
    if len(profiles) == 1:
        return profiles[0]
    data = profiles[0].to_dict()
    data["layers"] = [layer.to_dict() for part in profiles for layer in part.layers]
    for index, layer in enumerate(data["layers"]):
        layer["name"] = f"{index}:{layer['name'].partition(':')[2]}"
    data["cut_bytes"] = None  # the chain's, from the layers' outputs, as one window gives
    return ModelProfile.from_dict(data)


def _measured_cluster(
    device: torch.device, nodes: int, profile: ModelProfile, global_batch: int, memory_limit: float | None
) -> Cluster:
    """The links timed at what plans of ``profile`` send, within ``memory_limit``; under a budget, whose
    levers may shard a stage, also FSDP2's passes on every replica count a node holds (collective)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    shards = tuple(range(2, world // nodes + 1)) if memory_limit is not None and world % nodes == 0 else ()
    sizes = message_sizes(profile, global_batch)
    measured = measure_cluster(device, nodes=nodes, sizes=sizes, shard_replicas=shards, shard_at=shard_sizes(profile))
    return measured if memory_limit is None else replace(measured, memory_bytes=float(memory_limit))


def choose_plan(
    layers: Sequence[nn.Module],
    sample_input: Any,
    device: torch.device,
    *,
    nodes: int = 1,
    hold: Callable[[Sequence[int]], None] | None = None,
    window_bytes: int | None = None,
    global_batch: int,
    optimizer_factor: float = 2.0,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    step_outside: Callable[[int], tuple[float, float]] | None = None,
    trial: Callable[[Plan], Measured] | None = None,
    margin: float = TRIAL_MARGIN,
    objective: str = "time",
    memory_margin: float = 0.1,
    memory_limit: float | None = None,
    offload_refused: str | None = None,
    chunks_refused: str | None = None,
    shard_refused: Callable[[Plan], str | None] | None = None,
) -> AutoPlan:
    """Profile, measure and plan (collective on every rank); the plan is rank 0's choice.

    ``layers`` run as a chain, each on the previous one's output: a Sequential's layers, or the blocks of
    a ModuleList or the layers of a chain of containers, wrapped to (``strategy._auto_blocks``).
    ``sample_input``, the first layer's input, should have about as many rows as a device runs per
    micro-batch at most; the layers are timed on it and on :func:`small_batch_of` its rows (an
    eighth). ``optimizer`` (:func:`optimizer_factory`) lets the profile include each layer's optimizer
    step; ``step_outside(rows)`` (:func:`time_step_outside`) the step's own time on ``rows`` rows;
    ``hold`` and ``window_bytes`` profile the layers a window at a time (:func:`profile_in_windows`).

    When several plans are predicted within ``margin`` of the best (see ``planner.shortlist``),
    the prediction cannot tell them apart; with ``trial`` (a collective that runs a plan for a
    few real steps, see ``planner.Measured``), they are measured in turns (see
    ``planner.measure_in_turns``), one is chosen by ``planner.choose_measured`` (the fastest
    median unless a simpler plan is within the spreads of it, as the search chooses), and the
    profile is refined with what the stages' passes took (see ``planner.refine``): the returned
    profile and predictions are the refined ones, as is the all-reduce bandwidth when data
    parallelism was among them (see ``planner.refine_allreduce``).

    ``objective`` and ``memory_margin`` choose what the planner minimises (see
    ``planner.plan_dapple``): the fastest plan that fits (``"time"``), the least per-device peak
    memory (``"memory"``), or the fastest within ``memory_margin`` of that least peak
    (``"time-within-memory"``); ``plan="auto"`` runs under ``"time"``. No plan is chosen over
    ``memory_limit`` bytes per rank (``None``: the device's memory, see ``planner.device_memory``);
    when none fits, stages recompute, shard or are offloaded (``planner.shortlist_with_levers``), and chunked
    plans come where ``planner.shortlist`` offers them, each unless ``shard_refused(plan)``, ``offload_refused``
    or ``chunks_refused`` says why the runtime cannot; the report says which and why."""
    start = time.perf_counter()
    if not 0.0 <= margin < 1.0:  # before the profiling, not after
        raise ValueError(f"margin must be in [0, 1), got {margin!r}")
    check_objective(objective, memory_margin)
    small = small_batch_of(rows := _batch_rows(sample_input))
    together = dist.barrier if dist.is_initialized() and dist.get_world_size() > 1 else None
    timing = dict(repeats=5, warmup=2, small_batch=small, optimizer=optimizer, in_step=together, split_backward=True)
    profile = profile_in_windows(list(layers), sample_input, hold=hold, window_bytes=window_bytes, **timing)
    if step_outside is not None:
        big = (rows, *step_outside(rows))
        profile = _with_step_outside(profile, big, (small, *step_outside(small)) if small else None)
    profile = _averaged(profile, device)
    cluster = _measured_cluster(device, nodes, profile, global_batch, memory_limit)
    options = dict(optimizer_factor=optimizer_factor, margin=margin, objective=objective, memory_margin=memory_margin)
    options.update(offload_refused=offload_refused, shard_refused=shard_refused, chunks=chunks_refused is None)
    close, dp_step, lever, offers = _shortlist_on_rank_zero(profile, cluster, global_batch, **options)
    trials: tuple[Trial, ...] = ()
    plan, predicted = close[0]
    reason: str | None = None
    if trial is not None and len(close) > 1:
        choice, trials, runs = measure_and_choose(close, trial, global_batch=global_batch)
        plan, reason = choice.chosen.plan, choice.reason
        profile = refine(profile, cluster, global_batch, runs, optimizer_factor=optimizer_factor)
        cluster = refine_allreduce(profile, cluster, global_batch, runs, optimizer_factor=optimizer_factor)
        predicted = predicted_step(plan, profile, cluster, global_batch, optimizer_factor=optimizer_factor)[0]
        if dp_step is not None:
            dp_plan = Plan.data_parallel(profile.num_layers, cluster.world_size)
            dp_step = estimate(dp_plan, profile, cluster, global_batch, optimizer_factor=optimizer_factor).step_s
    spent = time.perf_counter() - start
    decided = _decided(plan, predicted, dp_step, profile, cluster, spent, trials, global_batch, optimizer_factor)
    return replace(decided, lever=lever, reason=reason, offers=tuple(offers.items()), chunks_refused=chunks_refused)


def _decided(
    plan: Plan,
    predicted: float,
    dp_step: float | None,
    profile: ModelProfile,
    cluster: Cluster,
    spent: float,
    trials: tuple[Trial, ...],
    global_batch: int,
    optimizer_factor: float,
) -> AutoPlan:
    """The decision with what its report explains: each stage's predicted peak, and for a zero-bubble plan
    the same stages' step under DAPPLE's 1F1B."""
    memory = predicted_step(plan, profile, cluster, global_batch, optimizer_factor=optimizer_factor)[1]
    one_f_one_b = None
    if plan.schedule in ZERO_BUBBLE:
        same_split = replace(plan, schedule="dapple")
        one_f_one_b = estimate(same_split, profile, cluster, global_batch, optimizer_factor=optimizer_factor).step_s
    return AutoPlan(plan, predicted, dp_step, profile, cluster, spent, trials, memory, one_f_one_b)
