"""Batch normalisation across a stage's replicas, and buffers that stay equal on them.

Each replica of a stage sees its own rows of every micro-batch. Plain batch norm normalises
each replica's rows by their own statistics; :func:`synchronize_batch_norms` makes the
replicas normalise together, with the statistics of the micro-batch's rows on all of them
(what ``Trainer(sync_batchnorm=True)`` asks for). With one micro-batch that is the global
batch, so the numbers are one device's. ``torch.nn.SyncBatchNorm`` does this on GPUs only;
this one runs on any device and backend, summing per-channel statistics over the stage's group.

On CUDA it works as torch's SyncBatchNorm kernels do: each replica's per-channel mean and
variance in float32 (``torch.var_mean``; a float32 copy of a 16-bit input), combined over the
group in float64 (per channel: a few numbers), the rows normalised in float32 and the backward's
sums likewise, so no activation-sized tensor is wider than float32. Elsewhere (the CPU, where the
tests compare with one device) the rows' sums are taken in float64.

:func:`agree_buffers` gives every replica the stage's first replica's buffers (running
statistics), as DDP broadcasts rank 0's: a checkpoint holds the first replica's.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from dapple_lightning.runtime._comm import broadcast

__all__ = ["agree_buffers", "synchronize_batch_norms"]


def synchronize_batch_norms(module: nn.Module, group: dist.ProcessGroup) -> Callable[[], None]:
    """Make every batch norm in ``module`` normalise over ``group`` while training; returns the undo."""
    norms = [m for m in module.modules() if isinstance(m, _BatchNorm)]
    for norm in norms:
        norm.forward = types.MethodType(_synchronized_forward(group), norm)  # type: ignore[method-assign]

    def undo() -> None:
        for norm in norms:
            del norm.forward

    return undo


def _synchronized_forward(group: dist.ProcessGroup) -> Callable[[_BatchNorm, Tensor], Tensor]:
    def forward(self: _BatchNorm, input: Tensor) -> Tensor:
        self._check_input_dim(input)
        if not self.training:
            return type(self).forward(self, input)
        weight = self.weight if self.weight is not None else input.new_ones(input.shape[1])
        bias = self.bias if self.bias is not None else input.new_zeros(input.shape[1])
        output, mean, var = _SyncNorm.apply(input, weight, bias, self.eps, group, input.device.type != "cuda")
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            with torch.no_grad():
                # A cumulative average weighs by 1 / batches seen, kept on the device (no host read).
                factor: Any = self.momentum
                if factor is None:
                    factor = self.num_batches_tracked.to(self.running_mean.dtype).reciprocal()
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(var.to(self.running_var.dtype), factor)
        return output

    return forward


class _SyncNorm(torch.autograd.Function):
    """Normalise ``x`` (N, C, ...) by per-channel statistics over every replica's rows; ``wide``:
    the rows' sums in float64, else float32 statistics combined in float64 (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, eps: float, group: Any, wide: bool) -> Any:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        channels = x.shape[1]
        rows = x.numel() / channels
        work = x.double() if wide else _at_least_float32(x)
        if wide:
            sums = torch.cat([work.sum(dims), work.square().sum(dims), work.new_full((1,), rows)])
        else:
            var, mean = torch.var_mean(work, dims, correction=0)
            mean, var = mean.double(), var.double()
            sums = torch.cat([rows * mean, rows * (var + mean.square()), mean.new_full((1,), rows)])
        dist.all_reduce(sums, group=group)
        count = sums[-1]
        mean = sums[:channels] / count
        var = (sums[channels : 2 * channels] / count - mean.square()).clamp_min(0)
        invstd = (var + eps).rsqrt()
        xhat = ((work - mean.to(work.dtype).view(shape)) * invstd.to(work.dtype).view(shape)).to(x.dtype)
        ctx.save_for_backward(xhat, invstd.to(x.dtype), weight)
        ctx.count, ctx.group, ctx.dims, ctx.shape, ctx.wide = count, group, dims, shape, wide
        unbiased = var * count / (count - 1).clamp_min(1)
        return xhat * weight.view(shape) + bias.view(shape), mean, unbiased

    @staticmethod
    def backward(ctx: Any, grad: Tensor, _mean: Any, _var: Any) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        grad_bias = grad.sum(dims)
        grad_weight = (grad * xhat).sum(dims)
        # The input's gradient goes through the shared statistics: it needs the sums over all rows.
        total = torch.cat([grad_bias, grad_weight]).double()
        dist.all_reduce(total, group=ctx.group)
        sum_grad, sum_grad_xhat = total.chunk(2)
        if ctx.wide:
            scale = (weight.double() * invstd.double() / ctx.count).view(shape)
            grad_input = scale * (
                ctx.count * grad.double() - sum_grad.view(shape) - xhat.double() * sum_grad_xhat.view(shape)
            )
        else:
            work = _at_least_float32(grad)
            mean_grad = (sum_grad / ctx.count).to(work.dtype).view(shape)
            mean_grad_xhat = (sum_grad_xhat / ctx.count).to(work.dtype).view(shape)
            scale = (weight.double() * invstd.double()).to(work.dtype).view(shape)
            grad_input = (work - mean_grad - _at_least_float32(xhat) * mean_grad_xhat) * scale
        return grad_input.to(grad.dtype), grad_weight, grad_bias, None, None, None


def _at_least_float32(t: Tensor) -> Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def agree_buffers(buffers: list[Tensor], src: int, group: dist.ProcessGroup | None) -> None:
    """Give every rank of ``group`` rank ``src``'s ``buffers`` (one broadcast per dtype)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for same in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in same])
        broadcast(flat, src, group)
        offset = 0
        with torch.no_grad():
            for buffer in same:
                buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                offset += buffer.numel()
