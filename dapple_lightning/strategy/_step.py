"""One global batch under a plan, as Lightning's automatic optimization expects one step.

Lightning runs, per optimizer step, ``training_step``, then ``zero_grad``, then the strategy's
``backward``, then the optimizer step. A pipeline schedule runs its backwards inside
``training_step``, so the ``zero_grad`` that follows would erase them. :meth:`PipelinedSteps.train`
therefore sets aside the gradients already present (with ``accumulate_grad_batches`` they still
count), runs the schedule, moves its fresh gradients aside and puts the earlier ones back;
:meth:`PipelinedSteps.add_fresh_gradients`, called from the strategy's ``backward``, adds them.

Per micro-batch the user's step runs once, on the slice that :mod:`dapple_lightning.microbatch`
cuts; its loss is scaled by the micro-batch's share of the global batch, and what it logs is
captured and combined by each value's ``reduce_fx`` into global-batch values known on every
rank (the last stage's replicas sum their shares along with their gradients, then share them).
A ``predict_step``'s outputs are joined back into the batch's, in row order, on every rank.

Losses and logged values stay on the device until the step's end: reading one on the host
(``float(loss)``, ``.item()``) makes the host wait for the device, and on a GPU the host would
then never queue the next micro-batch's work while the device still runs this one. They are
summed there in float64 and copied to the host once per step, as one vector.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from dapple_lightning.microbatch import Rows, batch_size_of, concat_slices, map_tensors, slice_batch
from dapple_lightning.runtime import Pending, Pipeline, StageCall, StageModule, local_part, share
from dapple_lightning.strategy._batch_leaves import LeafMoves, plain
from dapple_lightning.strategy._checkpoint import keep_local
from dapple_lightning.strategy._lightning import Patches, shadowed_log, transfer_batch

__all__ = ["PipelinedSteps", "clip_grad_norm_over_stages", "local_optimizers", "to_cpu"]

Logged = dict[str, tuple[float, dict]]
"""Logged values by name: the global batch's value and the ``self.log`` keyword arguments."""


def local_optimizers(patches: Patches, optimizers: list[Optimizer], module: nn.Module, stage: StageModule) -> None:
    """Each rank's optimizers step its own parameters: other stages' leave the param groups
    (:func:`keep_local`), and an offloaded stage's layers step one at a time where their state lives.

    Lightning steps an optimizer with ``optimizer.step(closure=...)``, whose closure runs the
    training step (the pipeline) and the backward. With ``offload`` on the stage, each optimizer's
    ``step`` runs the closure, then lets the stage's offloader step the optimizer over the other
    parameters and then one layer at a time, with that layer's parameters, gradients and state
    read in from disk (:meth:`~dapple_lightning.runtime.Offloader.step`); ``patches`` records that
    ``step``, which the strategy's teardown puts back.
    """
    keep_local(optimizers, module)
    offloader = stage.offload
    if offloader is None:
        return
    offloader.attach(optimizers)
    for optimizer in optimizers:
        original = optimizer.step

        def step(closure: Any = None, *, _original: Any = original, _optimizer: Optimizer = optimizer) -> Any:
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            offloader.step(_optimizer, _original)
            return loss

        patches.set(optimizer, "step", step)


