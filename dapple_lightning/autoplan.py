"""``plan="auto"``: profile the user's layers, measure the process group, let the planner choose.

Runs inside the strategy's ``setup`` on every rank, before the model is partitioned:

1. draw one global batch from the training DataLoader (the RNG states that decide the data
   order are saved and restored, so training still sees the batches it would have seen);
2. run the user's ``training_step`` until it reaches the Sequential, to learn the
   Sequential's input;
3. time every layer's forward and backward on this rank's device (the ranks' times are
   averaged, so every rank plans from the same numbers);
4. time point-to-point and all-reduce messages on the real process group;
5. run the DAPPLE planner on rank 0 and broadcast its choice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.planner import GB, Cluster, ModelProfile, PlannedPlan, estimate, plan_dapple
from dapple_lightning.planner._measure import profile_layers
from dapple_lightning.runtime import StageExit

__all__ = ["AutoPlan", "capture_sequential_input", "choose_plan", "draw_batch", "measure_cluster"]


@dataclass(frozen=True)
class AutoPlan:
    """What ``plan="auto"`` decided and why."""

    plan: Plan
    predicted_step_s: float
    data_parallel_step_s: float | None
    profile: ModelProfile
    cluster: Cluster
    profiling_s: float

    def report(self) -> str:
        lines = [
            f"dapple plan='auto': profiled {self.profile.num_layers} layers and the process group in "
            f"{self.profiling_s:.1f} s",
            f"cluster: {self.cluster.nodes} node(s) x {self.cluster.devices_per_node} device(s), point-to-point "
            f"{self.cluster.intra_p2p_bw / GB:.2f} GB/s, all-reduce {self.cluster.intra_allreduce_bw / GB:.2f} GB/s "
            "per link",
            self.plan.table(),
        ]
        if self.data_parallel_step_s is None:
            lines.append(f"predicted {self.predicted_step_s * 1e3:.1f} ms/step; pure data parallelism does not fit")
        elif self.plan.num_stages == 1:
            lines.append(
                f"predicted {self.predicted_step_s * 1e3:.1f} ms/step: no pipeline beats pure data parallelism here"
            )
        else:
            lines.append(
                f"predicted {self.predicted_step_s * 1e3:.1f} ms/step vs {self.data_parallel_step_s * 1e3:.1f} ms for "
                f"pure data parallelism ({self.data_parallel_step_s / self.predicted_step_s:.2f}x)"
            )
        return "\n".join(lines)


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


def draw_batch(dataloader: Any) -> Any:
    """The first batch of ``dataloader``, leaving the order of later iterations as it was."""
    with _preserved_rng(dataloader):
        iterator = iter(dataloader)
        try:
            return next(iterator)
        finally:
            del iterator


class _Capture(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.value: Any = None

    def forward(self, x: Any) -> Any:
        self.value = x
        raise StageExit


def capture_sequential_input(
    module: nn.Module, set_sequential: Callable[[nn.Module], None], sequential: nn.Module, step: Callable[[], Any]
) -> Any:
    """Run ``step`` (the user's training_step on a batch) until it calls the Sequential; return its input."""
    capture = _Capture()
    set_sequential(capture)
    module.log = lambda *args, **kwargs: None  # the step may log before it reaches the layers
    try:
        with torch.no_grad(), suppress(StageExit):
            step()
    finally:
        del module.log
        set_sequential(sequential)
    if capture.value is None:
        raise RuntimeError(
            "plan='auto' ran training_step once to find the Sequential's input, but the step never called it; "
            "dapple needs each step to pass the batch through the Sequential exactly once"
        )
    return capture.value


def _timed(fn: Callable[[], Any], repeats: int) -> float:
    # The fastest of several runs: on a busy machine a median still carries the noise of other
    # processes, and the planner wants what the link can do.
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _bandwidth(nbytes: int, seconds: float, latency: float) -> float:
    """Bytes per second from one timed transfer; the latency is left out only while it is the smaller part."""
    payload = seconds - latency if seconds > 2 * latency else seconds
    return nbytes / max(payload, 1e-9)


def measure_cluster(device: torch.device, *, nodes: int = 1, repeats: int = 5) -> Cluster:
    """Point-to-point and all-reduce speed of the current process group (collective on every rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = max(world // nodes, 1)
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) / per_node
    if world == 1:
        return Cluster(1, 1, 1e12, 1e12, 1e12, 1e12, latency_s=0.0, memory_bytes=memory)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def ping(nbytes: int, peer: int) -> float:
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)

        def once() -> None:
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            elif rank == peer:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            sync()

        once()  # connect
        return _timed(once, repeats) / 2

    def allreduce(nbytes: int) -> float:
        buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)

        def once() -> None:
            dist.all_reduce(buf)
            sync()

        once()
        return _timed(once, repeats)

    big = 8 * 2**20
    latency = ping(8, 1)
    p2p = _bandwidth(big, ping(big, 1), latency)
    ring = allreduce(big)
    allreduce_bw = _bandwidth(int(2 * (world - 1) / world * big), ring, 2 * (world - 1) * latency)
    inter_p2p, inter_ar = p2p, allreduce_bw
    if nodes > 1:  # the world ring crosses servers; a pair on one server shows the fast links
        inter_p2p = _bandwidth(big, ping(big, per_node), latency)
    numbers = torch.tensor([latency, p2p, allreduce_bw, inter_p2p, inter_ar], dtype=torch.float64)
    dist.broadcast(numbers, 0)  # every rank plans from rank 0's figures
    latency, p2p, allreduce_bw, inter_p2p, inter_ar = numbers.tolist()
    return Cluster(
        nodes,
        per_node,
        intra_p2p_bw=p2p,
        inter_p2p_bw=inter_p2p,
        intra_allreduce_bw=allreduce_bw,
        inter_allreduce_bw=inter_ar,
        latency_s=latency,
        memory_bytes=memory,
    )


def _averaged(profile: ModelProfile) -> ModelProfile:
    """The ranks' mean forward and backward times, so that every rank plans from the same numbers."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return profile
    times = torch.tensor(
        [[layer.forward_s, layer.backward_s] for layer in profile.layers], dtype=torch.float64
    ).reshape(-1)
    dist.all_reduce(times)
    times = (times / dist.get_world_size()).reshape(-1, 2).tolist()
    data = profile.to_dict()
    for layer, (fwd, bwd) in zip(data["layers"], times):
        layer["forward_s"], layer["backward_s"] = fwd, bwd
    return ModelProfile.from_dict(data)


def choose_plan(
    sequential: nn.Sequential,
    sample_input: Any,
    device: torch.device,
    *,
    nodes: int = 1,
    global_batch: int,
    optimizer_factor: float = 2.0,
) -> AutoPlan:
    """Profile, measure and plan (collective on every rank); the plan is rank 0's choice."""
    start = time.perf_counter()
    profile = _averaged(profile_layers(list(sequential), sample_input, repeats=3, warmup=1))
    cluster = measure_cluster(device, nodes=nodes)
    world = dist.get_world_size() if dist.is_initialized() else 1
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        best: PlannedPlan = plan_dapple(profile, cluster, global_batch, optimizer_factor=optimizer_factor)[0]
        dp = estimate(Plan.data_parallel(len(sequential), world), profile, cluster, global_batch)
        box = [(best.plan.to_dict(), best.predicted_step_s, None if dp is None else dp.step_s)]
    if dist.is_initialized() and world > 1:
        dist.broadcast_object_list(box, 0)
    plan_dict, predicted, dp_step = box[0]
    return AutoPlan(Plan.coerce(plan_dict), predicted, dp_step, profile, cluster, time.perf_counter() - start)
