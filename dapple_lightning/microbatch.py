"""Cutting batches into micro-batch slices, and joining the slices' outputs back together.

The row arithmetic itself (which rows, how slices of two stages overlap) is pure and lives in
:mod:`dapple_lightning.rows`; this module applies it to batches as users hand them.

How a batch is read
-------------------

A batch is a tree. **Containers** are cut inside: Mappings of any kind (``dict``,
``OrderedDict``, ``defaultdict``, ``UserDict`` and Hugging Face's ``BatchEncoding``, each
rebuilt as its own type), tuples and namedtuples, dataclass instances, and lists of fields.
Everything else is a leaf.

1. A tensor (or NumPy array) with at least one dimension holds the batch in dim 0: its
   dim 0 is the batch's row count, and each slice gets its rows.
2. A list of per-sample items is cut as a list (each slice gets its items); its length is
   the batch's row count. A list is per-sample when its items cannot be fields of one
   batch: one of them is not a tensor or container (strings, numbers: what
   ``default_collate`` makes of a string field, or what a custom collate returns), or they
   do not share one row count (per-sample tensors of different lengths).
3. A list whose items share one row count ``d`` is either fields of ``d`` rows, cut inside
   (what ``default_collate`` makes of a batch of tuples: ``[x, y]``), or a list of equal-shape
   per-sample tensors, with as many rows as items. dapple takes the reading that agrees with
   the rest of the batch, and fields when both do.
4. Tuples are always fields. A 0-dim tensor and any other leaf (a string, number or object
   outside a list) is a per-batch value: every slice gets it whole.
5. The row counts found must agree; a batch whose counts disagree (a tensor whose dim 0 is
   not the batch's rows, a per-sample list of the wrong length) is refused with the values
   and where they are, never cut along another dimension.

Rule 3 cannot tell a list of equal-shape per-sample tensors from fields when nothing else in
the batch says how many rows it has; the strategy then checks that the pipelined
Sequential's input has the slice's rows in dim 0, and refuses the step if not.

Joining outputs (``predict``) applies the same reading to each slice's output, whose rows are
known: tensors are concatenated along dim 0, per-sample lists concatenated, fields joined
per key or position; a value that is not per-row must be the same in every slice.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections import UserDict, defaultdict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from dapple_lightning.rows import Rows, even_split

__all__ = [
    "Rows",
    "batch_size_of",
    "concat_slices",
    "even_split",
    "map_tensors",
    "slice_batch",
    "tensors",
]


def _is_array(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor | np.ndarray)


def _is_dataclass(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _is_container(obj: Any) -> bool:
    return isinstance(obj, Mapping | tuple | list) or _is_dataclass(obj)


def _fields(obj: Any) -> list[tuple[str, Any]] | None:
    """``(label, value)`` of a container that is always cut inside; ``None`` for anything else."""
    if isinstance(obj, Mapping):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, tuple):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    if _is_dataclass(obj):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def _rebuild(obj: Any, values: list[Any], *, encodings: list | None = None) -> Any:
    """A container like ``obj`` holding ``values`` in the order :func:`_fields` lists them."""
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, dict(zip(obj.keys(), values, strict=True)), encodings)
    if isinstance(obj, tuple):
        return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
    if isinstance(obj, list):
        return values if type(obj) is list else type(obj)(values)
    names = [f.name for f in dataclasses.fields(obj)]
    return _rebuild_dataclass(obj, dict(zip(names, values, strict=True)))


def _rebuild_mapping(obj: Mapping, items: dict, encodings: list | None) -> Mapping:
    if _is_batch_encoding(obj):  # keeps one tokenizer Encoding per row beside its data
        return type(obj)(items, encoding=encodings, n_sequences=obj.n_sequences)
    if isinstance(obj, defaultdict):
        return type(obj)(obj.default_factory, items)
    if isinstance(obj, UserDict):
        new = copy.copy(obj)  # a subclass's own attributes come along
        new.data = items
        return new
    try:
        return type(obj)(items)
    except Exception as e:
        raise TypeError(
            f"dapple cannot rebuild a {type(obj).__name__} from a dict of its cut values; hand the batch as a "
            f"dict, or give {type(obj).__name__} a constructor that takes one"
        ) from e


def _rebuild_dataclass(obj: Any, values: dict[str, Any]) -> Any:
    """A copy of ``obj`` with its fields set to ``values``: not built again, so its ``__post_init__``
    does not run on values it already processed (a ``/ 255`` would scale every slice once more),
    as Lightning's own ``apply_to_collection`` copies a dataclass batch; fields left out of
    ``__init__`` are set (and cut) like the others, attributes that are not fields kept as they are."""
    new = copy.copy(obj)
    for name, value in values.items():
        object.__setattr__(new, name, value)
    return new


def _is_batch_encoding(obj: Any) -> bool:
    transformers = sys.modules.get("transformers")  # only a batch made by it can be one
    return transformers is not None and isinstance(obj, transformers.BatchEncoding)


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it, containers rebuilt as their types (a
    dataclass copied, not built again)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, list):
        return _rebuild(obj, [map_tensors(o, fn) for o in obj])
    fields = _fields(obj)
    if fields is None:
        return obj
    values = [map_tensors(v, fn) for _, v in fields]
    encodings = obj.encodings if _is_batch_encoding(obj) else None
    return _rebuild(obj, values, encodings=encodings)


def tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in ``obj``: a tensor, or Mappings, lists and tuples of them, nested."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping | list | tuple):
        for value in obj.values() if isinstance(obj, Mapping) else obj:
            yield from tensors(value)


# ------------------------------------------------------------------------ reading the rows


def _shared_rows(items: list) -> int | None:
    """The row count the items of a list share when they can be fields of one batch (rule 3)."""
    shared: set[int] = set()
    for item in items:
        if _is_array(item):
            rows = {item.shape[0]} if item.ndim else set()
        elif _is_container(item):
            found: list[tuple[str, int, str]] = []
            _find_rows(item, "", found)
            rows = {n for _, n, _ in found}
        else:
            return None
        if len(rows) != 1:
            return None
        shared |= rows
    return shared.pop() if len(shared) == 1 else None


def _find_rows(obj: Any, where: str, found: list[tuple[str, int, str]], lists: list | None = None) -> None:
    """Append ``(where, rows, what)`` for each row count in ``obj``; a list that may be fields or
    per-sample goes into ``lists`` as ``(where, list, shared rows)`` (counted as fields without)."""
    if _is_array(obj):
        if obj.ndim:
            found.append((where, obj.shape[0], f"dim 0 of a {type(obj).__name__} of shape {tuple(obj.shape)}"))
        return
    if isinstance(obj, list):
        shared = _shared_rows(obj) if obj else None
        if shared is not None and lists is not None:
            lists.append((where, obj, shared))
        elif shared is not None:
            found.append((where, shared, f"dim 0 of the {len(obj)} fields of a list"))
        elif obj:
            kinds = sorted({type(o).__name__ for o in obj})
            found.append((where, len(obj), f"the length of a list of per-sample {'/'.join(kinds)}"))
        return
    for label, value in _fields(obj) or ():
        _find_rows(value, where + label, found, lists)


def _agreed_rows(counts: set[int], lists: list[tuple[int, int]]) -> int | None:
    """The one row count that reads the whole batch (rule 3), given the ``counts`` found outside
    lists that may be fields or per-sample, and those lists' ``(shared rows, items)``."""

    def reads(rows: int) -> bool:
        return counts <= {rows} and all(rows in pair for pair in lists)

    if counts:
        return next(iter(counts)) if len(counts) == 1 and reads(next(iter(counts))) else None
    if len({shared for shared, _ in lists}) == 1:  # every list as fields: default_collate's layout
        return lists[0][0]
    fits = {rows for pair in lists for rows in pair if reads(rows)}
    return fits.pop() if len(fits) == 1 else None


