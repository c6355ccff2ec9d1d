"""The stage module that stands in for the user's container, and its hand-off with the executor.

The user's own step function calls the container once per micro-batch; after surgery it calls
a :class:`StageModule` holding only this rank's layers. During a pipelined step the executor
runs each micro-batch inside :meth:`StageModule.calling` with a :class:`StageCall`, and that
object is the whole hand-off between the two:

* on the first stage the call runs the local layers on the argument the step passes;
* on later stages it ignores that argument and runs them on what the executor ``received``;
* it records the inputs and outputs the executor sends and back-propagates, and on every stage
  but the last ends the rest of the user's step with :class:`StageExit` (no loss to compute).

With an ``nn.ModuleList`` container, or a chain of several containers, the user's code calls
the layers one by one instead: the same call is then entered where the stage begins and left at
its last layer (:meth:`StageCall.enter`, :meth:`StageCall.leave`), and every layer's call is
checked against the order (:meth:`StageCall.block`); see :mod:`~dapple_lightning.runtime._blocks`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dapple_lightning.runtime._offload import Offloader

__all__ = ["StageCall", "StageExit", "StageModule", "count_saved"]

Activation = torch.Tensor | tuple[torch.Tensor, ...]


class StageExit(BaseException):
    """Ends the user's step on ranks that do not hold the last stage.

    Derived from ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """


def as_tensors(value: Any, where: str) -> tuple[list[torch.Tensor], bool]:
    """``value`` (a tensor or a tuple of tensors) as a list, and whether it was a tuple."""
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, tuple | list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value), True
    raise TypeError(_not_an_activation(value, where))


_RULE = "what flows between pipeline stages must be a tensor or a tuple of tensors, each with the batch in dim 0"


def _not_an_activation(value: Any, where: str) -> str:
    """The refusal of ``value`` as an activation: which item breaks the rule, and what would pass."""
    kind = type(value).__name__
    if not isinstance(value, tuple | list):
        return (
            f"{where} is of type {kind}; {_RULE} (return the tensors from the layer; pass other values as side inputs)"
        )
    if not value:
        return f"{where} is an empty {kind}; {_RULE}"
    rows = next((v.shape[0] for v in value if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    culprit = next(i for i, v in enumerate(value) if not isinstance(v, torch.Tensor))
    listed = "; ".join(f"item {i}: {_describe(v, rows)}" for i, v in enumerate(value))
    fitting = [i for i, v in enumerate(value) if _fits(v, rows)]
    passes = f"the tuple of items {fitting} would pass" if fitting else "a tuple of per-row tensors would pass"
    return (
        f"{where} is a {len(value)}-item {kind} whose item {culprit} is {_describe(value[culprit], rows)}, not a "
        f"tensor ({listed}); {_RULE}: {passes}. Return only those from the layer and compute the rest (None, flags, "
        "a value shared by every row) on every rank, as a side input of the next layers"
    )


def _fits(value: Any, rows: int | None) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == rows


def _describe(value: Any, rows: int | None) -> str:
    if not isinstance(value, torch.Tensor):
        return "None" if value is None else f"of type {type(value).__name__}"
    shape = f"a tensor of shape {tuple(value.shape)}"
    if value.dim() == 0:
        return f"{shape}, with no batch dim"
    return shape if value.shape[0] == rows else f"{shape}, whose dim 0 is not the batch's {rows} rows"


def _fresh(received: torch.Tensor) -> torch.Tensor:
    """What the stage's code runs on in place of ``received``, a leaf that collects its gradient.

    A leaf that requires grad cannot be modified in place, and a stage may well begin with
    ``ReLU(inplace=True)``, which on one device runs on a layer's output: the code gets a copy,
    and the leaf gives up its memory (autograd needs only its shape to give it a gradient).
    """
    if not received.requires_grad:
        return received
    copy = received.clone()
    received.untyped_storage().resize_(0)
    return copy


@dataclass
class StageCall:
    """One micro-batch's pass through a :class:`StageModule` during a pipelined step.

    The executor creates it with what the stage received (nothing on the first stage) and reads
    back what the stage ran on and what it made once the user's step returns.
    """

    stage: int
    first: bool
    last: bool
    received: list[torch.Tensor] = field(default_factory=list)
    received_tuple: bool = False
    inputs: list[torch.Tensor] = field(default_factory=list)
    """What the local layers ran on (the step's argument on the first stage)."""
    outputs: list[torch.Tensor] | None = None
    output_tuple: bool = False
    calls: int = 0
    blocks: int | None = None
    """When the user's code calls the layers one by one: how many there are (``None`` for one Sequential)."""
    names: tuple[str, ...] | None = None
    """The layers' paths in the model, for messages, when they come from a chain of containers."""
    next_block: int = 0
    """When the user's code calls the layers one by one: the one it must call next."""
    layers: Sequence[nn.Module] | None = None
    """Where the rank holds several stages (chunks) in one module: the layers of this call's stage
    (``None``: all of the module's)."""

    def run(self, layers: Callable[[Activation], Any], arg: Any) -> Any:
        """Run the stage as one call (a Sequential's layers) on ``arg`` or what was received."""
        return self.leave(layers(self.enter(arg)))

    def enter(self, arg: Any) -> Activation:
        """What the stage's first layer runs on: the step's ``arg`` on the first stage, else what was received."""
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError(
                "training_step/validation_step called the pipelined Sequential more than once for one batch; "
                "dapple needs each step to pass the batch through the Sequential exactly once"
            )
        if self.first:
            container = "Sequential" if self.blocks is None else "ModuleList's first block"
            self.inputs, as_tuple = as_tensors(arg, f"the input of the pipelined {container}")
            values = self.inputs
        else:
            self.inputs, as_tuple = self.received, self.received_tuple
            values = [_fresh(t) for t in self.inputs]
        return tuple(values) if as_tuple else values[0]

    def leave(self, out: Any) -> Any:
        """Record the stage's output for the executor; end the user's step unless this is the last stage."""
        self.outputs, self.output_tuple = as_tensors(out, f"the output of stage {self.stage}")
        if not self.last:
            raise StageExit
        return out

    def _layer(self, index: int) -> str:
        return f"block {index}" if self.names is None else f"layer {self.names[index]!r}"

    def _rule(self) -> str:
        if self.names is None:
            return "dapple needs forward to call every block of the pipelined ModuleList once per micro-batch, in order"
        return (
            "dapple needs forward to call every layer of the pipelined containers once per micro-batch, in order "
            "(the containers in the order they were named)"
        )

    def block(self, index: int) -> None:
        """Forward calls layer ``index`` (any stage's): it must be the next one."""
        if index == self.next_block:
            self.next_block += 1
            return
        if index < self.next_block:
            raise RuntimeError(
                f"{self._layer(index)} was called again after {self._layer(self.next_block - 1)}; {self._rule()}"
            )
        raise RuntimeError(f"{self._layer(index)} was called before {self._layer(self.next_block)}; {self._rule()}")

    def check_called(self) -> None:
        """Once the user's step is over: refuse a step that skipped the stage (or, on the last stage, layers)."""
        if self.blocks is None:
            if self.calls == 0:
                raise RuntimeError(
                    "training_step/validation_step did not call the pipelined Sequential; dapple needs each step to "
                    "pass the batch through the Sequential exactly once"
                )
            return
        if self.outputs is None:  # the stage's last layer never ran
            what = "blocks of the pipelined ModuleList" if self.names is None else "layers of the pipelined containers"
            raise RuntimeError(
                f"training_step/validation_step called {self.next_block} of the {self.blocks} {what}; {self._rule()}"
            )


class StageModule(nn.Sequential):
    """The layers ``[start, end)`` of the user's Sequential that live on this rank.

    Children keep their indices in the original Sequential as names (``"6"``, ``"7"``, ...),
    so ``state_dict`` keys equal those of the unpartitioned model. Outside a pipelined step
    (:attr:`call` is ``None``) it behaves like that slice of the Sequential.
    """

    def __init__(
        self,
        layers: Sequence[tuple[str, nn.Module]],
        *,
        blocks: int | None = None,
        names: Sequence[str] | None = None,
        recompute: bool = False,
        offload: int | str | None = None,
    ) -> None:
        super().__init__(OrderedDict(layers))
        if recompute:
            _check_recomputable(self, blocks)
        self.recompute = recompute
        """Run each layer under non-reentrant ``torch.utils.checkpoint`` while autograd records:
        a micro-batch keeps only the layers' inputs, and its backward runs each layer again."""
        self.offload = None if offload is None else _offloader(self, blocks, offload)
        """With ``offload: W`` (or ``"auto"``): keeps the layers on disk, ``W`` of them in memory (:class:`Offloader`)."""
        self._call: StageCall | None = None
        self.blocks = blocks
        """``None`` when the module stands in for one Sequential. When the user's code calls the
        layers one by one (a ModuleList's blocks, a chain of containers), how many layers the plan
        indexes: the module then only holds the stage's layers (see
        :func:`~dapple_lightning.runtime.stand_in_layers`)."""
        self.names = tuple(names) if names is not None else None
        """For a chain of containers, every layer's path in the model (for messages)."""
        self.on_call: list[Callable[[StageCall | None], None]] = []
        """Called with each call as it begins and with ``None`` as it ends (the stand-ins of a rank
        holding several stages switch to the call's stage's layers)."""
        self.shared: tuple[nn.Parameter, ...] = ()
        """Parameters of the stage's layers that other stages' layers or modules outside the
        containers share (tied weights): every rank holds them, and their gradients are summed
        over every rank rather than over the stage's replicas."""

    @property
    def call(self) -> StageCall | None:
        """The micro-batch passing through now, inside :meth:`calling`; ``None`` elsewhere."""
        return self._call

    @contextmanager
    def calling(self, call: StageCall) -> Iterator[StageCall]:
        """Inside this block (one micro-batch of a pipelined step), calls of the module go through ``call``."""
        self._call = call
        for switch in self.on_call:
            switch(call)
        try:
            yield call
        finally:
            self._call = None
            for switch in self.on_call:
                switch(None)

    def forward(self, input: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:  # called by autograd: a checkpoint recomputes
            raise RuntimeError(
                "the pipelined Sequential was called again during backward: activation checkpointing "
                "(torch.utils.checkpoint) around the whole container is not supported, because the pipeline "
                "runs and back-propagates its layers itself. Checkpoint inside the layers instead (wrap each "
                "block's forward, or use transformers' gradient_checkpointing_enable())"
            )
        if self._call is None:
            return self._layers(input)
        return self._call.run(self._layers, input)

    def _layers(self, input: Any) -> Any:
        call = self._call
        if call is not None and call.layers is not None:  # one of the rank's several stages
            for layer in call.layers:
                input = layer(input)
            return input
        if self.offload is not None:
            return self._offloaded(input, self.offload)
        if not (self.recompute and torch.is_grad_enabled()):
            return super().forward(input)
        for layer in self:
            # The RNG state is kept for the recomputation, so dropout drops the same units.
            input = checkpoint(layer, input, use_reentrant=False)
        return input

    def _offloaded(self, input: Any, offload: Offloader) -> Any:
        with offload.saving():
            for index, layer in enumerate(self):
                offload.forward(index)
                input = layer(input)
                if torch.is_grad_enabled():
                    offload.watch(index, input)
        offload.forward_done()
        return input

    def _read_back(self, *args: Any) -> None:
        """Before the module's state is read or loaded: the offloaded layers come back into memory."""
        if self.offload is not None:  # a copy keeps the hook and holds its values itself
            self.offload.materialize()

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Refused: the stage's forward hands tensors to and from the pipeline (a compiled one fails in
        its first step); its layers compile (see docs/models.md)."""
        raise RuntimeError(
            "dapple: the pipelined container cannot be compiled as a whole: its forward hands tensors to and from "
            "the pipeline. Compile its blocks instead, e.g. `for block in self.layers: block.compile()`"
        )

    def __getstate__(self) -> dict[str, Any]:
        if self.offload is not None:  # a copy holds the values, in memory (the files stay this module's)
            self.offload.materialize()
        state = super().__getstate__()
        state["_call"] = None  # a step's tensors are not the module's state
        state["on_call"] = []  # the stand-ins' switches belong to this module's cut
        state["offload"] = None
        return state


def _offloader(stage: StageModule, blocks: int | None, window: int | str) -> Offloader:
    if blocks is not None:
        raise ValueError(
            "a stage with offload needs the pipelined layers in one nn.Sequential; with a ModuleList or a chain of "
            "containers your code calls the layers, and the window cannot follow them: leave offload off there"
        )
    stage.register_state_dict_pre_hook(stage._read_back)
    stage.register_load_state_dict_pre_hook(stage._read_back)
    return Offloader(list(stage), window)


def _check_recomputable(stage: nn.Module, blocks: int | None) -> None:
    """Refuse a recomputing stage the runtime cannot recompute faithfully."""
    if blocks is not None:
        raise ValueError(
            "a stage with recompute: true needs the pipelined layers in one nn.Sequential; with a ModuleList "
            "or a chain of containers your code calls the layers, so checkpoint inside them instead"
        )
    for name, module in stage.named_modules():
        if getattr(module, "track_running_stats", False) and getattr(module, "running_mean", None) is not None:
            raise ValueError(
                f"layer {name!r} of a stage with recompute: true tracks running statistics ({type(module).__name__}), "
                "which its recomputation would update twice; leave recompute off for that stage"
            )


def count_saved(params: set[int], saved: dict[int, int]) -> torch.autograd.graph.saved_tensors_hooks:
    """Saved-tensor hooks that record in ``saved`` the bytes of each storage autograd saves
    (by data pointer, once), except the parameters' (``params``: their data pointers)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            saved.setdefault(ptr, storage.nbytes())
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
