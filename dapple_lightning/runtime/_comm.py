"""Point-to-point transport of activations and gradients, with receives posted ahead.

What crosses a stage boundary is a tensor or a tuple of tensors whose shapes and dtypes may
change from batch to batch (a short last batch, a variable sequence length). A receiver that
learns a message's shapes only from the message cannot post its receive before the message
arrives, and gloo moves data only once the receive is posted: a late receive then waits for a
peer that is busy computing. So both ends of each directed pair remember the *signature*
(shapes, dtypes, tuple or not) of the last message exchanged for each row count, and the
receiver posts, ahead of need, a fixed-size header plus payload buffers of that remembered
signature.

Each message is therefore:

1. a fixed-size ``int64`` header: a status, then the signature;
2. if the receiver had a remembered signature and the message differs from it, placeholder
   payloads of the *remembered* signature (they fill the buffers the receiver posted and are
   discarded);
3. the payload, one message per tensor, unless it already went as 2's buffers (status
   :data:`AS_EXPECTED`).

Both ends update the remembered signature from the same messages, so the sender always knows
what the receiver posted. Messages on a pair are matched in posting order (gloo per tag, NCCL
per pair), so a receiver posts one message per peer ahead at most: the next is posted only
after the current one has been fully received.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dapple_lightning.plan import Plan

__all__ = ["MAX_DIMS", "MAX_TENSORS", "Incoming", "Link", "Pending", "Signature", "p2p_groups", "share", "stage_group"]

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
AS_EXPECTED, NEW_SIGNATURE = 0, 1
# [status, is_tuple, count, (dtype, ndim, dim_0 .. dim_{MAX_DIMS-1}) * MAX_TENSORS]
_HEADER = 3 + MAX_TENSORS * (2 + MAX_DIMS)


@dataclass(frozen=True)
class Signature:
    """Shapes and dtypes of a message's tensors, and whether they form a tuple."""

    tensors: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    as_tuple: bool

    @classmethod
    def of(cls, tensors: list[torch.Tensor], as_tuple: bool) -> Signature:
        return cls(tuple((tuple(t.shape), t.dtype) for t in tensors), as_tuple)

    def empty(self, device: torch.device) -> list[torch.Tensor]:
        return [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in self.tensors]

    def encode(self, status: int) -> torch.Tensor:
        if len(self.tensors) > MAX_TENSORS:
            raise ValueError(f"an activation tuple may hold at most {MAX_TENSORS} tensors, got {len(self.tensors)}")
        head = [0] * _HEADER
        head[0], head[1], head[2] = status, int(self.as_tuple), len(self.tensors)
        for i, (shape, dtype) in enumerate(self.tensors):
            if dtype not in _CODE:
                raise TypeError(f"cannot send activations of dtype {dtype} between stages")
            if len(shape) > MAX_DIMS:
                raise ValueError(f"activations may have at most {MAX_DIMS} dims, got shape {shape}")
            base = 3 + i * (2 + MAX_DIMS)
            head[base], head[base + 1] = _CODE[dtype], len(shape)
            head[base + 2 : base + 2 + len(shape)] = shape
        return torch.tensor(head, dtype=torch.int64)

    @classmethod
    def decode(cls, head: list[int]) -> tuple[int, Signature]:
        tensors = []
        for i in range(head[2]):
            base = 3 + i * (2 + MAX_DIMS)
            ndim = head[base + 1]
            tensors.append((tuple(head[base + 2 : base + 2 + ndim]), _DTYPES[head[base]]))
        return head[0], cls(tuple(tensors), bool(head[1]))


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


@dataclass
class Incoming:
    """A posted receive of one message; :meth:`wait` returns its tensors and tuple flag."""

    link: Link
    src: int
    rows: int
    head: torch.Tensor
    expected: Signature | None
    buffers: list[torch.Tensor]
    works: list

    def wait(self) -> tuple[list[torch.Tensor], bool]:
        for work in self.works:
            work.wait()
        self.works = []
        status, signature = Signature.decode(self.head.cpu().tolist())
        if status == AS_EXPECTED:
            assert self.expected is not None, "the sender claimed a signature this receiver never saw"
            tensors = self.buffers
        else:  # what was posted held placeholders; the payload follows
            tensors = signature.empty(self.link.device)
            for t in tensors:
                dist.recv(t, self.src, group=self.link.group)
        self.link.received[(self.src, self.rows)] = signature
        return tensors, signature.as_tuple


