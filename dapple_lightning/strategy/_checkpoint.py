"""Checkpoints of a partitioned model, in the single-device layout.

Each rank holds its stage (and the parameters outside the container); a checkpoint holds the
whole model under the unpartitioned model's keys, and the optimizer state as
``configure_optimizers`` lays it out on one device. Every value has one *owner*, the rank that
writes it: a stage's entries belong to the stage's first replica, everything outside the
container to rank 0. Ownership of optimizer state is fixed when the optimizers are built, so
it still holds after ``fit`` has put the whole model back on every rank.

Rank 0 builds the checkpoint dict as Lightning asks for it, with meta-device *stand-ins* for
values other ranks own. Saving fills them in without a full copy anywhere:

* ``"full"``: rank 0 writes one ``torch.save`` file record by record; the owners send their
  tensors to it one at a time (:mod:`._stream`).
* ``"sharded"``: every owner writes its own values into a torch.distributed.checkpoint
  directory (:mod:`._sharded`).

Both write under a temporary name and rename, so a crash leaves the previous checkpoint
whole; with ``async_save`` the writing runs in a background thread on a process group of its
own after the values are copied (the only time training waits). Under NCCL a synchronous save
talks on the strategy's gloo group for waits on the host too: an owner's send to rank 0 (or a
sharded save's gather) lasts as long as rank 0's writing, and in an NCCL collective that would
trip the watchdog's timeout.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dapple_lightning.checkpoint import by_name, to_local, to_single_device
from dapple_lightning.microbatch import tensors
from dapple_lightning.plan import Plan
from dapple_lightning.runtime import broadcast, full_value, shard_like
from dapple_lightning.strategy import _sharded
from dapple_lightning.strategy._failures import HOST_WAIT
from dapple_lightning.strategy._lightning import distributed_is_initialized
from dapple_lightning.strategy._stream import StreamingFile, write_atomically
from dapple_lightning.surgery import Cut

__all__ = ["Checkpoints", "gather_on_zero", "group_names", "keep_local"]

Path_ = tuple[Any, ...]
"""Where a value lives: ``("model", key)`` or ``("optim", index, param_name, state_key)``."""


class Checkpoints:
    """Checkpoint state and files of one rank's part of the model (methods are collective)."""

    def __init__(self, state_dict_type: str, async_save: bool, timeout: timedelta) -> None:
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}")
        self.state_dict_type, self.async_save, self.timeout = state_dict_type, async_save, timeout
        self.module: nn.Module | None = None
        self.cut: Cut | None = None
        self.rank, self.device = 0, torch.device("cpu")
        self.full_state_keys: list[str] = []
        self.full_optimizer_names: list[list[list[str]]] = []
        self.optimizers: list[Optimizer] = []
        self._owner: dict[str, int] = {}  # state keys inside the container -> owner rank
        self._canonical: dict[int, str] = {}  # tied parameter -> the name one device gives it
        self._everywhere = True  # every rank holds every layer
        self._owned_optimizer_state: set[str] = set()  # parameter names
        self._stand_ins: dict[int, tuple[Tensor, int, Path_]] = {}
        self._group: Any = None
        self._pending: _Background | None = None
        self._whole_model: dict[str, Tensor] | None = None
        """A sharded stage's state dict made whole for the save in progress (see :meth:`model_state`)."""
        self._whole_optimizers: dict[int, dict[str, dict[str, Any]]] = {}
        """Likewise, per optimizer, its state by parameter name."""

    # ------------------------------------------------------------------ who owns what

    def attach(
        self, module: nn.Module, cut: Cut, plan: Plan, rank: int, device: torch.device, keys: list[str], host: Any
    ) -> None:
        """Take the module as cut for ``rank`` (collective when saving asynchronously). ``host``: the
        strategy's gloo group for waits on the host when the world's backend is not gloo, else ``None``."""
        self.module, self.cut, self.rank, self.device, self.full_state_keys = module, cut, rank, device, keys
        named = cut.chain.named_layers()
        self._everywhere = plan.num_stages == 1
        self._owner = {}
        for s, stage in enumerate(plan.stages):
            first = plan.stage_ranks(s)[0]
            for path, layer in named[stage.start : stage.end]:
                for key in layer.state_dict():
                    self._owner[f"{path}.{key}"] = first
        self._tie_names(module, cut)
        if self.async_save and self._group is None and distributed_is_initialized():
            # Background writes talk on their own group, so they never interleave with training's.
            self._group = dist.new_group(backend="gloo", timeout=max(self.timeout, HOST_WAIT))
        elif not self.async_save:
            self._group = host

    def _tie_names(self, module: nn.Module, cut: Cut) -> None:
        """A tied parameter has the name one device gives it (its first) on every rank, and all its
        keys the owner of that name: the one rank that saves its state and counts its gradient."""
        tied = {id(p) for p in cut.stage.shared}
        self._canonical = {}
        names: dict[int, list[str]] = {}
        with cut.whole():
            for name, param in module.named_parameters(remove_duplicate=False):
                if id(param) in tied:
                    names.setdefault(id(param), []).append(name)
        for key, all_names in names.items():
            self._canonical[key] = all_names[0]
            first = self.owner(all_names[0])
            for name in all_names:
                self._owner[name] = first

    def owner(self, key: str) -> int:
        return self._owner.get(key, 0)

    def set_optimizers(self, optimizers: list[Optimizer], full_names: list[list[list[str]]]) -> None:
        """The optimizers ``fit`` built on this rank, and their layout on one device."""
        assert self.module is not None
        self.optimizers, self.full_optimizer_names = optimizers, full_names
        names = {n for o in optimizers for group in self._names(o) for n in group}
        self._owned_optimizer_state = {n for n in names if self.owner(n) == self.rank}

    def owns_gradient(self) -> set[int]:
        """Parameters this rank speaks for when something must count each parameter once."""
        assert self.module is not None
        owned = self._owned_optimizer_state
        return {id(p) for n, p in self.module.named_parameters() if self._canonical.get(id(p), n) in owned}

    def whole_chain(self) -> dict[str, Tensor]:
        """The pipelined containers' state (under the model's keys) on every rank, each entry
        broadcast by its owner."""
        assert self.cut is not None
        state = self.cut.chain.state_dict()  # this rank's layers real, the others' on the meta device
        if self._everywhere:
            return state
        whole = {}
        for key, value in state.items():
            src = self.owner(key)
            tensor = (
                value.contiguous()
                if src == self.rank
                else torch.empty(value.shape, dtype=value.dtype, device=self.device)
            )
            broadcast(tensor, src)
            # Others' entries to the CPU, one at a time: the whole model never sits on this rank's device.
            whole[key] = tensor if src == self.rank else tensor.cpu()
        return whole

    def detach(self) -> None:
        """The container is whole again: every rank has every weight; optimizer ownership stays."""
        self.cut = None

    # ------------------------------------------------------------ the checkpoint dict

    def model_state(self) -> dict[str, Any]:
        """The full state dict on rank 0, with stand-ins for other ranks' entries; the local one elsewhere.

        Sharded, every entry rank 0 does not own is a stand-in, even one it holds (after ``fit``):
        each owner writes its own.
        """
        assert self.module is not None
        self._stand_ins = {}
        local = self.module.state_dict()
        if any(isinstance(v, DTensor) for v in local.values()):
            # A sharded stage: its replicas gather each entry together, so that its owner saves it whole.
            local = self._whole_model = {k: full_value(v) for k, v in local.items()}
        sharded = self.state_dict_type == "sharded"
        if self.rank != 0 or not distributed_is_initialized() or (self.cut is None and not sharded):
            return local
        elsewhere = {} if self.cut is None else self.cut.chain.state_dict()

        def entry(key: str) -> Tensor:
            owner = self.owner(key)
            if key in local and (owner == 0 or not sharded):
                return local[key]
            like = local[key] if key in local else elsewhere[key]
            return self._stand_in(torch.empty_like(like, device="meta"), owner, ("model", key))

        return {key: entry(key) for key in self.full_state_keys}

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The single-device ``state_dict`` of ``optimizer`` on rank 0, with stand-ins; the local one elsewhere."""
        local = _whole_optimizer_state(optimizer.state_dict())
        if not distributed_is_initialized() or dist.get_world_size() == 1:
            return local
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        named = by_name(local, self._names(optimizer))
        if any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
            self._whole_optimizers[index] = named
        mine = {n: s for n, s in named.items() if n in self._owned_optimizer_state}
        described = gather_on_zero({n: {k: _describe(v) for k, v in s.items()} for n, s in mine.items()})
        if described is None:
            return local
        states = dict(mine)
        for owner, part in enumerate(described):
            if owner == 0:
                continue
            for name, entries in part.items():
                states[name] = {
                    k: self._stand_in(torch.empty(v[0], dtype=v[1], device="meta"), owner, ("optim", index, name, k))
                    if isinstance(v, tuple) and len(v) == 3 and v[2] == _SHAPE
                    else v
                    for k, v in entries.items()
                }
        return to_single_device(states, local["param_groups"], self.full_optimizer_names[index])

    def _stand_in(self, meta: Tensor, owner: int, path: Path_) -> Tensor:
        self._stand_ins[id(meta)] = (meta, owner, path)
        return meta

    def _names(self, optimizer: Optimizer) -> list[list[str]]:
        assert self.module is not None
        name_of = {id(p): n for n, p in self.module.named_parameters()} | self._canonical
        return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    # ----------------------------------------------------------------------- saving

    def save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any, checkpoint_io: CheckpointIO) -> None:
        """Write ``checkpoint`` (rank 0's dict is the one written; collective)."""
        self.wait()
        if self.state_dict_type == "sharded" and _is_url(path):
            raise ValueError(
                f"state_dict_type='sharded' writes a directory on a local or mounted shared filesystem, not to a URL "
                f"({_without_credentials(path)}): save with state_dict_type='full', or mount the storage"
            )
        if self.rank == 0 and not _is_url(path):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        requests = self._requests(checkpoint)
        if not requests.get(self.rank):  # the whole values were only for this rank's own entries
            self._whole_model, self._whole_optimizers = None, {}
        if self.state_dict_type == "sharded":
            self._save_sharded(checkpoint, Path(path), requests)
        elif _streams(checkpoint_io, path, storage_options):
            self._save_streaming(checkpoint, Path(path), requests)
        else:
            full = self._materialize(checkpoint, requests)
            if self.rank == 0:
                _save_with(checkpoint_io, full, path, storage_options)

    def _requests(self, checkpoint: dict[str, Any]) -> dict[int, list[Path_]]:
        """Rank 0's stand-ins still in ``checkpoint`` (callbacks may have dropped some), by owner; on every rank."""
        requests: dict[int, list[Path_]] = {}
        if self.rank == 0:
            for tensor in tensors(checkpoint):
                if id(tensor) in self._stand_ins:
                    _, owner, path = self._stand_ins[id(tensor)]
                    requests.setdefault(owner, []).append(path)
        if not distributed_is_initialized() or dist.get_world_size() == 1:
            return requests
        box = [requests]
        dist.broadcast_object_list(box, 0)
        return box[0]

    def _lookup(self, paths: list[Path_], copy: bool) -> list[Tensor]:
        """This rank's live tensors at ``paths`` (copied to CPU when the write runs in the background)."""
        assert self.module is not None
        model = self._whole_model if self._whole_model is not None else self.module.state_dict()
        params = dict(self.module.named_parameters())
        out = []
        for path in paths:
            if path[0] == "model":
                tensor = model[path[1]]
            elif path[1] in self._whole_optimizers:
                tensor = self._whole_optimizers[path[1]][path[2]][path[3]]
            else:
                tensor = self.optimizers[path[1]].state[params[path[2]]][path[3]]
            out.append(tensor.detach().to("cpu", copy=True) if copy else tensor.detach().contiguous())
        self._whole_model, self._whole_optimizers = None, {}
        return out

    def _save_streaming(self, checkpoint: dict[str, Any], path: Path, requests: dict[int, list[Path_]]) -> None:
        group = self._group  # gloo (CPU tensors) when saving in the background or under NCCL
        mine = self._lookup(requests.get(self.rank, []), copy=group is not None) if self.rank != 0 else []
        stand_ins = dict(self._stand_ins)
        if self.rank == 0 and self.async_save:
            checkpoint = _copy_to_cpu(checkpoint, keep=stand_ins)
        device = torch.device("cpu") if group is not None else self.device

        def write() -> None:
            if self.rank != 0:
                for tensor in mine:
                    dist.send(tensor, 0, group=group)
                return
            tmp = _temporary(path)
            file = StreamingFile(tmp)
            try:
                received = _receive(requests, stand_ins, device, group)
                file.finish(checkpoint, {id(meta): file.add(value) for meta, value in received})
                os.replace(tmp, path)
            finally:
                file.abort()
                tmp.unlink(missing_ok=True)

        self._run(write)

    def _save_sharded(self, checkpoint: dict[str, Any], path: Path, requests: dict[int, list[Path_]]) -> None:
        tmp = _temporary(path)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left behind
        shards = self._own_shards()  # a sharded stage's replicas each write their own shard of its values
        paths = [p for p in requests.get(self.rank, []) if _sharded.key(p) not in shards]
        values = dict(zip(map(_sharded.key, paths), self._lookup(paths, copy=self.async_save)))
        if self.rank == 0:
            values.update(_sharded.rank_zero_values(checkpoint, self._stand_ins, self.full_optimizer_names))
        values.update(shards)
        if self.async_save and (self.rank == 0 or shards):
            values = _copy_to_cpu(values, keep={})
        group = self._group
        if distributed_is_initialized():
            dist.barrier(group=group)

        def write() -> None:
            _sharded.save(values, tmp, group)
            if self.rank == 0:
                _replace_directory(tmp, path)

        self._run(write)

    def _own_shards(self) -> dict[str, Tensor]:
        """This rank's shards of a sharded stage's values (``DTensor``), by directory key; empty elsewhere."""
        assert self.module is not None
        shards: dict[str, Tensor] = {
            _sharded.key(("model", k)): v for k, v in self.module.state_dict().items() if isinstance(v, DTensor)
        }
        if not shards:
            return shards
        for index, optimizer in enumerate(self.optimizers):
            names = [n for group in self._names(optimizer) for n in group]
            params = [p for group in optimizer.param_groups for p in group["params"]]
            for name, param in zip(names, params):
                for state_key, value in optimizer.state.get(param, {}).items():
                    if isinstance(value, DTensor):
                        shards[_sharded.key(("optim", index, name, state_key))] = value.detach()
        return shards

    def _materialize(self, checkpoint: dict[str, Any], requests: dict[int, list[Path_]]) -> dict[str, Any] | None:
        """``checkpoint`` with every stand-in replaced by its tensor, on rank 0 (a full copy; for other IO plugins)."""
        if self.rank != 0:
            for tensor in self._lookup(requests.get(self.rank, []), copy=False):
                dist.send(tensor, 0)
            return None
        filled = {id(meta): value for meta, value in _receive(requests, self._stand_ins, self.device, None)}
        return _replace_tensors(checkpoint, lambda t: filled.get(id(t), t).cpu())

    def _run(self, write: Any) -> None:
        if self.async_save:
            self._pending = _Background(write)
        else:
            write()

    def wait(self) -> None:
        """Block until the save in flight (if any) is written; raise its error."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    # ---------------------------------------------------------------------- loading

    def load(self, path: Any, checkpoint_io: CheckpointIO, weights_only: bool | None) -> dict[str, Any]:
        """The checkpoint at ``path``; from a sharded directory only what this rank holds."""
        self.wait()
        path = path if _is_url(path) else _sharded.existing(Path(path))
        if isinstance(path, Path) and path.is_dir():
            assert self.module is not None
            return _sharded.load(path, set(self.module.state_dict()), [self._names(o) for o in self.optimizers])
        if type(checkpoint_io) is TorchCheckpointIO and isinstance(path, Path):
            # Memory-mapped: each rank reads only the records of the tensors it keeps.
            return torch.load(path, map_location="cpu", mmap=True, weights_only=bool(weights_only))
        if weights_only is None:  # as Lightning 2.4 calls it: its CheckpointIO takes no weights_only
            return checkpoint_io.load_checkpoint(path)
        return checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def load_model(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        """Load this rank's entries of the checkpoint's full state dict."""
        assert self.module is not None
        state = checkpoint["state_dict"]
        saved = checkpoint.get(_sharded.STATE_KEYS, list(state))
        if strict:
            missing = [k for k in self.full_state_keys if k not in set(saved)]
            unexpected = [k for k in saved if k not in set(self.full_state_keys)]
            if missing or unexpected:
                raise RuntimeError(
                    f"Error(s) in loading state_dict: missing keys {missing}, unexpected keys {unexpected}"
                )
        local = self.module.state_dict()
        # A sharded stage's replica keeps its own shard of each whole value (no collective).
        self.module.load_state_dict({k: shard_like(v, local[k]) for k, v in state.items() if k in local}, strict=False)

    def load_optimizers(self, checkpoint: Mapping[str, Any]) -> None:
        for index, (optimizer, single) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            local = to_local(single, self.full_optimizer_names[index], self._names(optimizer))
            optimizer.load_state_dict(_sharded_optimizer_state(local, optimizer))

    def remove(self, path: Any, checkpoint_io: CheckpointIO) -> None:
        self.wait()
        if self.rank == 0:
            checkpoint_io.remove_checkpoint(path)


_SHAPE = "dapple:tensor"


def _whole_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer's ``state_dict`` with a sharded parameter's state gathered whole (collective over the
    stage's replicas, which hold the same parameters in the same order); unchanged without sharding."""
    per_param = state["state"]
    if not any(isinstance(v, DTensor) for entries in per_param.values() for v in entries.values()):
        return state
    whole = {i: {k: full_value(v) for k, v in entries.items()} for i, entries in sorted(per_param.items())}
    return {**state, "state": whole}


def _sharded_optimizer_state(state: dict[str, Any], optimizer: Optimizer) -> dict[str, Any]:
    """``state`` (whole values) with each sharded parameter's state cut as the parameter is (no collective)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = {}
    for index, entries in state["state"].items():
        param = params[index]
        out[index] = {
            k: shard_like(v, param) if isinstance(v, Tensor) and v.shape == param.shape else v
            for k, v in entries.items()
        }
    return {**state, "state": out}


def _receive(
    requests: dict[int, list[Path_]],
    stand_ins: Mapping[int, tuple[Tensor, int, Path_]],
    device: torch.device,
    group: Any,
) -> Iterator[tuple[Tensor, Tensor]]:
    """On rank 0: each stand-in ``requests`` names, with its value as received from its owner, owner by owner."""
    for owner in sorted(requests):
        for wanted in requests[owner]:
            meta = next(t for t, o, p in stand_ins.values() if o == owner and p == wanted)
            value = torch.empty(meta.shape, dtype=meta.dtype, device=device)
            dist.recv(value, owner, group=group)
            yield meta, value


def _describe(value: Any) -> Any:
    return (tuple(value.shape), value.dtype, _SHAPE) if isinstance(value, Tensor) else value


def _is_url(path: Any) -> bool:
    return "://" in str(path)


def _without_credentials(path: Any) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(str(path))
    return str(path).replace(parts.password, "***") if parts.password else str(path)


def _streams(checkpoint_io: CheckpointIO, path: Any, storage_options: Any) -> bool:
    """Whether the file can be streamed: Lightning's own IO (plain or wrapped async) to a local path."""
    inner = checkpoint_io.checkpoint_io if isinstance(checkpoint_io, AsyncCheckpointIO) else checkpoint_io
    return type(inner) is TorchCheckpointIO and storage_options is None and not _is_url(path)


def _save_with(checkpoint_io: CheckpointIO, checkpoint: Any, path: Any, storage_options: Any) -> None:
    if _is_url(path):
        # fsspec paths (s3://, memory://, file://) go to the plugin as they are: Path() would mangle them.
        checkpoint_io.save_checkpoint(checkpoint, path, storage_options=storage_options)
    else:
        write_atomically(checkpoint_io, checkpoint, path, storage_options)


def _replace_tensors(obj: Any, fn: Any) -> Any:
    """``obj`` with ``fn`` applied to its tensors, through dicts, lists and tuples as a checkpoint nests
    them (``microbatch.map_tensors`` rebuilds batch containers, which a checkpoint's values are not)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = {k: _replace_tensors(v, fn) for k, v in obj.items()}
        return type(obj)(items) if isinstance(obj, dict) and type(obj) is not dict else items
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        return type(obj)(_replace_tensors(v, fn) for v in obj)
    return obj


def _copy_to_cpu(obj: Any, keep: Mapping[int, Any]) -> Any:
    """A snapshot the background writer can read while training changes the live tensors."""
    return _replace_tensors(obj, lambda t: t if id(t) in keep else t.detach().to("cpu", copy=True))


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def _replace_directory(new: Path, path: Path) -> None:
    """Put directory ``new`` at ``path``; the old one moves aside first, so one of them is always whole."""
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)


class _Background:
    """One write running in a daemon thread (a dead peer must not keep the process from exiting)."""

    def __init__(self, fn: Any) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._target, args=(fn,), name="dapple-checkpoint", daemon=True)
        self._thread.start()

    def _target(self, fn: Any) -> None:
        try:
            fn()
        except BaseException as error:  # handed to the thread that waits
            self._error = error

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"dapple: the asynchronous checkpoint save failed: {self._error!r}") from self._error


def gather_on_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0 (``None`` elsewhere); collective."""
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def group_names(module: nn.Module, optimizers: list[Optimizer]) -> list[list[list[str]]]:
    """Parameter names of each param group of each optimizer."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [[[name_of[id(p)] for p in group["params"]] for group in o.param_groups] for o in optimizers]


def keep_local(optimizers: list[Optimizer], module: nn.Module) -> None:
    """Drop from every param group the parameters ``module`` does not hold (other stages', on meta).

    ``configure_optimizers`` ran on the whole model, so groups built from the model's own indices
    or names hold the layers they hold on one device; a group may end up empty on this rank.
    """
    local = {id(p) for p in module.parameters()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in local]
