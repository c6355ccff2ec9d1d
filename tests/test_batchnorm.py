"""Batch norm under a plan: replicas keep equal buffers; with sync_batchnorm they normalise together."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch import nn

from dapple_lightning import Plan

import models
from distributed import run_ranks
from harness import assert_same, fit


class BatchNormMLP(models.MLP):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(models.IN, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, models.OUT),
        )


def plan(micro_batches: int) -> Plan:
    # Stage 0 (with the first batch norm) on two replicas, stage 1 (with the second) on one.
    return Plan(
        stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=micro_batches
    )


class ReplicasAgree(Callback):
    """Fails the run if two replicas of a stage hold different buffers after any step."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, buffers)
        strategy = trainer.strategy
        mine = strategy.plan.stage_of(trainer.global_rank)
        for rank in strategy.plan.stage_ranks(mine):
            assert everyone[rank].keys() == buffers.keys()
            for name, value in buffers.items():
                assert torch.equal(everyone[rank][name], value), (
                    f"step {trainer.global_step}: {name} differs on rank {rank}"
                )


def test_replicas_hold_equal_buffers_after_every_step(tmp_path):
    fit(BatchNormMLP, tmp_path, plan=plan(3), callbacks=(ReplicasAgree(),))


def test_sync_batchnorm_with_one_micro_batch_matches_one_device(tmp_path):
    got = fit(BatchNormMLP, tmp_path / "dapple", plan=plan(1), val=True, sync_batchnorm=True)
    assert_same(got, fit(BatchNormMLP, tmp_path / "single", val=True))


def _normalised_on_two_ranks(
    rank: int, world_size: int, wide: bool, dtype: torch.dtype, device: str = "cpu"
) -> dict[str, float]:
    """Worst differences of ``_SyncNorm`` (each rank holding half the rows) from torch's batch norm of
    the whole batch on one process: the output, the input's gradient and the summed weight gradients."""
    from dapple_lightning.runtime._batchnorm import _SyncNorm

    g = torch.Generator().manual_seed(0)
    whole = (torch.randn(12, 4, 5, generator=g) * 3 + 10).to(device, dtype)  # an offset: the variance's cancellation
    seed = torch.randn(12, 4, 5, generator=g).to(device, dtype)
    weight, bias = torch.randn(4, generator=g).to(device), torch.randn(4, generator=g).to(device)

    def run(x, w, b, sync):
        x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
        if sync:
            out, _, _ = _SyncNorm.apply(x, w.to(dtype), b.to(dtype), 1e-5, None, wide)
        else:
            out = nn.functional.batch_norm(x.float(), None, None, w, b, training=True, eps=1e-5).to(dtype)
        return out, *torch.autograd.grad(out, (x, w, b), seed[rows] if sync else seed)

    rows = slice(6 * rank, 6 * rank + 6)
    out, x_grad, w_grad, b_grad = (t.detach() for t in run(whole[rows], weight, bias, sync=True))
    want_out, want_x, want_w, want_b = (t.detach() for t in run(whole, weight, bias, sync=False))
    sums = torch.cat([w_grad, b_grad]).float()
    dist.all_reduce(sums)
    return {
        "output": float((out.float() - want_out[rows].float()).abs().max()),
        "input gradient": float((x_grad.float() - want_x[rows].float()).abs().max()),
        "weight gradients": float((sums - torch.cat([want_w, want_b]).float()).abs().max()),
    }


@pytest.mark.parametrize(
    ("wide", "dtype", "limit"),
    [(True, torch.float32, 1e-5), (False, torch.float32, 1e-5), (False, torch.bfloat16, 0.1)],
    ids=["float64-sums", "float32-stats", "float32-stats-bf16"],
)
def test_both_sync_norms_match_one_process_batch_norm(wide, dtype, limit):
    for worst in run_ranks(_normalised_on_two_ranks, 2, wide, dtype):
        assert max(worst.values()) <= limit, worst


def _widened_on(rank: int, world_size: int, device: str) -> list[int]:
    """The sizes of the tensors a synchronised batch norm's step makes float64 on ``device``."""
    from dapple_lightning.runtime import synchronize_batch_norms

    norm = nn.BatchNorm1d(4).to(device)
    synchronize_batch_norms(norm, None)
    seen: list[int] = []
    original = torch.Tensor.double
    torch.Tensor.double = lambda t: seen.append(t.numel()) or original(t)
    try:
        norm(torch.randn(8, 4, 5, device=device, requires_grad=True)).sum().backward()
    finally:
        torch.Tensor.double = original
    return seen


def test_sync_batch_norm_widens_the_activations_on_the_cpu_only():
    assert all(max(sizes) == 8 * 4 * 5 for sizes in run_ranks(_widened_on, 2, "cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sync_batch_norm_on_cuda_takes_float32_statistics_and_matches_one_process():
    # per-channel numbers only (the backward's sums, 2 x 4), no activation in float64
    assert all(max(sizes, default=0) <= 8 for sizes in run_ranks(_widened_on, 2, "cuda"))
    for worst in run_ranks(_normalised_on_two_ranks, 2, False, torch.float32, "cuda"):
        assert max(worst.values()) <= 1e-5, worst
