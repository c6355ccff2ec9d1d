"""Sums a stage's gradients over its replicas while the step's last backward still runs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["GradientReducer"]


class GradientReducer:
    """Sums gradients over a group of replicas, starting while the step's last backward runs.

    Parameters are cut into buckets in reverse registration order (about the order in which
    backward finishes their gradients). A parameter of at least ``in_place_bytes`` is a bucket of
    its own, summed in place in its ``.grad``: no copy in and none out, where copies cost the
    most. Smaller ones are packed into flat buckets (the first small, so that communication
    starts early, then up to ``bucket_bytes``), each summed as one tensor whose views become the
    gradients. A collective has a price of its own, so small weights are packed rather than
    summed alone even though packing copies them; ``in_place_bytes`` is where the copy starts to
    cost more than the extra collective (see docs/benchmarks.md, "Runtime").
    Once :meth:`arm` is called, each parameter's post-accumulate hook marks it final;
    a bucket's asynchronous all-reduce starts when all its parameters are final and every
    earlier bucket has started, so every replica issues the same collectives in the same order,
    as DDP's reducer does.

    The last bucket is always flat. It carries one flag per parameter (after the sum: how many
    replicas had a gradient) and the caller's extra values (``arm(extra=...)``, e.g. the step's
    loss), which saves a collective per step. :meth:`finish` starts what
    backward did not reach (parameters without a gradient in the last micro-batch), waits, and
    writes the sums into ``.grad``; a parameter keeps ``grad=None`` only if no replica produced
    a gradient for it, as on one device.

    Nothing here waits for the device while backward runs: the flags are made on the device (a
    tensor built from a host list would be copied there inside the gradient hook, and on CUDA
    such a copy waits for the device), and :meth:`finish` reads the summed flags back only on a
    replica that lacked some gradient itself (every other replica knows each count is at least 1).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: dist.ProcessGroup | None,
        *,
        device: torch.device | None = None,
        bucket_bytes: int = 25 * 2**20,
        first_bucket_bytes: int = 2**20,
        in_place_bytes: int = 4 * 2**20,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.device = device if device is not None else (self.params[0].device if self.params else torch.device("cpu"))
        self.buckets: list[list[nn.Parameter]] = []
        self.in_place: list[bool] = []
        """Per bucket: whether it is one parameter, summed in its own ``.grad`` (else a flat bucket)."""
        packing: list[nn.Parameter] = []  # the flat bucket being filled; in-place buckets may pass it
        size, limit = 0, first_bucket_bytes
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if nbytes >= in_place_bytes:
                self.buckets.append([p])
                self.in_place.append(True)
                continue
            if packing and (size + nbytes > limit or packing[0].dtype != p.dtype):
                self.buckets.append(packing)
                self.in_place.append(False)
                packing, size, limit = [], 0, bucket_bytes
            packing.append(p)
            size += nbytes
        if packing or (self.buckets and self.in_place[-1]):  # the flags need a flat bucket last
            self.buckets.append(packing)
            self.in_place.append(False)
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._armed = False
        self._missing: list[int] = []
        self._launched: list[tuple[torch.Tensor, Any]] = []
        self._extra: Callable[[], torch.Tensor] | None = None
        self._extra_sum: torch.Tensor | None = None
        self._extra_work: Any = None  # their own collective, when the last bucket's dtype is too coarse
        self._extra_in_bucket = 0  # how many extra values end the last bucket
        self._lacking = False  # this replica had no gradient for some parameter when the flags were made

        def ready(param: torch.Tensor) -> None:  # a closure, not a bound method: deepcopy keeps it shared
            if self._armed:
                self._ready(param)

        self._handles = [p.register_post_accumulate_grad_hook(ready) for p in self.params]

    def arm(self, extra: Callable[[], torch.Tensor] | None = None) -> None:
        """The next backward is the step's last on this rank: start all-reduces as gradients land.

        ``extra``, called once when the last bucket starts (after this step's forwards), returns a
        1-D tensor of extra values to sum over the replicas along with the gradients (in float64);
        :meth:`finish` returns their sum.
        """
        self._missing = [len(bucket) for bucket in self.buckets]
        self._launched = []
        self._extra = extra
        self._extra_sum, self._extra_work, self._extra_in_bucket = None, None, 0
        self._armed = True

    def _ready(self, param: torch.Tensor) -> None:
        b = self._bucket_of.get(id(param))
        if b is None:
            return
        self._missing[b] -= 1
        while len(self._launched) < len(self.buckets) and self._missing[len(self._launched)] <= 0:
            self._launch(len(self._launched))

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if self.in_place[b]:
            (p,) = bucket
            # A replica without a gradient adds zeros; the flags in the last bucket tell None apart.
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if not grad.is_contiguous():
                grad = grad.contiguous()
            self._launched.append((grad, dist.all_reduce(grad, group=self.group, async_op=True)))
            return
        pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]
        dtype = bucket[0].dtype if bucket else torch.float64
        last = b == len(self.buckets) - 1
        if last:
            pieces.append(self._flags(dtype))
            if self._extra is not None and dtype in (torch.float32, torch.float64):
                values = self._take_extra()
                pieces.append(values.to(dtype))
                self._extra_in_bucket = values.numel()
            elif self._extra is not None:  # bf16 or fp16 is too coarse for a loss: a collective of its own
                self._sum_extra_apart()
        flat = torch.cat(pieces)
        self._launched.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        if last and self._extra_in_bucket:
            self._extra_sum = flat[flat.numel() - self._extra_in_bucket :]

    def _flags(self, dtype: torch.dtype) -> torch.Tensor:
        """1 per parameter with a gradient here, 0 per one without, made on the device."""
        flags = torch.ones(len(self.params), dtype=dtype, device=self.device)
        lacking = [i for i, p in enumerate(self.params) if p.grad is None]
        for i in lacking:
            flags[i] = 0
        self._lacking = bool(lacking)
        return flags

    def _take_extra(self) -> torch.Tensor:
        assert self._extra is not None
        extra, self._extra = self._extra, None
        return extra().to(device=self.device, dtype=torch.float64).reshape(-1)

    def _sum_extra_apart(self) -> None:
        self._extra_sum = self._take_extra()
        self._extra_work = dist.all_reduce(self._extra_sum, group=self.group, async_op=True)

    def finish(self) -> torch.Tensor | None:
        """Start the remaining buckets, wait for all, and write the sums into ``.grad``; returns
        the sum of what :meth:`arm`'s ``extra`` gave (float64), if anything."""
        if not self._armed:  # no backward this step (nothing to sum), as for a forward-only step
            self.arm()
        self._armed = False
        while len(self._launched) < len(self.buckets):
            self._launch(len(self._launched))
        if not self.buckets and self._extra is not None:  # no gradients to sum them with
            self._sum_extra_apart()
        for _, work in self._launched:
            work.wait()
        if self._extra_work is not None:
            self._extra_work.wait()
        if self.buckets:
            counts = self._counts()
            for bucket, in_place, (summed, _) in zip(self.buckets, self.in_place, self._launched, strict=True):
                offset = 0
                for p in bucket:
                    n = p.numel()
                    # The sum becomes the gradient in place: the parameter's own tensor or a view into the bucket.
                    grad = summed if in_place else summed[offset : offset + n].view_as(p)
                    p.grad = grad if counts[id(p)] else None
                    offset += n
        self._launched = []
        extra_sum = self._extra_sum
        self._extra_sum, self._extra_work, self._extra_in_bucket = None, None, 0
        return None if extra_sum is None else extra_sum.to(torch.float64)

    def _counts(self) -> dict[int, float]:
        """By parameter: how many replicas had a gradient (read from the device only where needed)."""
        if not self._lacking:
            return dict.fromkeys(map(id, self.params), 1.0)
        last, end = self._launched[-1][0], self._launched[-1][0].numel() - self._extra_in_bucket
        return dict(zip(map(id, self.params), last[end - len(self.params) : end].tolist(), strict=True))

    def abandon(self) -> None:
        """Forget outstanding all-reduces (the step failed; a peer may be gone)."""
        self._armed = False
        self._launched = []
        self._extra = None
        self._extra_sum, self._extra_work, self._extra_in_bucket = None, None, 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
