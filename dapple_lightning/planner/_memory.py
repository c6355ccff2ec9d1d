"""Memory meters for the profile: what a layer saves for its backward, its transient peak, and
the optimizer's state, measured rather than assumed.

The analytic model (parameters, gradients, optimizer factor, the layers' outputs) misses what
frameworks really allocate (mCAP, Dreuning et al.). These meters measure it on any device:

- :class:`SavedBytes` counts, through ``torch.autograd.graph.saved_tensors_hooks``, the bytes
  autograd keeps for the backward while it is active: each storage once (views and a tensor
  saved twice share one), the layer's parameters left out (counted with the parameters).
- :func:`live_bytes` gives a tracker of the bytes allocated while it is active and still alive
  (a ``TorchDispatchMode`` that sees every op's outputs, with ``weakref.finalize`` on their
  storages): where there are no allocator counters (CPU), it stands in for CUDA's
  ``memory_allocated`` / ``max_memory_allocated``.
- :class:`LayerMemory` uses them around each layer's forward and backward of a chain.
- :func:`optimizer_state_bytes` sums the tensors an optimizer really keeps for given parameters.

Like the rest of the planner, torch is imported only inside functions.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["LayerMemory", "SavedBytes", "live_bytes", "memory_counter", "optimizer_state_bytes"]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """:func:`dapple_lightning.microbatch.tensors`, imported on first use: it imports torch."""
    from dapple_lightning.microbatch import tensors

    return tensors(value)


def _storage(t: torch.Tensor) -> Any:
    """``t``'s untyped storage, or ``None`` for tensors without one (sparse, nested, wrappers)."""
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class SavedBytes:
    """Bytes autograd saves for the backward of what runs while this is entered.

    Each distinct storage counts once and whole: a view saved keeps its whole storage alive, and
    two views of one storage (or one tensor saved by two ops) keep it once. Storages are told
    apart by address, which is sound because a saved tensor stays alive until its backward, so no
    two saved storages share an address during one measurement. Tensors in ``exclude`` (a layer's
    parameters), and views of them, are not counted: their bytes are the parameters'.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {s.data_ptr() for s in map(_storage, exclude) if s is not None}
        self._seen: dict[int, int] = {}
        self._hooks: AbstractContextManager[Any] | None = None

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage is not None and storage.nbytes() and storage.data_ptr() not in self._exclude:
            self._seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    def __enter__(self) -> SavedBytes:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def live_bytes() -> Any:
    """A new live-bytes tracker; enter it to track, once.

    While entered, every op's outputs pass through ``__torch_dispatch__``. An output storage is
    new, and counted, unless it is one of the op's inputs' storages (views, in-place ops, ``out=``
    and other outputs that alias an input) or one already counted; ``weakref.finalize`` on it
    subtracts its bytes when it is freed (storage objects are kept one per storage, so the
    finalizer fires when the memory goes, not when a tensor's view of it does). Storages made
    before it was entered (the inputs, parameters) are the baseline: never counted, also when
    freed. A counted storage that ``resize_`` grows counts its new size. ``UntypedStorage.resize_``
    called on a storage (not a tensor op, so not dispatched: FSDP2 frees a gathered parameter's
    memory and takes it back that way) is followed too while it is entered, on any storage: one made
    before counts its change from its size then (a baseline storage resized to 0 takes its bytes off
    ``live``, and back when regrown). Not seen: scratch memory a kernel allocates and frees inside
    itself without returning it as a tensor.
    """
    return _tracker_class()()


@contextmanager
def _storage_resizes(seen: Callable[[Any, int], None]) -> Iterator[None]:
    """While entered, ``UntypedStorage.resize_`` calls ``seen(storage, its bytes before)`` after resizing."""
    import torch

    resize = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        before = storage.nbytes()
        out = resize(storage, size)
        seen(storage, before)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = resize


def _check_one_object_per_storage() -> None:
    import torch

    probe = torch.empty(1)
    if probe.untyped_storage() is not probe.untyped_storage():
        raise RuntimeError(
            f"torch {torch.__version__} does not keep one Python object per storage; the live-bytes "
            "tracker needs it to learn when a storage is freed"
        )


@functools.cache
def _tracker_class() -> type:
    """The tracker's class (see :func:`live_bytes`), built on first use so that importing the planner
    does not import torch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    _check_one_object_per_storage()

    class LiveBytes(TorchDispatchMode):
        """Bytes allocated while entered and still alive (``live``), and their maximum (``peak``)."""

        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self._sizes: dict[int, int] = {}
            self._baseline: dict[int, int] = {}  # a storage made before entering: its size then
            self._finalizers: dict[int, weakref.finalize] = {}
            self._resizes: Any = None

        def reset_peak(self) -> int:
            """Start a new peak from what is live now, and return that."""
            self.peak = self.live
            return self.live

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            # Held in a list so that the ids compared below belong to live objects.
            inputs = [s for s in map(_storage, _tensors((args, kwargs))) if s is not None]
            known = {id(s) for s in inputs}
            for storage in map(_storage, _tensors(out)):
                if storage is not None:
                    self._saw(storage, known)
            return out

        def _saw(self, storage: Any, inputs: set[int]) -> None:
            key, size = id(storage), storage.nbytes()
            if key in self._sizes:
                self._add(size - self._sizes[key])
                self._sizes[key] = size
            elif key not in inputs and size:
                self._follow(storage, key, size)
                self._add(size)

        def _follow(self, storage: Any, key: int, size: int) -> None:
            self._sizes[key] = size
            finalizer = weakref.finalize(storage, self._freed, key)
            finalizer.atexit = False
            self._finalizers[key] = finalizer

        def _resized(self, storage: Any, before: int) -> None:
            key = id(storage)
            if key not in self._sizes:  # made before entering: counted from its size then
                self._baseline[key] = before
                self._follow(storage, key, before)
            self._saw(storage, set())

        def __enter__(self) -> Any:
            self._resizes = _storage_resizes(self._resized)
            self._resizes.__enter__()
            return super().__enter__()

        def _add(self, delta: int) -> None:
            self.live += delta
            self.peak = max(self.peak, self.live)

        def _freed(self, key: int) -> None:
            self._finalizers.pop(key, None)
            self.live -= self._sizes.pop(key, 0) - self._baseline.pop(key, 0)

        def __exit__(self, *exc: object) -> None:
            # Storages still alive stay counted in ``live``; nothing follows them any more.
            self._resizes.__exit__(None, None, None)
            for finalizer in self._finalizers.values():
                finalizer.detach()
            self._finalizers.clear()
            self._sizes.clear()
            self._baseline.clear()
            super().__exit__(*exc)

    return LiveBytes


class _CudaCounter:
    """CUDA's caching-allocator counters, read through the tracker's interface."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __enter__(self) -> _CudaCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def reset_peak(self) -> int:
        import torch

        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    @property
    def live(self) -> int:
        import torch

        return torch.cuda.memory_allocated(self.device)

    @property
    def peak(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated(self.device)


def memory_counter(device: torch.device) -> Any:
    """What counts allocations on ``device``, to enter around what is measured: CUDA's allocator
    counters, elsewhere a live-bytes tracker (both with ``reset_peak()``, ``live`` and ``peak``)."""
    return _CudaCounter(device) if device.type == "cuda" else live_bytes()


class LayerMemory:
    """Each layer's peak memory and saved bytes over one pass of a chain, entered around the pass.

    Around a layer's forward: the peak above what was allocated before it, what stays allocated
    after it (its output and what autograd saved for its backward), and (:class:`SavedBytes`)
    what it saved. Around its backward (the saved tensors still allocated): the peak above what
    was allocated before. The layer's peak is the larger of the forward's peak and what it kept
    plus the backward's peak, less its parameters' gradients, which the backward creates and the
    planner counts with the parameters. The counters are the caching allocator's on CUDA
    (``source`` ``"allocator"``: they see a kernel's workspace too) and the live-bytes tracker
    elsewhere (``"tracker"``).
    """

    def __init__(self, modules: list[torch.nn.Module], device: torch.device) -> None:
        count = len(modules)
        self.source = "allocator" if device.type == "cuda" else "tracker"
        self._counter: Any = memory_counter(device)
        self._modules = modules
        self._forward, self._kept, self._backward = [0] * count, [0] * count, [0] * count
        self.saved = [0] * count
        self._grads = [sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad) for m in modules]

    def __enter__(self) -> LayerMemory:
        self._counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._counter.__exit__(*exc)

    @contextmanager
    def forward(self, index: int) -> Iterator[None]:
        base = self._counter.reset_peak()
        with SavedBytes(self._modules[index].parameters()) as saved:
            yield
        self.saved[index] = saved.bytes
        self._forward[index] = self._counter.peak - base
        self._kept[index] = self._counter.live - base

    @contextmanager
    def backward(self, index: int) -> Iterator[None]:
        base = self._counter.reset_peak()
        yield
        self._backward[index] = self._counter.peak - base

    def peaks(self) -> list[int]:
        return [max(f, k + b - g, 0) for f, k, b, g in zip(self._forward, self._kept, self._backward, self._grads)]


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors ``optimizer`` keeps in its state for ``params``, each storage once, as
    the optimizer stores them (Adam: two moments shaped like each parameter and its ``step``,
    a scalar tensor); what it keeps beside tensors (numbers, settings) is not counted.

    Its state exists only after a ``step()``; before, this is 0.
    """
    wanted = {id(p) for p in params}
    seen: dict[int, int] = {}
    for param, state in optimizer.state.items():
        if id(param) in wanted:
            for t in _tensors(state):
                storage = _storage(t)
                if storage is not None and storage.nbytes():
                    seen.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(seen.values())