def batch_size_of(batch: Any) -> int:
    """The rows of a batch, read by the rules in this module's docstring.

    Raises:
        ValueError: the batch holds nothing with rows, or its row counts disagree.
    """
    found: list[tuple[str, int, str]] = []
    lists: list[tuple[str, list, int]] = []
    _find_rows(batch, "batch", found, lists)
    if not found and not lists:
        raise ValueError(
            f"the {type(batch).__name__} batch holds no tensor with a batch dimension and no list of per-sample "
            "items; dapple cuts batches along dim 0 of their tensors (and per-sample lists item by item)"
        )
    rows = _agreed_rows({n for _, n, _ in found}, [(shared, len(items)) for _, items, shared in lists])
    if rows is not None:
        return rows
    seen = [f"{where}: {n} ({what})" for where, n, what in found] + [
        f"{where}: {shared} as fields or {len(items)} as samples (a list of {len(items)} items with {shared} rows each)"
        for where, items, shared in lists
    ]
    raise ValueError(
        f"dapple cannot read one row count in the batch ({'; '.join(seen)}); it cuts every tensor along dim 0 and every "
        "per-sample list item by item, so they must all hold the batch's rows. A value every slice needs whole "
        "belongs in a tuple (strings, numbers), as a 0-dim tensor, or on the module (other tensors); per-sample "
        "tensors of one shape belong stacked in one tensor, as default_collate does"
    )


