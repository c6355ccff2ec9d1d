"""Measure what the planner needs to know of the machines: links within and across nodes, memory, cores.

Ranks are numbered node-major, as Lightning and torchrun number them: rank ``r`` runs on node
``r // per_node``. A ring over the whole world crosses servers, so its all-reduce shows the
network's speed and not NVLink's; the figures within a node therefore come from ranks of one node
only (a pair for point-to-point, a node's own group for the all-reduce), those across nodes from a
pair on two nodes and from the world ring. Like :func:`profile_layers`, this imports torch only
when called.

Each link is timed at a few message sizes, those a plan of the profiled model sends
(:func:`message_sizes`: activations at the cuts, for point-to-point; gradients, for the
all-reduce), and fitted as ``latency + size / bandwidth`` (:func:`fit_link`), the cost model's own
form: one size (a large one) makes a fast link (NVLink) look slower than it is, since its
latency is then a large part of the time.

A stage sharded over its replicas (``Stage.shard``) costs more than its bytes on these links: what
FSDP2 adds to each kind of a sharded layer's pass is timed as such (:func:`measure_shard_costs`, on
a group of each replica count asked for, at the profile's layer sizes, :func:`shard_sizes`).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from dapple_lightning.planner._cluster import Cluster
from dapple_lightning.planner._shard_costs import (
    SHARD_PASSES,
    ShardCosts,
    fit_affine,
    least_squares,
    slope_through_zero,
)

if TYPE_CHECKING:
    import torch

    from dapple_lightning.planner._profile import ModelProfile

__all__ = [
    "MEMORY_MARGIN",
    "MESSAGE_SIZES",
    "compute_units",
    "cores",
    "device_memory",
    "fit_link",
    "measure_cluster",
    "measure_shard_costs",
    "message_sizes",
    "node_ranks",
    "shard_sizes",
]

MEMORY_MARGIN = 0.1
"""Share of a GPU's total memory a plan leaves unused: what comes onto the device after planning
(the stages' NCCL communicators and their buffers, kernels loaded on first use) and the caching
allocator's fragmentation."""

MESSAGE_SIZES = (2**16, 2**20, 2**23)
"""Message bytes that time a link when nothing says what a plan sends: 64 KiB, 1 MiB, 8 MiB."""
_LARGEST = 2**26
"""No timed message is larger (64 MiB): the fit carries the line further, and measuring stays short."""
_SMALLEST = 2**12


def message_sizes(profile: ModelProfile, global_batch: int, points: int = 3) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Sizes to time the links at, from what plans of ``profile`` send on ``global_batch`` samples:
    for point-to-point, the activations at a cut, from the smallest cut of one sample's micro-batch
    to the largest of the whole batch; for the all-reduce, the gradients, from the smallest layer's
    to the whole model's. ``points`` sizes each, spaced evenly on a log scale between 4 KiB and
    64 MiB; :data:`MESSAGE_SIZES` where the profile has no such sizes."""
    per_sample = [c / profile.profile_batch_size for c in profile.cut_bytes[1:-1] if c > 0]
    params = [layer.param_bytes for layer in profile.layers if layer.param_bytes > 0]
    p2p = _spread(min(per_sample), max(per_sample) * global_batch, points) if per_sample else MESSAGE_SIZES
    reduce = _spread(min(params), sum(params), points) if params else MESSAGE_SIZES
    return p2p, reduce


def shard_sizes(profile: ModelProfile, points: int = 3) -> tuple[int, ...]:
    """Parameter bytes to time a sharded layer at (:func:`measure_shard_costs`): from the profile's
    smallest layer that holds parameters to its largest, ``points`` sizes on a log scale."""
    params = [layer.param_bytes for layer in profile.layers if layer.param_bytes > 0]
    return _spread(min(params), max(params), points) if params else MESSAGE_SIZES


def _spread(low: float, high: float, points: int) -> tuple[int, ...]:
    low = min(max(low, _SMALLEST), _LARGEST)
    high = min(max(high, low), _LARGEST)
    if points < 2 or high <= low * 1.5:  # a fit needs two sizes apart
        low = max(_SMALLEST, min(low, high / 16))
    steps = max(points - 1, 1)
    return tuple(sorted({round(low * (high / low) ** (i / steps)) for i in range(steps + 1)}))


def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(latency, bytes per second)`` of the line ``seconds = latency + size / bandwidth`` through
    the timings, least squares. A negative intercept (noise on a fast link) is fitted through
    zero; a slope that is not positive (time that does not grow with size) gives the best rate
    seen and no latency."""
    latency, slope, _ = least_squares(sizes, seconds, "fit_link")
    if slope > 0 and latency < 0:
        latency, slope = 0.0, slope_through_zero(sizes, seconds)
    if slope <= 0:
        return 0.0, max(x / max(t, 1e-9) for x, t in zip(sizes, seconds))
    return latency, 1.0 / slope


def node_ranks(world: int, nodes: int) -> list[list[int]]:
    """The ranks of each node, node-major: ``node_ranks(4, 2) == [[0, 1], [2, 3]]``."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be an integer >= 1, got {nodes!r}")
    if world % nodes:
        raise ValueError(
            f"{world} ranks do not split evenly over {nodes} nodes; start as many processes on every node "
            "(Trainer(num_nodes=..., devices=...))"
        )
    per_node = world // nodes
    return [list(range(n * per_node, (n + 1) * per_node)) for n in range(nodes)]


def cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compute_units(device: torch.device) -> int | None:
    """How many of a node's ranks can compute at once: ``None`` on GPUs (each has its own), else
    the cores this process may use over its threads (CPU ranks on one machine share its cores)."""
    import torch

    if device.type == "cuda":
        return None
    return max(1, cores() // torch.get_num_threads())


def device_memory(device: torch.device, per_node: int) -> float:
    """Bytes a plan may use on ``device``.

    On a GPU: what is free now plus what this process's caching allocator already holds (the
    model being planned is in it, and the plan counts it), less :data:`MEMORY_MARGIN` of the total;
    not the total memory, of which other processes and the CUDA context hold part. On CPU: the
    machine's memory shared evenly by the node's ranks.
    """
    import torch

    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return max(float(free + torch.cuda.memory_reserved(device)) - MEMORY_MARGIN * total, 1.0)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / per_node


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    # The median, not the fastest: the spread is the link's own, not the machine's noise, and
    # training's gradient all-reduces take the median's time, well above the best one's
    # (docs/benchmarks.md, "Links at their median").
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class _Meter:
    """Times messages from this rank; rank 0's times are the ones every rank plans from.

    Each timed call ends with the device synchronised, so that a GPU's time is counted and not
    only the launch's.
    """

    def __init__(self, device: torch.device, repeats: int) -> None:
        import torch.distributed as dist

        self.device, self.repeats, self.rank = device, repeats, dist.get_rank()

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        import torch

        return torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=self.device)

    def ping(self, nbytes: int, peer: int) -> float:
        """One-way seconds of ``nbytes`` between rank 0 and ``peer`` (half a round trip)."""
        import torch.distributed as dist

        buf = self._buffer(nbytes)

        def once() -> None:
            if self.rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            elif self.rank == peer:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            self._sync()

        once()  # connects the pair
        return _timed(once, self.repeats) / 2

    def ring(self, nbytes: int, group: Any) -> float:
        """Seconds of an all-reduce of ``nbytes`` over ``group``."""
        import torch.distributed as dist

        buf = self._buffer(nbytes)

        def once() -> None:
            dist.all_reduce(buf, group=group)
            self._sync()

        once()
        return _timed(once, self.repeats)

    def link(self, sizes: Sequence[int], peer: int) -> tuple[float, float]:
        """``(latency, bytes/s)`` of point-to-point between rank 0 and ``peer``, fitted over ``sizes``."""
        return fit_link(sizes, [self.ping(n, peer) for n in sizes])

    def all_reduce(self, sizes: Sequence[int], group: Any, replicas: int) -> float:
        """Per-link bytes/s of a ring all-reduce over ``group`` (``replicas`` ranks), fitted over
        ``sizes``: each rank sends ``2 (r - 1) / r`` of the message, in ``2 (r - 1)`` steps."""
        sent = [2 * (replicas - 1) / replicas * n for n in sizes]
        return fit_link(sent, [self.ring(n, group) for n in sizes])[1]


def measure_shard_costs(
    device: torch.device, group: Any, replicas: int, sizes: Sequence[int], repeats: int = 9
) -> ShardCosts:
    """What FSDP2 adds to each kind of a sharded layer's pass (:class:`~._shard_costs.ShardCosts`) on
    ``group`` (``replicas`` ranks; collective over it): for each of ``sizes`` parameter bytes, a
    ``Linear`` sharded over the group as the runtime shards a stage's layer (its own FSDP2 unit, the
    gradients summed) against the same ``Linear`` unsharded, on one row, each pass the median of
    ``repeats``; the differences fitted as ``fixed + bytes x per_byte`` over the sizes."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    timed: dict[str, list[float]] = {name: [] for name in SHARD_PASSES}
    held: list[int] = []
    for nbytes in sizes:
        width = max(replicas, round(math.sqrt(nbytes / 4)))
        held.append((width * width + width) * 4)
        x = torch.randn(1, width, device=device)
        plain = nn.Linear(width, width, device=device)
        unit = fully_shard(nn.Linear(width, width, device=device), mesh=mesh, reshard_after_forward=True)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
        base = _passes(plain, x, device, repeats)
        passes = _passes(unit, x, device, repeats)
        for name in SHARD_PASSES:
            timed[name].append(passes[name] - base[name])
        del unit, plain
    fits = {name: fit_affine(held, timed[name]) for name in SHARD_PASSES}
    return ShardCosts(replicas, **fits)