class PipelinedSteps:
    """The user's step hooks (training, validation, predict) run on one global batch through a pipeline,
    one micro-batch at a time, and combined into what one device's call gives: the loss, the logged
    values, the outputs, and the gradients set aside for Lightning's own backward."""

    def __init__(self, module: Any, device: torch.device, *, lazy_batch: bool | None = None) -> None:
        self.module, self.device = module, device
        self.shared = Pending()
        """The last stage's loss broadcasts, in flight until the next step needs the buffers."""
        self.dataloader_idx: int | None = None
        """Set while the global batch is on the host (see :meth:`_on_device`): its loader's index."""
        self._fresh: dict[nn.Parameter, Tensor | None] = {}
        self.leaves = LeafMoves(device, device.type == "cuda" if lazy_batch is None else lazy_batch)
        """The micro-batches' tensors moved on first read (on CUDA by default), and the bytes moved."""

    def train(self, pipeline: Pipeline, args: tuple, kwargs: dict, context: Callable) -> Tensor:
        """Lightning's ``training_step``: run the schedule, keep its gradients aside, log, return the loss."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        stashed = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        loss, logged = self.run(pipeline, "training_step", args, kwargs, train=True, context=context)
        self._fresh = {p: p.grad for p in params}
        for p in params:
            p.grad = stashed[p]
        self.log(logged)
        return torch.full((), loss, device=self.device)  # filled on the device: no copy from the host

    def add_fresh_gradients(self, scale: float) -> None:
        """Lightning's ``backward``: add the step's gradients (times ``scale``) into ``.grad``."""
        for p, fresh in self._fresh.items():
            if fresh is None:
                continue
            fresh = fresh * scale if scale != 1.0 else fresh
            p.grad = fresh if p.grad is None else p.grad + fresh
        self._fresh = {}

    def evaluate(self, pipeline: Pipeline, hook: str, args: tuple, kwargs: dict, context: Callable) -> Any:
        """A forward-only step; ``predict_step`` returns the whole batch's predictions in row order on every rank."""
        outputs: list[tuple[Rows, Any]] = []
        _, logged = self.run(pipeline, hook, args, kwargs, train=False, context=context, outputs=outputs)
        self.log(logged)
        if hook != "predict_step":
            return None
        # Only last-stage ranks hold outputs, one per micro-batch slice; join them in row order.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [(rows, to_cpu(out)) for rows, out in outputs])
        pieces = sorted((p for part in gathered for p in part), key=lambda p: p[0].start)
        return concat_slices([out for _, out in pieces], [len(rows) for rows, _ in pieces], "predict_step's output")

    def run(
        self,
        pipeline: Pipeline,
        hook: str,
        args: tuple,
        kwargs: dict,
        *,
        train: bool,
        context: Callable,
        outputs: list[tuple[Rows, Any]] | None = None,
    ) -> tuple[float, Logged]:
        """Run the user's ``hook`` over one global batch on ``pipeline``; the global loss and logged values."""
        module = self.module
        last = pipeline.plan.stages[-1]
        total = batch_size_of(args[0])
        capture = _LogCapture(total, last.replicas, pipeline.replica if pipeline.is_last else 0, self.device)
        step = _HookStep(self, pipeline, hook, args, kwargs, capture, train, context, outputs)
        self.leaves.begin_step(pipeline.plan)
        with shadowed_log(module, capture.log):
            stats = pipeline.run(total, step, train=train)
        stats.batch_bytes_moved = self.leaves.moved_bytes
        if pipeline.replaying:  # its loss and logs were shared when the step first ran
            return 0.0, {}
        return self._combine(pipeline, step.loss_sum, capture, stats.replica_sum)

    def _combine(
        self, pipeline: Pipeline, loss: Tensor | None, capture: _LogCapture, summed: Tensor | None
    ) -> tuple[float, Logged]:
        """Combine the last stage's replicas' shares (``summed`` when they rode along with the
        gradients) into the global batch's loss and logged values; share them with every rank."""
        plan = pipeline.plan
        last_ranks = plan.stage_ranks(plan.num_stages - 1)
        values: Logged = {}
        total = 0.0
        if pipeline.is_last:
            if len(last_ranks) == 1:
                summed = capture.flatten(loss)
            elif summed is None:  # an evaluation step: no gradients to ride along with
                summed = capture.flatten(loss)
                dist.all_reduce(summed, group=pipeline.stage_group)
            total, values = capture.unflatten(summed)  # the step's one copy to the host
        if dist.get_world_size() > len(last_ranks):  # ranks outside the last stage learn the values
            self.shared.wait()  # the previous step's, long done
            total, values = share((total, values), last_ranks[0], self.device, self.shared, group=pipeline.host_group)
        return total, values

    def _on_device(self, rows: Any, hook: str) -> Any:
        """A micro-batch's rows through the module's transfer hooks (``transfer_batch_to_device``, then
        ``on_after_batch_transfer``) when the global batch stayed on the host: each rank moves only the
        rows it computes, and Lightning's callbacks still see the whole batch. On CUDA (by default) each
        tensor of the rows is copied when ``hook`` first reads it on this rank (:mod:`._batch_leaves`): a stage
        copies only what its step reads."""
        if self.dataloader_idx is None:
            return rows
        moved = transfer_batch(self.module, self.leaves.host_leaves(rows, hook), self.device, self.dataloader_idx)
        return plain(moved) if self.leaves.lazy else moved

    def pinned(self, batch: Any) -> Any:
        """The step's global batch for its micro-batches' copies: on CUDA, while it stays on the host,
        in page-locked memory, once per step. A copy to the device from pageable memory goes through
        a staging buffer and returns when it is done, however ``non_blocking``; from page-locked
        memory the copy is queued and the host runs on (Lightning's transfer copies ``non_blocking``).
        Callbacks and hooks see the batch as loaded; elsewhere it is used as it is."""
        if self.device.type != "cuda" or self.dataloader_idx is None:
            return batch
        return map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t)

    def log(self, values: Logged) -> None:
        for name, (value, kwargs) in values.items():
            self.module.log(name, torch.tensor(value, dtype=torch.float32), **kwargs)


