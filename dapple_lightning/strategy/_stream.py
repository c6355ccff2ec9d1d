"""Write a ``torch.save`` file tensor by tensor, so the writer never holds the whole state.

``torch.save`` pickles the object first and writes every storage after, so all of it must be
in memory at once. The file format does not need that order: it is a zip archive whose
``data.pkl`` names each storage by a record key. :class:`StreamingFile` writes each tensor's
record as soon as the tensor arrives (from this rank or, one at a time, from the rank that
owns it) and pickles the structure last, with the tensors replaced by references to records
already written. ``torch.load`` (``weights_only`` included) and ``load_from_checkpoint``
read the result like any other checkpoint.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO
from torch import Tensor

__all__ = ["Record", "StreamingFile", "write_atomically"]


class Record:
    """A tensor whose bytes are already in the file, standing in for it in the pickled structure."""

    __slots__ = ("dtype", "key", "requires_grad", "shape")

    def __init__(self, key: str, dtype: torch.dtype, shape: torch.Size, requires_grad: bool) -> None:
        self.key, self.dtype, self.shape, self.requires_grad = key, dtype, shape, requires_grad


class _StorageRef:
    __slots__ = ("dtype", "key", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class _Pickler(pickle.Pickler):
    """Pickles each tensor as a reference to its record, writing the record on first sight."""

    def __init__(self, out: io.BytesIO, file: StreamingFile, records: Mapping[int, Record]) -> None:
        super().__init__(out, protocol=2)
        self.file, self.records = file, records

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor | Record):
            return NotImplemented
        record = obj if isinstance(obj, Record) else self.records.get(id(obj))
        if record is None:
            if obj.device.type == "meta":
                raise ValueError(
                    "the checkpoint holds a tensor on the meta device that no rank fills in: a callback's or the "
                    "module's on_save_checkpoint replaced an entry the strategy streams from another rank"
                )
            record = self.file.add(obj)  # pickle's memo stores it once however often it appears
        ref = _StorageRef(record.key, record.dtype, record.shape.numel())
        shape = tuple(record.shape)
        return torch._utils._rebuild_tensor_v2, (ref, 0, shape, _strides(shape), record.requires_grad, OrderedDict())

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            # The same tuple torch.save writes for a typed storage: torch.load resolves it.
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None


def _storage_type(dtype: torch.dtype) -> type:
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class StreamingFile:
    """A checkpoint file written record by record; ``finish`` pickles the structure and closes it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by finish/abort
        self._writer = torch._C.PyTorchFileWriter(self._file)
        self._next = 0

    def add(self, tensor: Tensor) -> Record:
        """Write ``tensor``'s bytes now; the returned :class:`Record` stands in for it in :meth:`finish`."""
        data = tensor.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        if not data.is_contiguous() or data.untyped_storage().nbytes() != data.numel() * data.element_size():
            data = data.contiguous().clone()
        key = str(self._next)
        self._next += 1
        self._writer.write_record(f"data/{key}", data.untyped_storage(), data.numel() * data.element_size())
        return Record(key, tensor.dtype, tensor.shape, tensor.requires_grad)

    def finish(self, obj: Any, records: Mapping[int, Record] | None = None) -> None:
        """Pickle ``obj`` and close the file (fsynced).

        Tensors in ``obj`` are written as they are met, except those whose ``id`` is in
        ``records``: their bytes were written by :meth:`add` already (stand-ins for tensors that
        other ranks sent).
        """
        out = io.BytesIO()
        _Pickler(out, self, records or {}).dump(obj)
        buffer = out.getvalue()
        self._writer.write_record("data.pkl", buffer, len(buffer))
        self._writer.write_record(".format_version", "1", 1)
        self._writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._writer.write_end_of_file()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def abort(self) -> None:
        """Close without finishing (the caller deletes the file); harmless after :meth:`finish`."""
        self._writer = None  # its destructor ends the archive while the file is still open
        self._file.close()


def write_atomically(
    checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None
) -> None:
    """Write to a temporary file, then rename: a crash mid-write keeps the old file intact."""
    path = Path(filepath)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
