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

The header is host metadata: the sender builds it from shapes it knows on the host, the receiver
reads it on the host to learn what to allocate. With gloo the payload lives in host memory too,
and header and payload share a group. With NCCL a header on the device would cost the host a
wait for the device at every message (a copy there on the sending side, a read back on the
receiving one), so headers stay in host memory and travel on gloo groups of their own
(:class:`P2PGroups`); the payload alone goes through NCCL, and the host runs ahead of the device.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dapple_lightning.plan import Plan

__all__ = [
    "MAX_DIMS",
    "MAX_TENSORS",
    "Incoming",
    "Link",
    "P2PGroups",
    "Pending",
    "Signature",
    "broadcast",
    "concat_pieces",
    "connect_pairs",
    "p2p_groups",
    "share",
    "stage_group",
]

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
# NCCL knows no 16-bit integers, and its send and receive no complex numbers (gloo knows both):
# such tensors travel as their bytes, through a uint8 view of the same storage.
_AS_BYTES = (torch.int16, torch.complex64)
AS_EXPECTED, NEW_SIGNATURE = 0, 1
# [status, is_tuple, count, (dtype, ndim, dim_0 .. dim_{MAX_DIMS-1}) * MAX_TENSORS]
_HEADER = 3 + MAX_TENSORS * (2 + MAX_DIMS)
_HOST = torch.device("cpu")


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """``dist.broadcast`` of a contiguous ``tensor`` of any dtype: the dtypes NCCL lacks travel as their
    bytes (the same bits arrive), on every backend, so that what runs on gloo here runs on NCCL."""
    wire = tensor.view(-1).view(torch.uint8) if tensor.dtype in _AS_BYTES else tensor
    dist.broadcast(wire, src, group=group)


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
        status, signature = Signature.decode(self.head.tolist())  # host memory unless the link has no header group
        if status == AS_EXPECTED:
            assert self.expected is not None, "the sender claimed a signature this receiver never saw"
            tensors = self.buffers
        else:  # what was posted held placeholders; the payload follows
            tensors = signature.empty(self.link.device)
            for t in tensors:
                dist.recv(self.link.wire(t), self.src, group=self.link.group)
        self.link.received[(self.src, self.rows)] = signature
        return tensors, signature.as_tuple