class Link:
    """This rank's ends of its point-to-point pairs, with the signatures remembered per pair.

    Messages are keyed by peer and row count (dim 0 of every tensor): a micro-batch of the
    usual size and a short last one are remembered apart.

    Args:
        device: where received tensors are allocated.
        group: process group the ranks belong to (global ranks are used either way).
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None) -> None:
        self.device = device
        self.group = group
        self.sent: dict[tuple[int, int], Signature] = {}
        self.received: dict[tuple[int, int], Signature] = {}

    def send(self, tensors: list[torch.Tensor], dst: int, rows: int, pending: Pending, *, as_tuple: bool) -> None:
        """Send ``tensors`` (``rows`` rows each) to global rank ``dst`` without waiting.

        ``pending`` keeps the tensors alive until the sends are waited for.
        """
        payload = [t.detach().contiguous() for t in tensors]
        device = payload[0].device if payload else self.device
        signature = Signature.of(payload, as_tuple)
        key = (dst, rows)
        expected = self.sent.get(key)
        status = AS_EXPECTED if signature == expected else NEW_SIGNATURE
        outgoing = [signature.encode(status).to(device)]
        if status == NEW_SIGNATURE and expected is not None:
            outgoing += expected.empty(device)  # fill the buffers the receiver posted
        outgoing += payload
        for t in outgoing:
            pending.tensors.append(t)
            pending.works.append(dist.isend(t, dst, group=self.group))
        self.sent[key] = signature

    def post(self, src: int, rows: int) -> Incoming:
        """Post the receive of the next message from global rank ``src``, expected to have ``rows`` rows."""
        head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        expected = self.received.get((src, rows))
        buffers = expected.empty(self.device) if expected is not None else []
        works = [dist.irecv(t, src, group=self.group) for t in (head, *buffers)]
        return Incoming(self, src, rows, head, expected, buffers, works)

    def recv(self, src: int, rows: int) -> tuple[list[torch.Tensor], bool]:
        """Receive the next message from ``src`` now (post and wait)."""
        return self.post(src, rows).wait()


def share(value: Any, src: int, device: torch.device, pending: Pending) -> Any:
    """``value`` of rank ``src`` on every rank of the default group (collective).

    Unlike ``broadcast_object_list``, ``src`` does not wait: its broadcasts go into ``pending``
    (wait on it before the tensors may be reused, e.g. at the next call). A pipeline's last
    stage shares its loss this way and goes on to its optimizer step while the first stages
    still drain their last backwards.
    """
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        for tensor in (size, payload):
            pending.works.append(dist.broadcast(tensor, src, async_op=True))
            pending.tensors.append(tensor)
        return value
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src)
    return pickle.loads(payload.cpu().numpy().tobytes())


def p2p_groups(**kwargs: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Two process groups over all ranks: one for activations, one for gradients (collective).

    Gloo keeps one connection per pair of ranks and group. With both directions of a pipeline
    on one connection, a posted receive waits behind the other direction's traffic (measured in
    docs/benchmarks.md, "Runtime"). Activations flow only downstream and gradients only
    upstream, so one group per kind gives each direction its own connection.
    """
    return dist.new_group(**kwargs), dist.new_group(**kwargs)


def stage_group(plan: Plan, rank: int, **kwargs: Any) -> dist.ProcessGroup | None:
    """The process group of ``rank``'s stage replicas (``None`` for a stage on one rank).

    Every rank must call this with the same plan: creating a group is collective.
    """
    mine = None
    for index in range(plan.num_stages):
        ranks = list(plan.stage_ranks(index))
        if len(ranks) > 1:
            group = dist.new_group(ranks, **kwargs)
            if rank in ranks:
                mine = group
    return mine
