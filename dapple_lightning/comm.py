"""Point-to-point transport of activations and gradients.

What crosses a stage boundary is a tensor or a tuple of tensors whose shapes and dtypes may
change from batch to batch (a short last batch, a variable sequence length). Each message is
therefore a fixed-size ``int64`` header describing the tensors, then one payload per tensor.
Sends are asynchronous: the caller keeps the returned :class:`Pending` until the step ends,
so the tensors stay alive while the backend transmits them and compute goes on meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["MAX_DIMS", "MAX_TENSORS", "Pending", "recv", "send"]

MAX_TENSORS = 16
MAX_DIMS = 8
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_TUPLE, _TENSOR = 1, 0
# [kind, count, (dtype, ndim, dim_0 .. dim_{MAX_DIMS-1}) * MAX_TENSORS]
_HEADER = 2 + MAX_TENSORS * (2 + MAX_DIMS)


@dataclass
class Pending:
    """Outstanding asynchronous sends and the tensors they read from."""

    works: list = field(default_factory=list)
    tensors: list = field(default_factory=list)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works.clear()
        self.tensors.clear()

    def abandon(self) -> None:
        """Forget the sends without waiting (the step failed; a peer may be gone)."""
        self.works.clear()
        self.tensors.clear()


def _header(tensors: list[torch.Tensor], as_tuple: bool) -> torch.Tensor:
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"an activation tuple may hold at most {MAX_TENSORS} tensors, got {len(tensors)}")
    head = torch.zeros(_HEADER, dtype=torch.int64)
    head[0], head[1] = (_TUPLE if as_tuple else _TENSOR), len(tensors)
    for i, t in enumerate(tensors):
        if t.dtype not in _CODE:
            raise TypeError(f"cannot send activations of dtype {t.dtype} between stages")
        if t.dim() > MAX_DIMS:
            raise ValueError(f"activations may have at most {MAX_DIMS} dims, got shape {tuple(t.shape)}")
        base = 2 + i * (2 + MAX_DIMS)
        head[base], head[base + 1] = _CODE[t.dtype], t.dim()
        head[base + 2 : base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return head


def send(
    tensors: list[torch.Tensor],
    dst: int,
    pending: Pending,
    *,
    as_tuple: bool,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send ``tensors`` (header first) to global rank ``dst`` without waiting."""
    payload = [t.detach().contiguous() for t in tensors]
    head = _header(payload, as_tuple)
    device = payload[0].device if payload else torch.device("cpu")
    if device.type != "cpu":
        head = head.to(device)
    pending.tensors.append(head)
    pending.works.append(dist.isend(head, dst, group=group))
    for t in payload:
        pending.tensors.append(t)
        pending.works.append(dist.isend(t, dst, group=group))


def recv(src: int, device: torch.device, *, group: dist.ProcessGroup | None = None) -> tuple[list[torch.Tensor], bool]:
    """Receive one message from global rank ``src``; returns the tensors and whether they form a tuple."""
    head = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.recv(head, src, group=group)
    head = head.cpu().tolist()
    kind, count = head[0], head[1]
    out = []
    for i in range(count):
        base = 2 + i * (2 + MAX_DIMS)
        dtype, ndim = _DTYPES[head[base]], head[base + 1]
        buf = torch.empty(head[base + 2 : base + 2 + ndim], dtype=dtype, device=device)
        dist.recv(buf, src, group=group)
        out.append(buf)
    return out, kind == _TUPLE