class Link:
    """This rank's ends of its point-to-point pairs, with the signatures remembered per pair.

    Messages are keyed by peer and row count (dim 0 of every tensor): a micro-batch of the
    usual size and a short last one are remembered apart.

    Args:
        device: where received tensors are allocated.
        group: process group the ranks belong to (global ranks are used either way).
        header_group: a gloo group for the headers, kept in host memory (for a ``group`` whose
            backend moves device memory only, such as NCCL); ``None``: headers go with the payload,
            on its device.
    """

    def __init__(
        self,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        header_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.device = device
        self.group = group
        self.header_group = header_group
        self.sent: dict[tuple[int, int], Signature] = {}
        self.received: dict[tuple[int, int], Signature] = {}

    def wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """What goes on the payload group for ``tensor`` (contiguous): itself, or on a link
        that moves device memory only (NCCL), the bytes of a dtype NCCL cannot send."""
        if self.header_group is not None and tensor.dtype in _AS_BYTES:
            return tensor.reshape(-1).view(torch.uint8)
        return tensor

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
        head = signature.encode(status)
        on_host = self.header_group is not None
        if not on_host:
            head = head.to(device)
        pending.tensors.append(head)
        pending.works.append(dist.isend(head, dst, group=self.header_group if on_host else self.group))
        outgoing = expected.empty(device) if status == NEW_SIGNATURE and expected is not None else []
        outgoing += payload  # after the placeholders that fill the buffers the receiver posted
        for t in outgoing:
            pending.tensors.append(t)
            pending.works.append(dist.isend(self.wire(t), dst, group=self.group))
        self.sent[key] = signature

    def post(self, src: int, rows: int) -> Incoming:
        """Post the receive of the next message from global rank ``src``, expected to have ``rows`` rows."""
        on_host = self.header_group is not None
        head = torch.empty(_HEADER, dtype=torch.int64, device=_HOST if on_host else self.device)
        expected = self.received.get((src, rows))
        buffers = expected.empty(self.device) if expected is not None else []
        works = [dist.irecv(head, src, group=self.header_group if on_host else self.group)]
        works += [dist.irecv(self.wire(t), src, group=self.group) for t in buffers]
        return Incoming(self, src, rows, head, expected, buffers, works)


def share(
    value: Any, src: int, device: torch.device, pending: Pending, *, group: dist.ProcessGroup | None = None
) -> Any:
    """``value`` of rank ``src`` on every rank of ``group`` (collective; the default group when ``None``).

    Unlike ``broadcast_object_list``, ``src`` does not wait: its broadcasts go into ``pending``
    (wait on it before the tensors may be reused, e.g. at the next call). A pipeline's last
    stage shares its loss this way and goes on to its optimizer step while the first stages
    still drain their last backwards.

    ``group``, when given, is a gloo group over every rank (:attr:`P2PGroups.host`): the pickled
    bytes and their size then stay in host memory, where the receivers read them, instead of
    going through the device (on NCCL, a wait for the device on every rank).
    """
    if group is not None:
        device = _HOST
    if dist.get_rank() == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        for tensor in (size, payload):
            pending.works.append(dist.broadcast(tensor, src, group=group, async_op=True))
            pending.tensors.append(tensor)
        return value
    size = torch.empty(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src, group=group)
    return pickle.loads(payload.cpu().numpy().tobytes())


class P2PGroups(NamedTuple):
    """The process groups (each over all ranks) a pipeline's messages travel on.

    ``activations`` and ``gradients`` carry the payloads. The other three exist only where those
    two move device memory alone (NCCL): gloo groups for what the host must read, the headers of
    each direction and the values :func:`share` hands out. ``None`` for those: headers go with
    the payloads and :func:`share` uses the default group.
    """

    activations: dist.ProcessGroup | None = None
    gradients: dist.ProcessGroup | None = None
    activation_headers: dist.ProcessGroup | None = None
    gradient_headers: dist.ProcessGroup | None = None
    host: dist.ProcessGroup | None = None


def p2p_groups(device: torch.device | None = None, **kwargs: Any) -> P2PGroups:
    """The groups of :class:`P2PGroups`: two for the payloads, and on NCCL three gloo ones (collective).

    Gloo keeps one connection per pair of ranks and group. With both directions of a pipeline
    on one connection, a posted receive waits behind the other direction's traffic (measured in
    docs/benchmarks.md, "Runtime"). Activations flow only downstream and gradients only
    upstream, so one group per kind gives each direction its own connection; the header groups
    of NCCL payload groups follow the same rule.

    On NCCL with a CUDA ``device``, the payload groups are bound to it (``device_id``, as
    Lightning's DDP binds the world's group): each group's communicator is made here, once, and
    its point-to-point messages use it, where an unbound group makes one communicator per pair
    lazily, on the pair's first message, inside the schedule.
    """
    payload = {**kwargs, **_bound_to(device, kwargs.get("backend"))}
    activations, gradients = dist.new_group(**payload), dist.new_group(**payload)
    if dist.get_backend(activations) == dist.Backend.GLOO:
        return P2PGroups(activations, gradients)
    host = {**kwargs, "backend": dist.Backend.GLOO}
    return P2PGroups(activations, gradients, dist.new_group(**host), dist.new_group(**host), dist.new_group(**host))


def _bound_to(device: torch.device | None, backend: str | None = None) -> dict[str, torch.device]:
    """``new_group``'s ``device_id`` for a group of ``backend`` (the world's when ``None``): the CUDA
    ``device`` on NCCL, which then makes the group's communicator at once; nothing elsewhere."""
    if device is None or device.type != "cuda":
        return {}
    return {"device_id": device} if "nccl" in str(backend or dist.get_backend()).lower() else {}


def connect_pairs(pairs: Iterable[tuple[str, int, int]], links: Mapping[str, Link], rank: int) -> None:
    """Open the point-to-point pairs ``(link, low rank, high rank)`` in sorted order: one small
    message from the low rank to the high one, on the link's group (collective over the pairs' ranks).

    NCCL creates a pair's communicator when the pair first communicates on a group (unless the
    group was created with ``device_id``), and both ranks block until the other joins. A
    pipeline's first messages go wherever its schedule leads each rank: rank 0 of two stages
    posts its first gradient receive while rank 1 posts its first activation receive, and each
    waits in a creation the other never joins. Opening every pair first, in one order that every
    rank follows, cannot deadlock: the smallest pair not yet open always has both its ranks
    waiting on it. Batching each action's messages (``batch_isend_irecv``) would not do: on NCCL
    its first call on a group must include every rank of the group, and with gloo it only loops
    over the messages, while receives here are posted ahead, outside any action. Gloo connects
    every pair when the group is made, so there this costs one small message per pair, once.
    The header groups are gloo groups, connected likewise.
    """
    for kind, low, high in sorted(set(pairs)):
        link = links[kind]
        if rank == low:
            dist.send(torch.zeros(1, device=link.device), high, group=link.group)
        elif rank == high:
            dist.recv(torch.zeros(1, device=link.device), low, group=link.group)


def stage_group(plan: Plan, rank: int, device: torch.device | None = None, **kwargs: Any) -> dist.ProcessGroup | None:
    """The process group of ``rank``'s stage replicas (``None`` for a stage on one rank).

    Every rank must call this with the same plan: creating a group is collective. On CUDA the
    group's communicator is made here, by one all-reduce over its members once every group
    exists: NCCL makes it on first use otherwise, blocking, inside the first step's gradient
    hooks while this rank's point-to-point kernels are in flight. A rank is in one stage group
    at most, so the members' all-reduces wait on no one else. On NCCL the groups are bound to
    ``device`` (see :func:`_bound_to`), which makes each communicator at creation already.
    """
    mine = None
    kwargs = {**kwargs, **_bound_to(device, kwargs.get("backend"))}
    for index in range(plan.num_groups):  # a rank group's stages (one without chunks) share its group
        ranks = list(plan.stage_ranks(index))
        if len(ranks) > 1:
            group = dist.new_group(ranks, **kwargs)
            if rank in ranks:
                mine = group
    if mine is not None and device is not None and device.type == "cuda":
        dist.all_reduce(torch.zeros(1, device=device), group=mine)
    return mine


def concat_pieces(stage: int, m: int, pieces: list[tuple[list[torch.Tensor], bool]]) -> tuple[list[torch.Tensor], bool]:
    """Concatenate the pieces of this replica's slice received from the peer stage's replicas."""
    as_tuple = pieces[0][1]
    if len({len(p[0]) for p in pieces}) != 1:
        raise RuntimeError(f"stage {stage} received pieces of micro-batch {m} with different tensor counts")
    if len(pieces) == 1:
        return pieces[0][0], as_tuple
    return [torch.cat(parts) for parts in zip(*(p[0] for p in pieces))], as_tuple
