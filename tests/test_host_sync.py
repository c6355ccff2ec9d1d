"""No host synchronisation inside a pipelined training step: one read of the device per step.

On a GPU, reading a tensor on the host (``.item()``, ``.tolist()``, ``float(t)``, ``.cpu()``,
``.numpy()``, ``bool(t)``) waits for the device to finish everything queued so far. Here every
such call on a tensor is counted while real gloo processes run whole training steps through the
strategy's :class:`~dapple_lightning.strategy._step.PipelinedSteps` (the loss and what the step
logs) and the runtime's :class:`~dapple_lightning.runtime.Pipeline`. The only tensors exempt are
the integer ones the runtime's messages are made of, which live in host memory by design: the
point-to-point headers (``int64``) and :func:`~dapple_lightning.runtime.share`'s size and
pickled bytes (``int64``, ``uint8``); on NCCL they travel on gloo groups of their own.
"""

from __future__ import annotations

import traceback
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import P2PGroups, Pipeline, p2p_groups, stage_group
from dapple_lightning.strategy._step import PipelinedSteps
from dapple_lightning.surgery import partition

from distributed import run_ranks

BATCH, STEPS = 16, 3
READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")
HOST_METADATA = (torch.int64, torch.uint8)


class Regression(nn.Module):
    """A LightningModule's step contract, without Lightning: a Sequential, a step that logs, ``log``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        self.logged: list[tuple[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        loss = nn.functional.mse_loss(out, y)
        self.log("train_loss", loss)
        self.log("rows", float(len(x)), reduce_fx="sum")
        self.log("worst", (out - y).abs().max(), reduce_fx="max")
        return loss

    def log(self, name: str, value: torch.Tensor, **kwargs) -> None:
        self.logged.append((name, value))  # made on the host from the step's one read


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)) for _ in range(STEPS)]


class _Reads:
    """Counts host reads of tensors (those of :data:`HOST_METADATA` dtypes aside) while active."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._originals = {name: getattr(torch.Tensor, name) for name in READS}

    def __enter__(self) -> _Reads:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)

    def _wrap(self, name, original):
        def counted(tensor, *args, **kwargs):
            if tensor.dtype not in HOST_METADATA:
                where = traceback.extract_stack(limit=2)[0]
                self.seen.append(f"{name} {tensor.dtype} {tuple(tensor.shape)} at {where.filename}:{where.lineno}")
            return original(tensor, *args, **kwargs)

        return counted


def train(rank: int, world_size: int, plan: Plan, host_groups: bool) -> tuple[list[list[str]], list[float]]:
    model = Regression()
    model.layers = partition(model.layers, plan, rank)
    groups = p2p_groups()
    if host_groups:  # as p2p_groups makes them for NCCL: headers and shared values on groups of their own
        groups = P2PGroups(groups.activations, groups.gradients, dist.new_group(), dist.new_group(), dist.new_group())
    pipeline = Pipeline(
        plan, rank, model.layers, device=torch.device("cpu"), stage_group=stage_group(plan, rank), p2p_groups=groups
    )
    steps = PipelinedSteps(model, torch.device("cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reads, losses = [], []
    for batch in batches():
        with _Reads() as counted:
            loss = steps.train(pipeline, (batch, 0), {}, nullcontext)
        reads.append(counted.seen)
        losses.append(loss.item())
        steps.add_fresh_gradients(1.0)
        optimizer.step()
        optimizer.zero_grad()
    steps.shared.wait()
    return reads, losses


def one_device() -> list[float]:
    model = Regression()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


PLANS = {
    "2 stages": [((0, 3), 1), ((3, 5), 1)],
    "2 stages, last on 2 replicas": [((0, 3), 1), ((3, 5), 2)],
}


@pytest.mark.parametrize("host_groups", [False, True], ids=["gloo-groups", "host-groups-as-on-nccl"])
@pytest.mark.parametrize("shape", sorted(PLANS))
def test_a_pipelined_step_reads_the_device_once(shape: str, host_groups: bool) -> None:
    plan = Plan(stages=[{"layers": list(layers), "replicas": r} for layers, r in PLANS[shape]], micro_batches=4)
    results = run_ranks(train, plan.world_size, plan, host_groups)
    last = set(plan.stage_ranks(plan.num_stages - 1))
    for rank, (reads, losses) in enumerate(results):
        for step, seen in enumerate(reads):
            # The last stage reads its loss and logged values once, as one vector; the others none.
            assert len(seen) == (1 if rank in last else 0), f"rank {rank}, step {step}: {seen}"
        assert losses == pytest.approx(one_device(), rel=1e-5)