def _passes(layer: Any, x: torch.Tensor, device: torch.device, repeats: int) -> dict[str, float]:
    """Median seconds of each kind of pass of ``layer`` (an FSDP2 unit, or a plain layer: then every
    pass is the plain one of its kind), in the order a step makes them (see ``_shard_costs``)."""
    import torch

    sharded = hasattr(layer, "set_requires_gradient_sync")
    times: dict[str, list[float]] = {name: [] for name in SHARD_PASSES}

    def clock(name: str | None, fn: Callable[[Any], Any], arg: Any) -> Any:
        start = time.perf_counter()
        out = fn(arg)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if name is not None:
            times[name].append(time.perf_counter() - start)
        return out

    def backward(out: torch.Tensor) -> None:
        out.sum().backward()

    def accumulate(whole: bool) -> None:  # ``grads`` until the step's last backward, else ``full``
        if sharded:
            layer.set_reshard_after_forward(not whole, recurse=False)
            layer.set_requires_gradient_sync(not whole, recurse=False)
            layer.set_reshard_after_backward(not whole, recurse=False)

    for i in range(repeats + 1):
        keep = i > 0  # the first round warms up
        layer.zero_grad(set_to_none=True)
        accumulate(False)  # shard: full
        out = clock("gather" if keep else None, layer, x)
        clock("gather_scatter" if keep else None, backward, out)
        layer.zero_grad(set_to_none=True)
        accumulate(True)  # shard: grads, a step of two micro-batches
        out = clock(None, layer, x)
        clock("kept_backward" if keep else None, backward, out)
        out = clock("kept_forward" if keep else None, layer, x)
        if sharded:  # the step's last backward sums into the shards and frees the gathered parameters
            layer.set_requires_gradient_sync(True, recurse=False)
            layer.set_reshard_after_backward(True, recurse=False)
        clock("scatter" if keep else None, backward, out)
    return {name: statistics.median(values) for name, values in times.items()}


