"""Layers that the user's own code calls one by one, handed to the pipeline layer by layer.

With one ``nn.Sequential`` container the user's step calls the stage once (a
:class:`~dapple_lightning.runtime.StageModule` stands in for it). With an ``nn.ModuleList`` of
blocks that forward loops over, or a chain of several containers with code between them, the
user's code calls every layer itself, with side inputs it computes on every rank::

    x = self.features(x)                    # an nn.Sequential calls its layers in turn
    x = torch.flatten(self.avgpool(x), 1)   # code between containers
    x = self.classifier(x)
    for block in self.blocks:               # a loop calls each block of an nn.ModuleList
        x = block(x, mask, position_ids=pos)

:func:`stand_in_layers` builds, for each container, a stand-in of the container's own class in
which layer ``i`` is the real layer where this rank's stage holds it and a :class:`Placeholder`
(no parameters, no computing) elsewhere. Hooks make the run of the stage's layers one stage call
(:class:`~dapple_lightning.runtime.StageCall`):

* on stages after the first, the placeholder of the previous stage's last layer returns what
  the executor received, as that layer's output: the user's code between the two stages
  (pooling and flattening, unpacking a block's tuple) then runs on it as on one device;
* the stage's last layer hands its output to the executor, and ends the user's step with
  :class:`~dapple_lightning.runtime.StageExit` on every stage but the last;
* every layer, placeholder or real, reports its call, so that a layer called twice, out of
  order or not at all stops the first micro-batch with a message.

Only a layer's output (a tensor or a tuple of tensors) crosses stages; side inputs never do.
The other placeholders return their first argument: code that runs before the stage's entry
works on stand-in values, and what it makes of them is dropped at the entry.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from dapple_lightning.runtime._stage import StageCall, StageModule

__all__ = ["Placeholder", "stand_in_layers"]


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
    """Layer ``index`` of another stage: computes nothing, holds no parameters.

    It returns its first argument, or, as the ``entry`` of a stage after the first (the previous
    stage's last layer), what the stage received. Attributes the real layer has and a placeholder
    lacks (a layer's ``attention_type``, say, which some models read in their loop) come from the
    real layer, which stays on the meta device.
    """

    def __init__(self, index: int, real: nn.Module, stage: StageModule, *, entry: bool = False) -> None:
        super().__init__()
        self.index = index
        self.entry = entry
        # Plain references, not submodules: the placeholder must own no parameters or state.
        self.__dict__["_real"] = real
        self.__dict__["_stage"] = stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        _check_not_recomputed(self.index)
        call = self.__dict__["_stage"].call
        if call is None:
            return _first_argument(self.index, args)
        call.block(self.index)
        if self.entry:
            return call.enter(None)
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
        role = ", the entry of this rank's stage" if self.entry else ""
        return f"layer {self.index} of another stage{role}"


def stand_in_layers(
    containers: Sequence[nn.Module], stage: StageModule, ranges: Mapping[int, tuple[int, int]]
) -> tuple[list[nn.Module], Callable[[], None]]:
    """A stand-in for each of ``containers`` (whose children, in order, are a plan's layers) on
    the rank of ``stage``, whose stages hold the layers ``ranges`` gives (``[start, end)`` per
    stage), and a function that removes the hooks this puts on the stage's layers.

    A stand-in is a shallow copy of its container, of the same class, with the same names and
    length: slicing, ``len``, indexing, iteration and the container's own ``forward`` work as on
    one device, and its state-dict keys are those of the rank's layers under their original
    names. Where the rank holds several stages (chunks), each stand-in holds, while a micro-batch
    of one of them runs, that stage's layers and placeholders everywhere else, the other stages'
    layers of this rank included (they must not compute, nor draw random numbers); outside a step
    it holds all of the rank's layers.
    """
    handles = []
    views: dict[int, list[OrderedDict[str, nn.Module]]] = {s: [] for s in ranges}
    whole: list[OrderedDict[str, nn.Module]] = []
    owner = {i: s for s, (start, end) in ranges.items() for i in range(start, end)}
    index = 0
    for container in containers:
        for view in views.values():
            view.append(OrderedDict())
        whole.append(OrderedDict())
        for name, layer in container.named_children():
            if index in owner:
                start, end = ranges[owner[index]]
                pre, post = _hooks(index, stage, first=index == start, last=index == end - 1)
                handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
                handles.append(layer.register_forward_hook(post, with_kwargs=True))
                whole[-1][name] = layer
            else:
                whole[-1][name] = Placeholder(index, layer, stage)
            for s, view in views.items():
                start, end = ranges[s]
                real = start <= index < end
                view[-1][name] = layer if real else Placeholder(index, layer, stage, entry=index == start - 1)
            index += 1
    chunked = len(views) > 1
    if not chunked:  # one stage: its view is the whole, nothing to switch
        (whole,) = views.values()
    stand_ins = [copy.copy(container) for container in containers]
    for stand_in, elements in zip(stand_ins, whole, strict=True):
        stand_in.__dict__["_modules"] = elements

    def switch(call: StageCall | None) -> None:
        chosen = whole if call is None else views[call.stage]
        for stand_in, elements in zip(stand_ins, chosen, strict=True):
            stand_in.__dict__["_modules"] = elements

    if chunked:
        stage.on_call.append(switch)

    def remove() -> None:
        if chunked:
            stage.on_call.remove(switch)
        for handle in handles:
            handle.remove()

    return stand_ins, remove


def _hooks(index: int, stage: StageModule, *, first: bool, last: bool) -> tuple[Callable, Callable]:
    """Forward hooks of the stage's layer ``index``: the hand-off of a StageCall, spread over its layers."""

    def pre(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        _check_not_recomputed(index)
        call = stage.call
        if call is None:  # outside a pipelined step: the layer runs as written
            return None
        call.block(index)
        if not (first and call.first):  # later stages entered at the previous stage's placeholder
            return None
        return (call.enter(_first_argument(index, args)), *args[1:]), kwargs

    def post(_: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        call = stage.call
        if call is None or not last:
            return None
        return call.leave(output)  # raises StageExit on every stage but the last

    return pre, post
