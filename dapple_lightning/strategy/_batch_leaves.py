"""A micro-batch's tensors reach the device when the stage's code first reads them.

Every stage runs your whole step on each micro-batch, so every stage would copy every tensor of
it to its device, though a middle stage of a plain ``(x, y)`` model reads neither (its layers
run on what it receives, and it leaves your step before the loss) and the last stage reads only
``y``. Which tensors a stage reads is known only by running your step: it may read an attention
mask on every stage, or a field only now and then. So on CUDA the tensors move lazily:

1. Your ``transfer_batch_to_device`` (Lightning's moves each tensor with ``.to(device)``) sees the
   micro-batch's rows as host tensors (:class:`HostLeaf`, a CPU tensor in every other respect),
   whose ``.to(device)`` returns a :class:`DeviceLeaf`: a tensor that says it is on the device,
   with the shape, dtype and strides of its rows, and holds no device memory yet.
2. The first operation that reads a DeviceLeaf's values (a layer, indexing, ``.item()``, an
   ``on_after_batch_transfer`` hook) copies its rows to the device, once (``non_blocking``, from
   the step's page-locked batch: the copy is queued on the current stream, the one the operation
   then runs on, so it and everything after it on that stream read the copied values), and the
   operation runs on that device tensor. Asking for its shape, dtype or device copies nothing.
3. A tensor the stage's step read once is copied as in 1, eagerly, from then on: its own step
   is what reads it, and compiled code that takes it in (a ``torch.compile``'d block given the
   mask) then sees a plain tensor (at a DeviceLeaf, Dynamo breaks the graph and runs the read
   eagerly: right, but slower, in the first step only).
   A tensor never read stays lazy, so a field the step reads now and then still arrives.

Where the device is the CPU nothing here runs by default: there is nothing to move.
``DappleStrategy(lazy_batch=True)`` runs it there too (nothing is copied; the bytes that would
move are counted), and ``lazy_batch=False`` turns it off on CUDA, for code that needs plain
tensors. ``copy_to_device`` is a module function so that a test can record the copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_map

from dapple_lightning.microbatch import map_tensors
from dapple_lightning.plan import Plan

__all__ = ["DeviceLeaf", "HostLeaf", "LeafMoves", "copy_to_device", "plain"]


def copy_to_device(host: Tensor, device: torch.device) -> Tensor:
    """The copy of a batch tensor's rows to the device (queued, from page-locked memory)."""
    return host.to(device, non_blocking=True)


Key = tuple[str, int]
"""A tensor of the batch: the step hook reading it, and its place among the batch's tensors."""


class LeafMoves:
    """One rank's lazy copies of its micro-batches' tensors: what was copied, and what its steps read."""

    def __init__(self, device: torch.device, lazy: bool) -> None:
        self.device, self.lazy = device, lazy
        self.read: set[Key] = set()
        """The tensors this rank's step hooks were seen reading under the current plan: copied eagerly from then on."""
        self.moved_bytes = 0
        """Bytes copied to the device since the step began."""
        self._plan: Plan | None = None

    def begin_step(self, plan: Plan) -> None:
        """Count from zero; under another ``plan`` than the last step's (``plan="auto"``'s trials
        come first), this rank holds another stage, which reads other tensors: learn them anew."""
        if plan != self._plan:
            self.read.clear()
            self._plan = plan
        self.moved_bytes = 0

    def host_leaves(self, rows: Any, hook: str) -> Any:
        """``rows`` with each host tensor as a :class:`HostLeaf` (where tensors move lazily)."""
        if not self.lazy:
            return rows
        place = itertools.count()

        def wrap(t: Tensor) -> Tensor:
            key = (hook, next(place))
            if t.device.type != "cpu" or t.layout != torch.strided or t.requires_grad or type(t) is not Tensor:
                return t
            return HostLeaf.of(t, self, key)

        return map_tensors(rows, wrap)

    def move(self, host: Tensor, key: Key) -> Tensor:
        """``host`` on the device, counted, and ``key`` known as read."""
        self.read.add(key)
        self.moved_bytes += host.numel() * host.element_size()
        return copy_to_device(host, self.device)

    def to_device(self, host: Tensor, key: Key) -> Tensor:
        """What ``.to(device)`` of a batch tensor gives: the copy where the step reads it, else a :class:`DeviceLeaf`."""
        if key in self.read:
            return self.move(host, key)
        return DeviceLeaf.of(host, self, key)


def plain(batch: Any) -> Any:
    """``batch`` with each :class:`HostLeaf` in it as the host tensor it stands for (``batch``
    itself where it holds none: what a transfer hook returned is handed on as it is)."""
    found = False

    def unwrap(value: Tensor) -> Tensor:
        nonlocal found
        if isinstance(value, HostLeaf):
            found = True
            return value.as_subclass(Tensor)
        return value

    try:
        unwrapped = map_tensors(batch, unwrap)
    except TypeError:
        # A container that cannot be rebuilt: every tensor in it was seen before its rebuild.
        if not found:
            return batch
        raise
    return unwrapped if found else batch


