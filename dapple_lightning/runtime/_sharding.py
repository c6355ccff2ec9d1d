"""A stage whose replicas split its state among themselves (``shard:`` in the plan), with FSDP2.

Each layer of the stage that holds parameters becomes a ``torch.distributed.fsdp.fully_shard``
module over a one-dimensional device mesh of the stage's replica group, so that each replica keeps
``1 / r`` of every parameter, of its gradient and (the optimizer being built on the sharded
parameters) of its optimizer state:

* ``shard: full``: a layer's parameters are gathered before its forward and freed after it, and
  gathered again for its backward (FSDP2's ``reshard_after_forward=True``);
* ``shard: grads``: a layer's parameters are gathered by its first forward in a step and kept
  through the step's micro-batches, freed after the step's last backward; at rest between steps
  (and for the optimizer) they are sharded too.

Gradients are summed over the replicas by reduce-scatter, each replica keeping the sum of its
shard: the replicas' sum (not their mean, as the project's own reducer sums: each micro-batch's loss
is already its share of the global batch). Under ``shard: grads`` they accumulate whole over the
step's micro-batches and are summed once per step, one reduce-scatter per layer when the step's last
backward reaches it (as many collectives as the unsharded stage's all-reduce); under ``shard: full``
each micro-batch's backward sums its layer's gradients into the shards at once, so that no whole
gradient outlives its layer's backward (``M`` reduce-scatters per layer and step for ``M``
micro-batches on the stage, the memory of one layer instead of the stage's gradients).
:class:`ShardedReducer` takes the place of the stage's :class:`~dapple_lightning.runtime.GradientReducer`,
so the project's reducer never sums a sharded parameter as well.

Tied parameters across stages (summed over every rank) and hybrid sharding across nodes are
refused by :func:`shard_stage`'s callers before this point (see ``strategy._refusals``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = [
    "ShardedReducer",
    "follow_shards",
    "full_value",
    "local_part",
    "shard_like",
    "shard_stage",
    "sharded_layers",
    "unshard_stage",
]


def shard_stage(stage: nn.Module, mode: str, group: dist.ProcessGroup, device: torch.device) -> ShardedReducer:
    """Shard each of ``stage``'s layers that hold parameters over ``group`` (in place: the layers'
    parameters become ``DTensor`` shards); the reducer that sums their gradients once per step."""
    if any(isinstance(layer, FSDPModule) for layer in stage.children()):
        raise RuntimeError("the stage's layers are sharded already; shard a stage once")
    mesh = DeviceMesh.from_group(group, device.type)
    layers: list[FSDPModule] = []
    for layer in stage.children():
        if any(True for _ in layer.parameters()):
            layers.append(fully_shard(layer, mesh=mesh, reshard_after_forward=mode == "full"))
            _post_forward_first(layer)
    if not layers:
        raise ValueError("shard is set on a stage without parameters: there is nothing to split; drop `shard`")
    return ShardedReducer(layers, mode, group, device)


def _post_forward_first(layer: nn.Module) -> None:
    """FSDP2's forward hook runs before the layer's others: the stage's last layer hands its output to
    the executor in a forward hook that ends the user's step (``StageExit``), and FSDP2's hook must have
    freed the gathered parameters and readied their gather for the backward by then."""
    handle = layer._get_fsdp_state()._post_forward_hook_handle  # type: ignore[operator]
    layer._forward_hooks.move_to_end(handle.id, last=False)


def unshard_stage(stage: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
    """Undo :func:`shard_stage` (collective over the stage's replicas): every replica's layers hold their
    whole parameters again, as plain tensors, and are of their own classes, without FSDP2's hooks, as the
    user built them; ``optimizers`` then hold those parameters and their whole state (a save after
    ``fit`` reads both). FSDP2 has no public way back; this undoes what ``fully_shard`` set on the layer."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping

    replaced: dict[nn.Parameter, nn.Parameter] = {}
    for layer in sharded_layers(stage):
        whole = {name: full_value(p.detach()) for name, p in layer.named_parameters()}
        state = layer._get_fsdp_state()  # type: ignore[operator]
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
        group = state._fsdp_param_group
        if group is not None:
            for handles in (
                group._module_to_pre_save_state_dict_hook_handle,
                group._module_to_pre_load_state_dict_hook_handle,
            ):
                for handle in handles.values():
                    handle.remove()
                handles.clear()
            for param in group.fsdp_params:
                param._post_load_hook_handle.remove()
        for name, p in list(layer.named_parameters()):
            owner_path, _, attr = name.rpartition(".")
            owner = layer.get_submodule(owner_path)
            replaced[p] = owner._parameters[attr] = nn.Parameter(whole[name].clone(), requires_grad=p.requires_grad)
        for module in layer.modules():
            for key in ("_is_fsdp_managed_module", "_fsdp_use_orig_params", STATE_KEY, REGISTRY_KEY):
                module.__dict__.pop(key, None)
        _module_state_mapping.pop(layer, None)
        layer.__class__ = next(c for c in type(layer).__bases__ if not issubclass(c, FSDPModule))
    for optimizer in optimizers:
        _follow(optimizer, replaced, _gathered)


def follow_shards(
    stage: nn.Module, whole: Mapping[str, nn.Parameter], optimizers: Sequence[torch.optim.Optimizer]
) -> None:
    """``optimizers`` built on ``stage``'s ``whole`` parameters (by name, as they were before
    :func:`shard_stage`: an earlier ``fit``'s, which :func:`unshard_stage` left whole) on their shards
    instead, each state tensor of a parameter's shape cut as the parameter is (no collective: every
    replica holds the same whole state). Nothing then keeps the whole parameters alive, and
    :func:`unshard_stage` at the end finds the optimizers on the shards it gathers, as after ``fit``."""
    replaced = {
        whole[name]: p
        for name, p in stage.named_parameters()
        if isinstance(p, DTensor) and name in whole and whole[name] is not p
    }
    for optimizer in optimizers:
        _follow(optimizer, replaced, _cut_as)


def _follow(
    optimizer: torch.optim.Optimizer,
    replaced: Mapping[nn.Parameter, nn.Parameter],
    convert: Callable[[Tensor, nn.Parameter], Tensor],
) -> None:
    """``optimizer`` on the parameters that ``replaced`` its own, with each of their state tensors
    ``convert``-ed to the new parameter's layout."""
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(p, p) for p in group["params"]]
    state: dict[Tensor, dict] = {}
    for param, values in optimizer.state.items():
        new = replaced.get(param)
        state[param if new is None else new] = (
            values if new is None else {k: convert(v, new) if isinstance(v, Tensor) else v for k, v in values.items()}
        )
    optimizer.state = defaultdict(dict, state)


