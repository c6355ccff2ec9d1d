"""Lightning's ``BaseFinetuning`` under a plan: its hooks see the model as one device has it.

``finetune_function`` picks modules from the user's model (``pl_module.layers[:4]``); on a rank
that holds one stage the container is re-indexed from 0, so it would unfreeze other layers than
on one device. It runs with the whole container in place
(:meth:`~dapple_lightning.surgery.Cut.whole`); a param group it adds keeps this rank's
parameters, and its single-device layout is recorded for checkpoints. The gradient reducers
follow the new ``requires_grad`` flags at the next step (see the runtime).
``freeze_before_training`` needs nothing: Lightning calls it before the model is cut.
"""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.callbacks import BaseFinetuning

from dapple_lightning.strategy._checkpoint import group_names, keep_local
from dapple_lightning.strategy._lightning import Patches, finetuning_filter
from dapple_lightning.strategy._parts import FitParts

__all__ = ["adapt_finetuning"]


def adapt_finetuning(patches: Patches, callbacks: list[Any], parts: FitParts) -> None:
    """Wrap the ``finetune_function`` of every ``BaseFinetuning`` in ``callbacks`` for this fit's
    ``parts``; ``patches`` records the wrap, which the strategy's teardown takes off."""
    for callback in callbacks:
        if isinstance(callback, BaseFinetuning):
            patches.set(callback, "finetune_function", _regrouping(parts, callback.finetune_function))


def _regrouping(parts: FitParts, hook: Any) -> Any:
    @functools.wraps(hook)
    def run(pl_module: Any, epoch: int, optimizer: Any) -> Any:
        checkpoints = parts.checkpoints
        index = next(i for i, o in enumerate(checkpoints.optimizers) if o is optimizer)
        known = len(checkpoints.full_optimizer_names[index])
        held = {n for group in checkpoints.full_optimizer_names[index] for n in group}
        with parts.cut.whole():
            name_of = {id(p): n for n, p in pl_module.named_parameters()}

            def not_held(optimizer: Any, params: Any) -> list[Any]:
                # What one device's optimizer holds, by name: this rank's holds only its own
                # parameters, and Lightning's check compares values, which meta tensors lack.
                return [p for p in params if name_of.get(id(p)) not in held]

            with finetuning_filter(not_held):
                result = hook(pl_module, epoch, optimizer)
            added = group_names(pl_module, [optimizer])[0][known:]
        if added:
            keep_local([optimizer], pl_module)
            names = [list(groups) for groups in checkpoints.full_optimizer_names]
            names[index] = [*names[index], *added]
            checkpoints.set_optimizers(checkpoints.optimizers, names)
        return result

    return run
