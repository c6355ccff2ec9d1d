"""Blocks in an ``nn.ModuleList`` that the user's forward loops over, handed to the pipeline one by one.

With a Sequential container the user's step calls the stage once; with a ModuleList it calls
every block itself, with side inputs it computes on every rank::

    for block in self.blocks:
        x = block(x, mask, position_ids=pos)

:func:`stand_in_blocks` builds the list that stands in for the user's on one rank: element ``i``
is the real block ``i`` where this rank's stage holds it, and a :class:`Placeholder` (no
parameters, no computing: it returns its first argument) elsewhere. Hooks on the stage's blocks
make the run of them one stage call (:class:`~dapple_lightning.runtime.StageCall`):

* the stage's first block runs on what the executor received (on stages after the first),
  instead of its first positional argument; the side inputs are the step's own;
* the stage's last block hands its output to the executor, and ends the user's step with
  :class:`~dapple_lightning.runtime.StageExit` on every stage but the last;
* every block, placeholder or real, reports its call, so that a block called twice, out of
  order or not at all stops the first micro-batch with a message.

Only the first positional argument of a block and its output (a tensor or a tuple of tensors)
cross stages; the side inputs never do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dapple_lightning.runtime._stage import StageModule

__all__ = ["Placeholder", "stand_in_blocks"]


def _check_not_recomputed(index: int) -> None:
    if torch._C._current_graph_task_id() != -1:  # called by autograd: a checkpoint recomputes the block
        raise RuntimeError(
            f"block {index} of the pipelined ModuleList was recomputed during backward: activation checkpointing "
            "of the blocks of a pipelined ModuleList (torch.utils.checkpoint around a block, transformers' "
            "gradient_checkpointing_enable()) is not supported yet; checkpoint inside the block's layers instead "
            "(its attention or MLP), or put the blocks in an nn.Sequential"
        )


def _first_argument(index: int, args: tuple) -> Any:
    if not args:
        raise TypeError(
            f"block {index} of the pipelined ModuleList was called without a positional argument; dapple passes "
            "the activation from block to block as each block's first positional argument: call it as "
            "block(x, ...) with side inputs after x or as keywords"
        )
    return args[0]


class Placeholder(nn.Module):
    """Block ``index`` of another stage: returns its first argument, computes nothing, holds no parameters.

    Attributes the real block has and a placeholder lacks (a layer's ``attention_type``, say,
    which some models read in their loop) come from the real block, which stays on the meta device.
    """

    def __init__(self, index: int, real: nn.Module, stage: StageModule) -> None:
        super().__init__()
        self.index = index
        # Plain references, not submodules: the placeholder must own no parameters or state.
        self.__dict__["_real"] = real
        self.__dict__["_stage"] = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _check_not_recomputed(self.index)
        call = self.__dict__["_stage"].call
        if call is not None:
            call.block(self.index)
        return _first_argument(self.index, args)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = self.__dict__.get("_real")
            if real is None or name.startswith("__"):
                raise
            return getattr(real, name)

    def extra_repr(self) -> str:
        return f"block {self.index} of another stage"


def stand_in_blocks(
    blocks: nn.ModuleList, stage: StageModule, start: int, end: int
) -> tuple[nn.ModuleList, Callable[[], None]]:
    """The list that stands in for ``blocks`` on the rank of ``stage`` (its blocks ``[start, end)``),
    and a function that removes the hooks this puts on those blocks.

    The list is a plain ``nn.ModuleList`` of the user's length, so slicing, ``len``, indexing and
    iteration work as on one device, and its state-dict keys are those of the stage's blocks under
    their original indices.
    """
    handles = []
    elements: list[nn.Module] = []
    for index, block in enumerate(blocks):
        if not start <= index < end:
            elements.append(Placeholder(index, block, stage))
            continue
        pre, post = _hooks(index, stage, first=index == start, last=index == end - 1)
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
        elements.append(block)

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return nn.ModuleList(elements), remove


def _hooks(index: int, stage: StageModule, *, first: bool, last: bool) -> tuple[Callable, Callable]:
    """Forward hooks of the stage's block ``index``: the hand-off of a StageCall, spread over its blocks."""

    def pre(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        _check_not_recomputed(index)
        call = stage.call
        if call is None:  # outside a pipelined step: the block runs as written
            return None
        call.block(index)
        if not first:
            return None
        return (call.enter(_first_argument(index, args)), *args[1:]), kwargs

    def post(_: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        call = stage.call
        if call is None or not last:
            return None
        return call.leave(output)  # raises StageExit on every stage but the last

    return pre, post