def measure_cluster(
    device: torch.device,
    *,
    nodes: int = 1,
    repeats: int = 9,
    sizes: tuple[Sequence[int], Sequence[int]] = (MESSAGE_SIZES, MESSAGE_SIZES),
    shard_replicas: Sequence[int] = (),
    shard_at: Sequence[int] = MESSAGE_SIZES,
) -> Cluster:
    """The links, memory and compute units of the current process group, ``nodes`` nodes of
    ranks numbered node-major (collective on every rank; every rank returns rank 0's figures).

    Within a node: point-to-point between ranks 0 and 1, all-reduce over each node's own ranks
    (every node at once, as stages on different nodes reduce at once). Across nodes:
    point-to-point between rank 0 and the first rank of node 1, all-reduce over the world. A
    cluster of one rank per node has no link within a node, one node none across: the missing
    figures are the measured ones. The memory is the least any rank may use
    (:func:`device_memory`). ``sizes`` are the point-to-point and the all-reduce message bytes each
    link is timed at (:func:`message_sizes`), fitted as latency + size / bandwidth; the latency is
    the fit's for rank 0's nearest peer. For each of ``shard_replicas``, what FSDP2 adds to a sharded
    layer's passes on a group of that many ranks of node 0 (:func:`measure_shard_costs` at ``shard_at``
    parameter bytes, :func:`shard_sizes`), for the planner's price of sharding.
    """
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    members = node_ranks(world, nodes)
    per_node = len(members[0])
    bad = [r for r in shard_replicas if isinstance(r, bool) or not isinstance(r, int) or not 2 <= r <= per_node]
    if bad:
        raise ValueError(f"shard_replicas must be replica counts from 2 to the {per_node} ranks of a node, got {bad}")
    memory = device_memory(device, per_node)
    units = compute_units(device)
    if world == 1:
        return Cluster(1, 1, 1e12, 1e12, 1e12, 1e12, latency_s=0.0, memory_bytes=memory, compute_units=units)
    # new_group is collective over the world: every rank creates every node's group, in node order.
    groups = [dist.new_group(ranks) for ranks in members] if per_node > 1 and nodes > 1 else []
    try:
        figures = _measure_links(_Meter(device, repeats), nodes, per_node, groups, sizes)
    finally:
        for ranks, group in zip(members, groups):
            if dist.get_rank() in ranks:
                dist.destroy_process_group(group)
    numbers = torch.tensor([*figures, memory], dtype=torch.float64, device=device)
    least = numbers[-1:].clone()
    dist.all_reduce(least, op=dist.ReduceOp.MIN)  # the plan must fit the tightest rank
    dist.broadcast(numbers, 0)  # every rank plans from rank 0's figures
    latency, intra_p2p, inter_p2p, intra_ar, inter_ar, _ = numbers.tolist()
    shard_costs = tuple(_measure_shard_groups(device, members[0], shard_replicas, shard_at, repeats))
    return Cluster(
        nodes,
        per_node,
        intra_p2p_bw=intra_p2p,
        inter_p2p_bw=inter_p2p,
        intra_allreduce_bw=intra_ar,
        inter_allreduce_bw=inter_ar,
        latency_s=latency,
        memory_bytes=float(least.item()),
        compute_units=units,
        shard_costs=shard_costs,
    )