class _HookStep:
    """One global batch of a LightningModule hook, as the pipeline asks for it (a
    :class:`~dapple_lightning.runtime.UserStep`): the hook per micro-batch, on the micro-batch's rows
    moved to the device, with what it logs captured."""

    def __init__(
        self,
        steps: PipelinedSteps,
        pipeline: Pipeline,
        hook: str,
        args: tuple,
        kwargs: dict,
        capture: _LogCapture,
        train: bool,
        context: Callable,
        outputs: list[tuple[Rows, Any]] | None,
    ) -> None:
        self.steps, self.pipeline, self.capture = steps, pipeline, capture
        self.name, self.hook = hook, getattr(steps.module, hook)
        self.batch, self.rest, self.kwargs = steps.pinned(args[0]), args[1:], kwargs
        self.total = capture.batch_rows
        self.train, self._context, self.outputs = train, context, outputs
        self.loss_sum: Tensor | None = None
        """This replica's share of the batch's loss so far, in float64 on the device."""

    def run(self, micro_batch: int, rows: Rows) -> Tensor | None:
        weight = len(rows) / self.total
        self.capture.begin(micro_batch, weight)
        try:
            on_device = self.steps._on_device(slice_batch(self.batch, rows), self.name)
            out = self.hook(on_device, *self.rest, **self.kwargs)
        finally:  # also when the step ends at this stage's exit
            if self.pipeline.is_first:
                _check_input_rows(self.pipeline.module.call, micro_batch, rows, self.total)
        if not self.train:
            if self.outputs is not None:
                self.outputs.append((rows, out))
            return None
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor):
            raise RuntimeError(
                f"training_step returned {type(out).__name__}; with dapple it must return the loss tensor "
                "(or a dict with 'loss') for every micro-batch"
            )
        part = _as_float64(loss, self.steps.device) * weight
        self.loss_sum = part if self.loss_sum is None else self.loss_sum + part
        return loss * weight

    def context(self) -> AbstractContextManager[Any]:
        return self._context()

    def replica_share(self) -> Tensor:
        """The loss and the logged values of this replica's rows, summed over the last stage's replicas."""
        return self.capture.flatten(self.loss_sum)


_REDUCTIONS: dict[Any, str] = {
    **{name: name for name in ("mean", "sum", "max", "min")},
    "avg": "mean",
    torch.mean: "mean",
    torch.sum: "sum",
    sum: "sum",
    torch.max: "max",
    max: "max",
    torch.min: "min",
    min: "min",
}
"""``self.log``'s ``reduce_fx`` values Lightning accepts, and the reduction each names."""


def _reduction(name: str, reduce_fx: Any) -> str:
    try:
        found = _REDUCTIONS.get(reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx)
    except TypeError:  # unhashable
        found = None
    if found is None:
        raise ValueError(
            f"self.log({name!r}, ..., reduce_fx={reduce_fx!r}): dapple combines a value logged per micro-batch into "
            "the global batch's value exactly for reduce_fx 'mean' (weighted by rows), 'sum', 'max' and 'min' only, "
            "as Lightning accepts; reduce the batch yourself and log the result with one of them"
        )
    return found


def _reduce_on(device: torch.device, how: str, values: list[Tensor | float]) -> Tensor:
    """A name's micro-batch values combined by its ``reduce_fx``, in float64 on the device, where they stay."""
    if how == "mean":  # the values are already weighted by their rows' share of the batch
        how = "sum"
    stacked = torch.stack(
        [v if isinstance(v, Tensor) else torch.full((), v, dtype=torch.float64, device=device) for v in values]
    )
    return getattr(torch, how)(stacked)


def _across_replicas(how: str, values: list[float]) -> float:
    """The replicas' results of one name, on the host: a sum or mean arrives summed already (one value),
    a max or min as one slot per replica (NaN wins, as in ``torch.max``)."""
    if how in ("mean", "sum"):
        (value,) = values
        return value
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values) if how == "max" else min(values)


def _as_float64(value: Tensor, device: torch.device) -> Tensor:
    """A one-element tensor as a float64 scalar on ``device``, without reading it on the host."""
    return value.detach().to(device=device, dtype=torch.float64).reshape(())


