"""Sharded checkpoints: a torch.distributed.checkpoint (DCP) directory, written by every owner.

The directory holds flat keys, each written by the one rank that owns the value:

* ``model/<state key>``: the unpartitioned model's state dict;
* ``optim/<optimizer>/<parameter name>/<state key>``: optimizer state, by parameter *name*, so
  any plan or world size reads back what its own ranks hold;
* ``lightning``: everything else of Lightning's checkpoint (loops, callbacks, LR schedulers,
  hyperparameters, the optimizers' param groups), written by rank 0 as one opaque value.
  Opaque because DCP turns the keys of the dicts it walks into strings, which would change
  what a callback gets back.

:func:`consolidate_checkpoint` turns a directory into the single-device file that
``load_from_checkpoint`` and plain Lightning resume from.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins import TorchCheckpointIO
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dapple_lightning.checkpoint import by_name, to_single_device
from dapple_lightning.strategy._stream import write_atomically

__all__ = ["STATE_KEYS", "consolidate_checkpoint", "existing", "key", "load", "rank_zero_values", "save"]

STATE_KEYS = "dapple_state_keys"
"""Entry of a loaded sharded checkpoint: the full state dict's keys (its ``state_dict`` holds only this rank's)."""
_NAMES = "dapple_optimizer_names"
_GROUPS = "dapple_optimizer_param_groups"
_REST = "lightning"


def key(path: tuple[Any, ...]) -> str:
    """The directory key of a value at ``("model", key)`` or ``("optim", index, name, state_key)``."""
    return "/".join(map(str, path))


def rank_zero_values(
    checkpoint: Mapping[str, Any], stand_ins: Collection[int], full_names: Sequence[Sequence[Sequence[str]]]
) -> dict[str, Any]:
    """What rank 0 writes: its own entries of ``checkpoint`` (not the ``stand_ins``) and the rest, opaque."""
    values: dict[str, Any] = {}
    for name, value in checkpoint["state_dict"].items():
        if id(value) not in stand_ins:
            values[key(("model", name))] = value
    groups = None
    if "optimizer_states" in checkpoint:
        groups = []
        for index, single in enumerate(checkpoint["optimizer_states"]):
            for name, state in by_name(single, full_names[index]).items():
                for state_key, value in state.items():
                    if id(value) not in stand_ins:
                        values[key(("optim", index, name, state_key))] = value
            groups.append(single["param_groups"])
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    rest.update({STATE_KEYS: list(checkpoint["state_dict"]), _NAMES: full_names, _GROUPS: groups})
    buffer = io.BytesIO()
    torch.save(rest, buffer)
    values[_REST] = buffer.getvalue()
    return values


def save(values: dict[str, Any], directory: Path, group: Any) -> None:
    """Write this rank's ``values`` into ``directory`` (collective over ``group``)."""
    dcp.save(values, storage_writer=dcp.FileSystemWriter(directory, sync_files=True), process_group=group)


def existing(path: Path) -> Path:
    """``path``, or the previous directory a save killed between its two renames left beside it."""
    old = path.with_name(f".{path.name}.old")
    if not path.exists() and old.is_dir():
        warnings.warn(f"dapple: {path} is missing; loading the previous checkpoint left at {old}", stacklevel=3)
        return old
    return path


def load(
    directory: Path, model_keys: Collection[str] | None, optimizer_names: Sequence[Sequence[Sequence[str]]] | None
) -> dict[str, Any]:
    """Lightning's checkpoint dict from ``directory``, reading only the model keys and parameters named.

    ``None`` reads everything. Its ``state_dict`` holds the keys read; ``optimizer_states`` is in
    the single-device layout with the state of the parameters read.
    """
    reader = dcp.FileSystemReader(directory)
    metadata = reader.read_metadata()
    wanted = None if optimizer_names is None else [{n for g in o for n in g} for o in optimizer_names]
    template: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        parts = fqn.split("/", 3)
        if parts[0] == "model" and model_keys is not None and parts[1] not in model_keys:
            continue
        if (
            parts[0] == "optim"
            and wanted is not None
            and (int(parts[1]) >= len(wanted) or parts[2] not in wanted[int(parts[1])])
        ):
            continue
        template[fqn] = (
            torch.empty(meta.size, dtype=meta.properties.dtype) if isinstance(meta, TensorStorageMetadata) else None
        )
    if _REST not in template:
        raise ValueError(f"{directory} is not a dapple sharded checkpoint (it has no {_REST!r} entry)")
    dcp.load(template, storage_reader=reader, no_dist=True)
    checkpoint = torch.load(io.BytesIO(template.pop(_REST)), weights_only=False)
    state_keys = checkpoint[STATE_KEYS]
    checkpoint["state_dict"] = {k: template[key(("model", k))] for k in state_keys if key(("model", k)) in template}
    names, groups = checkpoint.pop(_NAMES), checkpoint.pop(_GROUPS)
    if groups is not None:
        per_optimizer: list[dict[str, dict[str, Any]]] = [{} for _ in groups]
        for fqn, value in template.items():
            parts = fqn.split("/", 3)
            if parts[0] == "optim":
                per_optimizer[int(parts[1])].setdefault(parts[2], {})[parts[3]] = value
        checkpoint["optimizer_states"] = [
            to_single_device(states, group, names[i]) for i, (states, group) in enumerate(zip(per_optimizer, groups))
        ]
    return checkpoint


def consolidate_checkpoint(directory: str | Path, output: str | Path) -> Path:
    """Write the single-device checkpoint file of the sharded checkpoint ``directory`` to ``output``.

    The file is what single-device Lightning would have saved: ``load_from_checkpoint`` and
    ``Trainer.fit(ckpt_path=...)`` take it under any strategy. Needs the whole state in memory.
    """
    checkpoint = load(existing(Path(directory)), None, None)
    del checkpoint[STATE_KEYS]
    write_atomically(TorchCheckpointIO(), checkpoint, output, None)
    return Path(output)
