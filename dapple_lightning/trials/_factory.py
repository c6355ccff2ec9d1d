"""Model factories: ``"module:function"`` specs that child processes import and call.

A factory is called as ``function(batch_size=B, **model_kwargs)`` and returns
``(LightningModule, train DataLoader)``; the loader's batches are the global batches (every
rank reads the same ones, as with ``DappleStrategy``). It runs in the trial's own processes,
never in the search process.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any

__all__ = ["call_factory", "check_factory_spec", "load_factory"]

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def check_factory_spec(spec: str) -> str:
    """Return ``spec`` if it looks like ``"package.module:function"``, else raise ``ValueError``."""
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise ValueError(
            f"model factory {spec!r} is not 'module:function' (e.g. 'dapple_lightning.search.testing:mlp'); "
            "the function takes batch_size=... and returns (LightningModule, DataLoader)"
        )
    return spec


def load_factory(spec: str) -> Callable[..., Any]:
    module_name, _, attr = check_factory_spec(spec).partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(
            f"cannot import {module_name!r} for model factory {spec!r}: {e}; run from the directory that holds "
            "it or add it to PYTHONPATH"
        ) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise ImportError(f"model factory {spec!r}: {module_name!r} has no attribute {attr!r}") from e
    if not callable(obj):
        raise TypeError(f"model factory {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def call_factory(spec: str, batch_size: int, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Import and call the factory; check it returned ``(LightningModule, DataLoader)``."""
    from lightning.pytorch import LightningModule

    out = load_factory(spec)(batch_size=batch_size, **kwargs)
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], LightningModule)):
        raise TypeError(
            f"model factory {spec!r} returned {type(out).__name__}; it must return (LightningModule, DataLoader)"
        )
    return out