class _LogCapture:
    """Collects what the user's step logs in each micro-batch and combines it into the batch's value.

    Per name, a micro-batch's last value counts, as a step's does on one device. The micro-batch
    values combine by the name's ``reduce_fx``, and so do the last stage's replicas' results:

    ========== ===================================== =====================================
    reduce_fx  micro-batches on one replica          the last stage's replicas
    ========== ===================================== =====================================
    mean       sum of value x rows / batch rows      sum
    sum        sum                                   sum
    max, min   max, min                              one slot each in the sum, then max, min
    ========== ===================================== =====================================

    The result is one device's value when the step logs a mean (sum, max, min) over its rows.
    """

    def __init__(self, batch_rows: int, replicas: int, replica: int, device: torch.device) -> None:
        self.batch_rows, self.replicas, self.replica, self.device = batch_rows, replicas, replica, device
        self.micro_batch, self.weight = 0, 1.0
        self.seen: dict[str, dict[int, Tensor | float]] = {}
        """By name, by micro-batch: the value logged (a float64 device scalar, or the number given), times
        the weight for a mean."""
        self.how: dict[str, str] = {}
        self.kwargs: dict[str, dict] = {}

    def begin(self, micro_batch: int, weight: float) -> None:
        """Values logged from now on belong to ``micro_batch``, a ``weight`` share of the batch's rows."""
        self.micro_batch, self.weight = micro_batch, weight

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log scalars")
            number: Tensor | float
            if value.device.type == "cpu" and self.device.type != "cpu":
                number = float(value)  # on the host already: a copy to the device would wait for it
            else:
                number = _as_float64(value, self.device)
        elif isinstance(value, int | float):
            number = float(value)
        else:
            raise TypeError(
                f"self.log({name!r}, ...) got a {type(value).__name__}; under dapple log tensors or numbers "
                "(metric objects are updated per micro-batch on the last stage only; log their computed value)"
            )
        how = _reduction(name, kwargs.get("reduce_fx", "mean"))
        kwargs.pop("sync_dist", None)  # values are combined exactly; nothing left to sync
        kwargs.pop("sync_dist_group", None)
        kwargs.setdefault("batch_size", self.batch_rows)
        self.how.setdefault(name, how)
        self.kwargs.setdefault(name, kwargs)
        self.seen.setdefault(name, {})[self.micro_batch] = number * self.weight if how == "mean" else number

    def flatten(self, loss: Tensor | None) -> Tensor:
        """The loss and this replica's values (in name order) as one float64 tensor on the device, to be
        summed over the last stage's replicas; a max or min has a slot per replica, 0 but in this one's."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        flat = [zero if loss is None else loss]
        for name in sorted(self.seen):
            how, value = self.how[name], _reduce_on(self.device, self.how[name], list(self.seen[name].values()))
            if how in ("max", "min"):
                flat.extend(value if r == self.replica else zero for r in range(self.replicas))
            else:
                flat.append(value)
        return torch.stack(flat)

    def unflatten(self, summed: Tensor) -> tuple[float, Logged]:
        """The loss and the batch's logged values from the sum of :meth:`flatten` over the replicas
        (read on the host: the step's one wait for the device)."""
        flat = summed.tolist()
        loss, at, logged = flat[0], 1, {}
        for name in sorted(self.seen):
            width = self.replicas if self.how[name] in ("max", "min") else 1
            logged[name] = (_across_replicas(self.how[name], flat[at : at + width]), self.kwargs[name])
            at += width
        return loss, logged


def _check_input_rows(call: StageCall | None, m: int, rows: Rows, total: int) -> None:
    """The first stage's input must hold the slice's rows in dim 0, or the batch was read wrongly."""
    shapes = [tuple(t.shape) for t in (call.inputs if call is not None else [])]
    if any(not shape or shape[0] != len(rows) for shape in shapes):
        raise ValueError(
            f"the pipelined Sequential's input has shape {shapes if len(shapes) > 1 else shapes[0]} in micro-batch "
            f"{m}, whose slice is rows [{rows.start}, {rows.stop}) of a batch dapple read as {total} rows; it must "
            f"have the slice's {len(rows)} rows in dim 0. dapple reads a list of tensors that share dim 0 as fields "
            "of the batch (default_collate's [x, y]): per-sample tensors of one shape belong stacked in one tensor, "
            "or beside a tensor with the batch's rows (the rules: dapple_lightning.microbatch)"
        )


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it detached and on the CPU."""
    return map_tensors(value, lambda t: t.detach().cpu())


def clip_grad_norm_over_stages(
    optimizer: torch.optim.Optimizer, clip_val: float, *, owned: Callable[[], set[int]], device: torch.device
) -> None:
    """Clip by the norm of the whole model's gradients (every stage's, each parameter counted once:
    by the rank ``owned()`` says speaks for it, or a sharded one by each replica for its own shard),
    as clipping on one device does (collective)."""
    grads = [local_part(p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    mine = owned()
    square = torch.zeros((), dtype=torch.float64, device=device)
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.grad is not None and (id(p) in mine or isinstance(p.grad, DTensor)):
                square += local_part(p.grad).detach().double().pow(2).sum()
    dist.all_reduce(square)
    # min(clip / (norm + eps), 1) in float64 as on the host, but computed where the norm is: no wait for it.
    coef = torch.clamp(torch.full_like(square, float(clip_val)) / (square.sqrt() + 1e-6), max=1.0)
    for grad in grads:
        grad.detach().mul_(coef)
