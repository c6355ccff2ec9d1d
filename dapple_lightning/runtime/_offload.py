"""A stage's layers kept on local disk, with a working window of them in memory (STRONGHOLD).

A stage with ``offload: W`` keeps each layer's parameters, gradients and optimizer state in files
under a directory of its own (``tempfile``; ``TMPDIR`` chooses where), and at most ``W`` of its
layers in memory while it computes. The window follows the computation: a layer's forward first
asks for layers ``i .. i + W - 1`` (``i`` is waited for, the rest are read on a worker thread while
``i`` computes); a layer's backward, announced by a hook on its output, asks for ``i - W + 1 .. i``
with their gradients. Layers that leave the window are dropped: their parameters are unchanged
since they were written, and only their gradients are written back. One worker thread runs every
read and write in the order they were asked for, so a layer that leaves is written out before
the next one is read in: with the layer that is being written, at most ``W + 1`` layers are in
memory. The optimizer then steps the stage layer by layer (:meth:`Offloader.step`): parameters,
gradients and state read, the user's optimizer stepped over that layer alone, parameters and state
written back, gradients dropped, while the next layer is read.

Autograd keeps what a layer saves for its backward. Saved tensors that alias a parameter (the
weight a ``Linear`` saves, a transposed view of it) are saved as a handle instead, and read back
from the parameter when the backward needs them, so a dropped layer really leaves memory.

On CPU (the only device supported yet) memory is the device and the disk is the tier that moves.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from dapple_lightning.planner import WindowChoice
from dapple_lightning.runtime._offload_records import Residency, TransferTimes

__all__ = ["Offloader"]

_log = logging.getLogger("dapple_lightning")


@dataclass
class _Layer:
    index: int
    params: list[nn.Parameter]
    shapes: list[torch.Size] = field(default_factory=list)
    params_in: bool = True
    grads_in: bool = False
    grads_on_disk: set[int] = field(default_factory=set)
    state_shapes: dict[tuple[int, int, str], tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    future: Future | None = None


@dataclass(frozen=True)
class _Saved:
    """A saved tensor that aliases parameter ``k`` of layer ``layer``: read back from the parameter."""

    layer: int
    k: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class Offloader:
    """Keeps ``layers`` (a stage's, in order) on disk with a window of ``window`` layers in memory."""

    def __init__(self, layers: Sequence[nn.Module], window: int | str) -> None:
        self.layers = [_Layer(i, list(layer.parameters())) for i, layer in enumerate(layers)]
        self.timing = TransferTimes(len(self.layers)) if window == "auto" else None
        """With ``window="auto"``, until the first training step ends: what it measures (window 1)."""
        self.choice: WindowChoice | None = None
        """With ``window="auto"``, after the first training step: the window chosen and its stalls."""
        if self.timing is None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"the offload window is 'auto' or a number of layers >= 1, got {window!r}")
        self.window = 1 if self.timing is not None else int(window)
        self.optimizers: list[Optimizer] = []
        self.residency = Residency()
        self.directory: Path | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()
        self._pointers: dict[int, tuple[int, int]] = {}  # data_ptr -> (layer, k) of parameters in memory
        self._ledger: list[dict[tuple, int]] = [{} for _ in self.layers]
        self._watched: set[int] = set()
        self._alive = [0] * len(self.layers)  # each layer's bytes still allocated
        self._whole = True  # everything is in memory (before the first step, after a checkpoint's read)
        self._closed = False
        self._cleanup: Any = None

    # ------------------------------------------------------------------ the step's boundaries

    def begin(self, shared: Sequence[nn.Parameter] = ()) -> None:
        """Before a pipelined step: write out whatever is in memory (the first time, or after a read-back).

        ``shared``: parameters other stages or modules also hold (tied weights), refused.
        """
        if self._closed:
            raise RuntimeError("the offloaded stage was closed (training ended); it cannot run again")
        if self.directory is None:
            self._start(shared)
        if self._whole:
            for layer in self.layers:
                self._submit_drop(layer, write=True, grads="write")
            self._wait_all()
            self._whole = False
            self.residency.reset()  # the peaks of the window, from here

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """After a pipelined step: every layer written out, its gradients kept on disk for the optimizer;
        with the replicas' ``group``, each layer's gradients are read in turn and summed over it first."""
        for layer in self.layers:
            if layer.params_in:
                self._submit_drop(layer, write=False, grads="write")
        self._wait_all()
        if group is not None:
            self._sum_gradients(group)
        if self.timing is not None and self.timing.trained:
            self.choice = self.timing.choose()
            self.window, self.timing = self.choice.window, None
            _log.info("%s (measured in the first step)", self.choice.describe())

    def _sum_gradients(self, group: dist.ProcessGroup) -> None:
        """Every replica reads the same layers in the same order and sums each gradient in place (a
        replica without one adds zeros, and then holds the sum: the others did have one)."""
        layers = [layer for layer in self.layers if any(p.requires_grad for p in layer.params)]
        for layer in self._in_turn(layers, state=False):
            for p in layer.params:
                if p.requires_grad:
                    if p.grad is None:
                        with self._lock:
                            p.grad = torch.zeros_like(p)
                    dist.all_reduce(p.grad, group=group)
            self._submit_drop(layer, write=False, grads="write")
        self._wait_all()

    def materialize(self) -> None:
        """Read every layer's parameters and optimizer state into memory (a checkpoint reads them, or
        training ends); the next step writes them out again."""
        if self.directory is None or self._whole:
            return
        for layer in self.layers:
            self._submit_load(layer, grads=False, state=True)
        self._wait_all()
        self._whole = True

    def close(self) -> None:
        """Read everything back into memory (the module is whole again) and remove the files."""
        if self._closed:
            return
        self.materialize()
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown()
        if self._cleanup is not None:
            self._cleanup()

    @property
    def layer_bytes(self) -> list[int]:
        """Each layer's parameter, gradient and optimizer-state bytes (as read in: its full size)."""
        out = []
        for layer in self.layers:
            params = sum(s.numel() * p.element_size() for s, p in zip(layer.shapes, layer.params))
            state = sum(s.numel() * torch.empty((), dtype=d).element_size() for s, d in layer.state_shapes.values())
            out.append(2 * params + state)
        return out

    # ------------------------------------------------------------------ the window

    def forward(self, index: int) -> None:
        """Layer ``index``'s forward is next: the window is ``index .. index + W - 1``."""
        self._move(index, range(index, min(index + self.window, len(self.layers))), grads=False)

    def backward(self, index: int) -> None:
        """Layer ``index``'s backward is next: the window is ``index - W + 1 .. index``, with gradients."""
        self._move(index, range(index, max(index - self.window, -1), -1), grads=True)

    def watch(self, index: int, output: Any) -> None:
        """Announce layer ``index``'s backward when the gradient of its ``output`` arrives."""

        def announce(grad: Tensor) -> None:
            self.backward(index)

        for t in output if isinstance(output, tuple | list) else (output,):
            if isinstance(t, Tensor) and t.requires_grad:
                t.register_hook(announce)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Save tensors that alias a parameter as handles (see the module's docstring)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def forward_done(self) -> None:
        """The stage's forward ended (its last layer's compute, for ``window="auto"``)."""
        if self.timing is not None:
            self.timing.end()

    def _move(self, index: int, wanted: range, *, grads: bool) -> None:
        if self.timing is not None:
            self.timing.end()
        keep = set(wanted)
        for layer in self.layers:  # first out, then in: the worker frees memory before it reads
            if layer.index not in keep and layer.params_in:
                self._submit_drop(layer, write=False, grads="write")
        for j in wanted:
            layer = self.layers[j]
            if not layer.params_in or (grads and not layer.grads_in and layer.grads_on_disk):
                self._submit_load(layer, grads=grads, state=False)
        self._wait(self.layers[index])
        self._sample()
        if self.timing is not None:
            self.timing.begin("backward" if grads else "forward", index)

    def _pack(self, t: Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        with self._lock:
            found = self._pointers.get(ptr) if ptr else None
        if found is None:
            return t
        return _Saved(found[0], found[1], t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved
        layer = self.layers[saved.layer]
        if not layer.params_in:  # the window did not foresee it: read it now, with the gradients it adds to
            self._submit_load(layer, grads=True, state=False)
        self._wait(layer)
        return layer.params[saved.k].detach().as_strided(saved.size, saved.stride, saved.offset)

    # ------------------------------------------------------------------ the optimizer

    def attach(self, optimizers: Sequence[Optimizer]) -> None:
        """The optimizers that step these layers: their state goes to disk with the layers, and comes
        back before their ``state_dict`` is read or loaded."""
        self.optimizers = list(optimizers)
        for optimizer in self.optimizers:
            optimizer.register_state_dict_pre_hook(self._read_back)
            optimizer.register_load_state_dict_pre_hook(self._read_back)

    def _read_back(self, *args: Any) -> None:
        self.materialize()

    def step(self, optimizer: Optimizer, step: Callable[[], Any]) -> None:
        """Run ``step`` (the optimizer's own, without closure) over the parameters outside the stage,
        then over each layer in turn with its parameters, gradients and state read in (the next
        layer is read meanwhile), and write the layer back."""
        mine = {id(p) for layer in self.layers for p in layer.params}
        with _only(optimizer, lambda p: id(p) not in mine):
            step()
        if self.directory is None or self._closed:  # nothing offloaded: an ordinary step
            with _only(optimizer, lambda p: id(p) in mine):
                step()
            return
        self.begin()  # after a read-back (a checkpoint) everything goes out first
        for layer in self._in_turn(self.layers, state=True):
            self._sample()
            ids = {id(p) for p in layer.params}
            with _only(optimizer, lambda p, ids=ids: id(p) in ids):
                step()
            self._submit_drop(layer, write=True, grads="discard")
        self._wait_all()
        self._sample()

    # ------------------------------------------------------------------ bookkeeping

    def _start(self, shared: Sequence[nn.Parameter]) -> None:
        tied, seen = {id(p) for p in shared}, set()
        for layer in self.layers:
            for p in layer.params:
                if id(p) in tied or id(p) in seen:
                    raise ValueError(
                        f"layer {layer.index} of an offloaded stage shares a parameter of shape {tuple(p.shape)} with "
                        "another layer or module (tied weights); offload keeps each layer's parameters in files of "
                        "its own: untie them or leave offload off for this stage"
                    )
                seen.add(id(p))
        for layer in self.layers:
            for p in layer.params:
                if not (p.is_contiguous() and p.storage_offset() == 0):
                    raise ValueError(
                        f"offload needs every parameter of the stage in a storage of its own; layer {layer.index}'s "
                        f"parameter of shape {tuple(p.shape)} is a view into a larger one; leave offload off there"
                    )
                if p.device.type != "cpu":
                    raise ValueError(
                        f"offload keeps layers on local disk with the CPU as the device; layer {layer.index} is on "
                        f"{p.device} (the host-memory tier for GPUs is not built yet): leave offload off on GPUs"
                    )
            layer.shapes = [p.shape for p in layer.params]
        self.directory = Path(tempfile.mkdtemp(prefix="dapple-offload-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dapple-offload")
        self._sample()  # what is in memory now, before the first drop
        self.residency.reset()

    def _held(self, layer: _Layer, key: tuple, t: Tensor | None) -> None:
        """The ledger: layer tensor ``key`` is now ``t`` (in memory) or ``None`` (dropped)."""
        with self._lock:
            self._ledger[layer.index].pop(key, None)
            if t is not None and t.numel():
                storage = t.untyped_storage()
                self._ledger[layer.index][key] = storage.nbytes()
                if id(storage) not in self._watched:
                    self._watched.add(id(storage))
                    self._alive[layer.index] += storage.nbytes()
                    weakref.finalize(storage, self._freed, layer.index, id(storage), storage.nbytes())
            self._count()

    def _freed(self, index: int, key: int, size: int) -> None:
        with self._lock:
            self._watched.discard(key)
            self._alive[index] -= size
            self._count()

    def _count(self) -> None:
        r = self.residency
        r.tracked = sum(sum(ledger.values()) for ledger in self._ledger)
        r.layers = sum(1 for ledger in self._ledger if ledger)
        r.alive = sum(self._alive)
        r.alive_layers = sum(1 for size in self._alive if size)
        r.update()

    def _sample(self) -> None:
        """Scan the layers' tensors: what autograd or the optimizer made joins the ledger; the storages' bytes."""
        with self._lock:
            total = 0
            for layer in self.layers:
                for key, t in self._tensors(layer):
                    total += t.untyped_storage().nbytes()
                    if t.numel() and key not in self._ledger[layer.index]:
                        self._held(layer, key, t)
            self.residency.storage = total
            self._count()

    def _tensors(self, layer: _Layer) -> list[tuple[tuple, Tensor]]:
        out: list[tuple[tuple, Tensor]] = []
        for k, p in enumerate(layer.params):
            out.append((("p", k), p.data))
            if p.grad is not None:
                out.append((("g", k), p.grad))
        out.extend((("s", *key), t) for key, _, _, t in self._state_entries(layer))
        return out

    def _state_entries(self, layer: _Layer) -> list[tuple[tuple[int, int, str], dict, str, Tensor]]:
        """Every optimizer-state tensor of the layer: its key (optimizer, parameter, name), its dict, its name, it."""
        out = []
        for o, optimizer in enumerate(self.optimizers):
            for k, p in enumerate(layer.params):
                state = optimizer.state.get(p)
                for name in sorted(state or ()):
                    if isinstance(state[name], Tensor):
                        out.append(((o, k, name), state, name, state[name]))
        return out

    # ------------------------------------------------------------------ the worker's tasks

    def _submit_drop(self, layer: _Layer, *, write: bool, grads: str) -> None:
        assert self._pool is not None
        layer.params_in = layer.grads_in = False
        layer.future = self._pool.submit(self._drop, layer, write=write, grads=grads)

    def _submit_load(self, layer: _Layer, *, grads: bool, state: bool) -> None:
        assert self._pool is not None
        layer.params_in = True
        layer.grads_in = layer.grads_in or grads
        layer.future = self._pool.submit(self._load, layer, grads=grads, state=state)

    def _timed(self, kind: str, layer: _Layer, seconds: float) -> None:
        if self.timing is not None and seconds > 0:  # the layer's tensors moved, all of them
            self.timing.transfer(kind, layer.index, seconds)

    def _in_turn(self, layers: Sequence[_Layer], *, state: bool) -> Iterator[_Layer]:
        """Each of ``layers`` once its parameters and gradients (and with ``state`` its optimizer state)
        are read in, the next one being read meanwhile."""
        if layers:
            self._submit_load(layers[0], grads=True, state=state)
        for at, layer in enumerate(layers):
            if at + 1 < len(layers):
                self._submit_load(layers[at + 1], grads=True, state=state)
            self._wait(layer)
            yield layer

    def _wait(self, layer: _Layer) -> None:
        if layer.future is not None:
            layer.future.result()

    def _wait_all(self) -> None:
        for layer in self.layers:
            self._wait(layer)

    def _file(self, layer: _Layer, what: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{layer.index}.{what}"

    def _drop(self, layer: _Layer, *, write: bool, grads: str) -> None:
        """Write what changed (``write``: parameters and optimizer state; gradients unless
        ``grads="discard"``), then let the layer's tensors go, an empty tensor in their place."""
        written = 0.0
        for k, p in enumerate(layer.params):
            if grads == "discard":
                layer.grads_on_disk.discard(k)
            if p.grad is not None:
                if grads == "write":
                    start = time.perf_counter()
                    _write(p.grad, self._file(layer, f"{k}.grad"))
                    written += time.perf_counter() - start
                    layer.grads_on_disk.add(k)
                with self._lock:  # the main thread scans these tensors (_sample)
                    self._held(layer, ("g", k), None)
                    p.grad = None
            if p.numel() == 0:
                continue  # out already
            if write:
                _write(p.data, self._file(layer, f"{k}.param"))
            with self._lock:
                self._pointers.pop(p.untyped_storage().data_ptr(), None)
                self._held(layer, ("p", k), None)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if write:
            for key, holder, name, t in self._state_entries(layer):
                if key in layer.state_shapes and t.numel() == 0 and layer.state_shapes[key][0].numel():
                    continue  # out already
                _write(t, self._file(layer, ".".join(map(str, key)) + ".state"))
                layer.state_shapes[key] = (t.shape, t.dtype)
                with self._lock:
                    self._held(layer, ("s", *key), None)
                    holder[name] = torch.empty(0, dtype=t.dtype, device=t.device)
        self._timed("write", layer, written)
        self._sample()

    def _load(self, layer: _Layer, *, grads: bool, state: bool) -> None:
        """Read the layer's parameters (and gradients, and optimizer state) into memory."""
        read = 0.0
        for k, (p, shape) in enumerate(zip(layer.params, layer.shapes)):
            if p.numel() == 0 and shape.numel():
                start = time.perf_counter()
                t = _read(self._file(layer, f"{k}.param"), shape, p.dtype)
                read += time.perf_counter() - start
                with self._lock:
                    p.data = t
                    self._held(layer, ("p", k), t)
                    self._pointers[t.untyped_storage().data_ptr()] = (layer.index, k)
            if grads and p.grad is None and k in layer.grads_on_disk:
                g = _read(self._file(layer, f"{k}.grad"), shape, p.dtype)
                with self._lock:
                    p.grad = g
                    self._held(layer, ("g", k), g)
        if state:
            for key, holder, name, t in self._state_entries(layer):
                shape, dtype = layer.state_shapes.get(key, (t.shape, t.dtype))
                if t.numel() == 0 and shape.numel():
                    loaded = _read(self._file(layer, ".".join(map(str, key)) + ".state"), shape, dtype)
                    with self._lock:
                        holder[name] = loaded
                        self._held(layer, ("s", *key), loaded)
        self._timed("read", layer, read)
        self._sample()


@contextmanager
def _only(optimizer: Optimizer, keep: Callable[[nn.Parameter], bool]) -> Iterator[None]:
    """The optimizer's groups list only the parameters ``keep`` accepts while inside."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = [p for p in params if keep(p)]
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params


def _bytes(t: Tensor) -> Any:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _write(t: Tensor, path: Path) -> None:
    with open(path, "wb") as f:
        f.write(memoryview(_bytes(t.contiguous())))


def _read(path: Path, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    t = torch.empty(shape, dtype=dtype)
    with open(path, "rb") as f:
        got = f.readinto(memoryview(_bytes(t)))
    if got != t.numel() * t.element_size():
        raise RuntimeError(f"offload file {path} holds {got} bytes, expected {t.numel() * t.element_size()}")
    return t