def _measure_shard_groups(
    device: torch.device, node: Sequence[int], replicas: Sequence[int], sizes: Sequence[int], repeats: int
) -> Iterator[ShardCosts]:
    """:func:`measure_shard_costs` on the first ``r`` ranks of ``node`` for each ``r`` of ``replicas``
    (collective on every rank; every rank gets rank 0's figures).

    A measurement that raises on a member raises on every rank, at once and saying so, rather than
    when the member's process ends or at the process group's timeout: the ranks agree on whether
    any failed before rank 0's figures are broadcast (members blocked inside the failed one's
    collectives still wait for the timeout)."""
    import torch
    import torch.distributed as dist

    for r in replicas:
        group = dist.new_group(list(node[:r]))
        numbers = torch.zeros(2 * len(SHARD_PASSES), dtype=torch.float64, device=device)
        error: Exception | None = None
        if dist.get_rank() in node[:r]:
            try:
                costs = measure_shard_costs(device, group, r, sizes, repeats)
                numbers = torch.tensor(costs.as_numbers(), dtype=torch.float64, device=device)
            except Exception as e:  # every rank raises below
                error = e
            finally:
                dist.destroy_process_group(group)
        failed = torch.tensor([float(error is not None)], device=device)
        dist.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError(
                f"timing sharded layers on {r} replicas failed on {int(failed.item())} of ranks {list(node[:r])}; "
                "their own errors say why"
            )
        dist.broadcast(numbers, 0)
        yield ShardCosts.from_numbers(r, numbers.tolist())


def _measure_links(
    meter: _Meter, nodes: int, per_node: int, groups: list[Any], sizes: tuple[Sequence[int], Sequence[int]]
) -> tuple[float, ...]:
    """``(latency, intra p2p, inter p2p, intra all-reduce, inter all-reduce)`` as rank 0 times them."""
    p2p_sizes, reduce_sizes = sizes
    # Point-to-point with rank 0's neighbour on its own node, and with the first rank of node 1.
    intra = meter.link(p2p_sizes, 1) if per_node > 1 else None
    inter = meter.link(p2p_sizes, per_node) if nodes > 1 else None
    own = groups[meter.rank // per_node] if groups else None  # one node: the world is the node
    intra_ar = meter.all_reduce(reduce_sizes, own, per_node) if per_node > 1 else None
    inter_ar = meter.all_reduce(reduce_sizes, None, nodes * per_node) if nodes > 1 else None
    # A cluster without one kind of link (one node, or one rank per node) takes the other's figures.
    intra, inter = intra or inter, inter or intra
    intra_ar, inter_ar = (inter_ar if intra_ar is None else intra_ar), (intra_ar if inter_ar is None else inter_ar)
    return intra[0], intra[1], inter[1], intra_ar, inter_ar  # type: ignore[index, return-value]