def _cut_as(value: Tensor, param: nn.Parameter) -> Tensor:
    """A state tensor of ``param``'s shape cut as ``param`` is; any other (Adam's step) as it is."""
    return shard_like(value, param) if value.shape == param.shape else value


def _gathered(value: Tensor, param: nn.Parameter) -> Tensor:
    """A state tensor whole (collective over the stage's replicas, which hold the same parameters in one order)."""
    return full_value(value)


def sharded_layers(stage: nn.Module) -> list[FSDPModule]:
    """The layers of ``stage`` that :func:`shard_stage` sharded."""
    return [layer for layer in stage.children() if isinstance(layer, FSDPModule)]


class ShardedReducer:
    """The gradient sum of a sharded stage, with the interface of
    :class:`~dapple_lightning.runtime.GradientReducer`: :meth:`arm` before the step's last backward on
    this rank (its layers then reduce-scatter as that backward reaches them), :meth:`finish` after it.

    Until :meth:`arm`, under ``shard: grads`` each backward adds to the layers' whole gradients without
    any collective and keeps the gathered parameters for the next micro-batch; under ``shard: full``
    every backward sums into the shards (see the module's docstring).
    """

    def __init__(self, layers: list[FSDPModule], mode: str, group: dist.ProcessGroup, device: torch.device) -> None:
        self.layers, self.mode, self.group, self.device = layers, mode, group, device
        for layer in layers:
            # A sum over the replicas, as GradientReducer's, by a plain SUM (gloo has no pre-multiplied sum).
            layer.set_gradient_divide_factor(1.0)
            layer.set_force_sum_reduction_for_comms(True)
        self._extra: Callable[[], Tensor] | None = None
        self._accumulate()

    def _accumulate(self) -> None:
        """Until :meth:`arm`: under ``shard: full`` every backward sums its gradients into shards (the
        stage never holds a whole gradient beyond a layer's); under ``shard: grads`` they accumulate
        whole, with the gathered parameters kept, until the step's last backward sums them once."""
        full = self.mode == "full"
        for layer in self.layers:
            layer.set_requires_gradient_sync(full, recurse=False)
            layer.set_reshard_after_backward(full, recurse=False)

    def begin(self, train: bool) -> None:
        """A step starts. An evaluation step gathers each layer for its forward and frees it after, under
        either mode: nothing it gathers (under Lightning, in inference mode) outlives it; a training step
        under ``shard: grads`` keeps what its forwards gather until its last backward."""
        for layer in self.layers:
            layer.reshard()
            layer.set_reshard_after_forward(not train or self.mode == "full", recurse=False)

    def arm(self, extra: Callable[[], Tensor] | None = None) -> None:
        """The next backward is the step's last on this rank: its layers sum their gradients into shards."""
        self._extra = extra
        for layer in self.layers:
            layer.set_requires_gradient_sync(True, recurse=False)
            layer.set_reshard_after_backward(True, recurse=False)

    def finish(self) -> Tensor | None:
        """The step's gradients are summed (FSDP2 waited for its reduce-scatters at the end of the
        backward); sums what :meth:`arm`'s ``extra`` gives over the replicas (float64)."""
        extra, self._extra = self._extra, None
        self._accumulate()
        if extra is None:
            return None
        summed = extra().to(device=self.device, dtype=torch.float64).reshape(-1)
        dist.all_reduce(summed, group=self.group)
        return summed

    def abandon(self) -> None:
        """The step failed: the next one starts accumulating again."""
        self._extra = None
        self._accumulate()

    def remove(self) -> None:
        """Nothing to remove: the layers stay sharded for as long as the stage lives."""


def full_value(value: Tensor) -> Tensor:
    """``value`` whole: a ``DTensor`` shard gathered over its mesh (collective over the stage's replicas),
    anything else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def shard_like(full: Tensor, like: Tensor) -> Tensor:
    """``full`` cut as ``like`` (a ``DTensor``) is cut, from a copy every replica holds (no collective);
    ``full`` itself when ``like`` is a plain tensor."""
    if not isinstance(like, DTensor):
        return full
    return distribute_tensor(full.to(like.device, like.dtype), like.device_mesh, like.placements, src_data_rank=None)


def local_part(value: Tensor) -> Tensor:
    """``value``'s values on this rank: a ``DTensor``'s local shard, anything else as it is."""
    return value.to_local() if isinstance(value, DTensor) else value