def _as_host(value: Any) -> Any:
    return value.as_subclass(Tensor) if isinstance(value, HostLeaf) else value


def _device_only(self: Tensor, func: Callable, args: tuple, kwargs: dict) -> torch.device | None:
    """The device of ``self.to(...)`` / ``self.cuda(...)`` where the call only moves it (no dtype,
    layout or format change, no forced copy); ``None`` for any other call."""
    if kwargs.get("copy"):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k != "copy"}
    if func is Tensor.cuda:
        device = kwargs.get("device", args[0] if args else None)
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    except (TypeError, RuntimeError):
        return None
    if dtype not in (None, self.dtype) or memory_format not in (None, torch.preserve_format):
        return None
    return device


def _same_device(a: torch.device | None, b: torch.device) -> bool:
    if a is None or a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


class HostLeaf(Tensor):
    """A host tensor of a micro-batch, as your transfer hook sees it: a CPU tensor in every way but
    one, ``.to(device)`` (or ``.cuda()``) to this rank's device, which moves it lazily."""

    @staticmethod
    def of(host: Tensor, moves: LeafMoves, key: Key) -> HostLeaf:
        leaf = host.as_subclass(HostLeaf)
        leaf._moves, leaf._key = moves, key
        return leaf

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self = args[0] if args else None
        if func is Tensor.__hash__:
            return id(self)
        if func in (Tensor.to, Tensor.cuda) and isinstance(self, HostLeaf):
            moves, key = self._moves, self._key
            if _same_device(_device_only(self, func, args[1:], kwargs), moves.device):
                return moves.to_device(self.as_subclass(Tensor), key)
        out = func(*tree_map(_as_host, args), **tree_map(_as_host, kwargs))
        if func in (Tensor.to, Tensor.cuda) and isinstance(self, HostLeaf) and out.device.type != "cpu":
            self._moves.moved_bytes += out.numel() * out.element_size()  # moved as your hook asked: eagerly
        return out


_METADATA = {
    Tensor.shape.__get__,  # type: ignore[attr-defined]
    Tensor.dtype.__get__,  # type: ignore[attr-defined]
    Tensor.device.__get__,  # type: ignore[attr-defined]
    Tensor.ndim.__get__,  # type: ignore[attr-defined]
    Tensor.layout.__get__,  # type: ignore[attr-defined]
    Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    Tensor.grad.__get__,  # type: ignore[attr-defined]
    Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
    Tensor.itemsize.__get__,  # type: ignore[attr-defined]
    Tensor.nbytes.__get__,  # type: ignore[attr-defined]
    Tensor.size,
    Tensor.dim,
    Tensor.numel,
    Tensor.nelement,
    Tensor.__len__,
    Tensor.stride,
    Tensor.is_contiguous,
    Tensor.is_floating_point,
    Tensor.is_complex,
    Tensor.element_size,
}
"""What a :class:`DeviceLeaf` answers without its values."""


class DeviceLeaf(Tensor):
    """A micro-batch's tensor on the device before its rows are copied there: its shape, dtype,
    strides and device are the copy's; any operation on its values makes the copy (once) and runs
    on it. Operations return plain tensors; an in-place one changes the copy, which later
    operations on this tensor read."""

    @staticmethod
    def of(host: Tensor, moves: LeafMoves, key: Key) -> DeviceLeaf:
        leaf = Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            DeviceLeaf,
            host.shape,
            strides=torch.empty_like(host, device="meta").stride(),  # the copy's: ``.to`` keeps dense strides
            storage_offset=0,
            dtype=host.dtype,
            device=moves.device,
            requires_grad=False,
        )
        leaf._host, leaf._moves, leaf._key, leaf._copy = host, moves, key, None
        return leaf

    def copied(self) -> Tensor:
        """The rows on the device: copied on the first call."""
        if self._copy is None:
            self._copy = self._moves.move(self._host, self._key)
        return self._copy

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self = args[0] if args else None
        if func is Tensor.__hash__:
            return id(self)
        if func in _METADATA:
            if self._copy is not None:  # an in-place change (``requires_grad_``, ``unsqueeze_``) is the copy's
                return func(self._copy, *args[1:], **kwargs)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        moves_it = func in (Tensor.to, Tensor.cuda) and isinstance(self, DeviceLeaf)
        if moves_it and _same_device(_device_only(self, func, args[1:], kwargs), self.device):
            return self
        return func(*tree_map(_copied, args), **tree_map(_copied, kwargs))

    @classmethod
    def __torch_dispatch__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Reached only from C++ (an operator called inside another): the Python calls stop above.
        return func(*tree_map(_copied, args), **tree_map(_copied, kwargs or {}))


def _copied(value: Any) -> Any:
    return value.copied() if isinstance(value, DeviceLeaf) else value