# ------------------------------------------------------------------------ cutting and joining


def _is_per_sample(items: list, rows: int) -> bool:
    """Whether a list of a batch with ``rows`` rows is cut item by item (rules 2 and 3)."""
    shared = _shared_rows(items)
    return shared is None or (shared != rows and len(items) == rows)


def _cut(obj: Any, rows: int, part: Rows) -> Any:
    if _is_array(obj):
        return obj[part.start : part.stop] if obj.ndim else obj
    if isinstance(obj, list):
        if obj and _is_per_sample(obj, rows):
            return _rebuild(obj, obj[part.start : part.stop])
        return _rebuild(obj, [_cut(o, rows, part) for o in obj])
    fields = _fields(obj)
    if fields is None:
        return obj
    encodings = None
    if _is_batch_encoding(obj) and obj.encodings is not None:
        encodings = obj.encodings[part.start : part.stop] if len(obj.encodings) == rows else obj.encodings
    return _rebuild(obj, [_cut(v, rows, part) for _, v in fields], encodings=encodings)


def slice_batch(batch: Any, rows: Rows) -> Any:
    """The rows ``rows`` of a (nested) batch, read by the rules in this module's docstring."""
    return _cut(batch, batch_size_of(batch), rows)


def concat_slices(pieces: list[Any], sizes: list[int], where: str = "output") -> Any:
    """Join the outputs of consecutive slices of ``sizes`` rows into the output of all their rows.

    Tensors are concatenated along dim 0; Mappings, tuples and dataclasses joined per key or
    position; lists of fields per position, per-sample lists concatenated (the reading of the
    module docstring, with each slice's rows known). A leaf that is not per-row comes back once
    when every slice gave the same; otherwise the output cannot be joined and is refused.
    """
    first = pieces[0]
    if _is_array(first):
        if all(type(p) is type(first) and p.ndim and p.shape[0] == n for p, n in zip(pieces, sizes)):
            return torch.cat(pieces) if isinstance(first, torch.Tensor) else np.concatenate(pieces)
        shapes = [tuple(p.shape) if _is_array(p) else type(p).__name__ for p in pieces]
        raise ValueError(
            f"{where} has shapes {shapes} for slices of {sizes} rows; dapple joins the slices' outputs along dim 0, "
            "so a tensor in it must have one row per row of the slice (not, e.g., a mean over the slice)"
        )
    if any(type(p) is not type(first) for p in pieces):
        raise ValueError(f"{where} is a {sorted({type(p).__name__ for p in pieces})} in different slices")
    if isinstance(first, list):
        return _concat_lists(pieces, sizes, where)
    if isinstance(first, Mapping):
        if any(set(p) != set(first) for p in pieces):
            raise ValueError(f"{where} has keys {[sorted(map(str, p)) for p in pieces]} in different slices")
        return _rebuild(first, [concat_slices([p[k] for p in pieces], sizes, f"{where}[{k!r}]") for k in first])
    fields = _fields(first)
    if fields is not None:
        if any(len(_fields(p)) != len(fields) for p in pieces):
            raise ValueError(f"{where} has a different length in different slices; it cannot be joined")
        columns = zip(*([v for _, v in _fields(p)] for p in pieces))
        return _rebuild(first, [concat_slices(list(c), sizes, where + lb) for (lb, _), c in zip(fields, columns)])
    if all(_same(p, first) for p in pieces):
        return first
    raise ValueError(
        f"{where} differs between slices ({pieces[:4]}); a value that is not per-row cannot be joined: return it "
        "per row (a tensor with the rows in dim 0, or a list with an item per row)"
    )


def _concat_lists(pieces: list[list], sizes: list[int], where: str) -> list:
    as_fields = all(len(p) == len(pieces[0]) and p and _shared_rows(p) == n for p, n in zip(pieces, sizes))
    if as_fields:
        columns = zip(*pieces)
        return _rebuild(pieces[0], [concat_slices(list(c), sizes, f"{where}[{i}]") for i, c in enumerate(columns)])
    if all(len(p) == n for p, n in zip(pieces, sizes)):
        return _rebuild(pieces[0], [item for p in pieces for item in p])
    raise ValueError(
        f"{where} is a list of {[len(p) for p in pieces]} items for slices of {sizes} rows; dapple joins a list "
        "item by item when it has an item per row, or per position when its items are tensors with the rows in dim 0"
    )


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # a comparison that is not a plain truth value
        return a is b
