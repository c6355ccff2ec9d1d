"""One global batch under a plan, as Lightning's automatic optimization expects one step.

Lightning runs, per optimizer step, ``training_step``, then ``zero_grad``, then the strategy's
``backward``, then the optimizer step. A pipeline schedule runs its backwards inside
``training_step``, so the ``zero_grad`` that follows would erase them. :meth:`MicroBatches.train`
therefore sets aside the gradients already present (with ``accumulate_grad_batches`` they still
count), runs the schedule, moves its fresh gradients aside and puts the earlier ones back;
:meth:`MicroBatches.add_fresh_gradients`, called from the strategy's ``backward``, adds them.

Per micro-batch the user's step runs once; its loss is scaled by the micro-batch's share of the
global batch, and what it logs is captured and combined into global-batch values known on
every rank (the last stage's replicas sum them along with their gradients, then share them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dapple_lightning.microbatch import Rows, batch_size_of, slice_batch
from dapple_lightning.runtime import Pending, Pipeline, share

__all__ = ["MicroBatches", "concat_outputs", "to_cpu"]

Logged = dict[str, tuple[float, dict]]
"""Logged values by name: the weighted sum so far and the ``self.log`` keyword arguments."""


class MicroBatches:
    """Runs the user's step hooks over the micro-batches of a global batch, through a pipeline."""

    def __init__(self, module: Any, device: torch.device) -> None:
        self.module, self.device = module, device
        self.shared = Pending()
        """The last stage's loss broadcasts, in flight until the next step needs the buffers."""
        self._fresh: dict[nn.Parameter, Tensor | None] = {}

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
        return torch.tensor(loss, device=self.device)

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
        outputs: list[tuple[int, Any]] = []
        _, logged = self.run(pipeline, hook, args, kwargs, train=False, context=context, outputs=outputs)
        self.log(logged)
        if hook != "predict_step":
            return None
        # Only last-stage ranks hold outputs, one per micro-batch slice; put them in row order.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, [(start, to_cpu(out)) for start, out in outputs])
        pieces = [out for _, out in sorted((p for part in gathered for p in part), key=lambda p: p[0])]
        return concat_outputs(pieces)

    def run(
        self,
        pipeline: Pipeline,
        hook: str,
        args: tuple,
        kwargs: dict,
        *,
        train: bool,
        context: Callable,
        outputs: list[tuple[int, Any]] | None = None,
    ) -> tuple[float, Logged]:
        """Run the user's ``hook`` over one global batch on ``pipeline``; the global loss and logged values."""
        module = self.module
        batch, rest = args[0], args[1:]
        total = batch_size_of(batch)
        step_fn = getattr(module, hook)
        capture = _LogCapture(total)
        loss_sum = 0.0

        def forward(m: int, rows: Rows) -> Tensor | None:
            nonlocal loss_sum
            weight = len(rows) / total
            capture.weight = weight
            out = step_fn(slice_batch(batch, rows), *rest, **kwargs)
            if not train:
                if outputs is not None:
                    outputs.append((rows.start, out))
                return None
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, Tensor):
                raise RuntimeError(
                    f"training_step returned {type(out).__name__}; with dapple it must return the loss tensor "
                    "(or a dict with 'loss') for every micro-batch"
                )
            loss_sum += float(loss.detach()) * weight
            return loss * weight

        def carry() -> Tensor:  # this replica's share, summed along with the gradients
            return _flatten_values(loss_sum, capture.values)

        module.log = capture.log  # instance attribute shadows the method during the step
        try:
            stats = pipeline.run(total, forward, train=train, forward_context=context, carry=carry)
        finally:
            del module.log
        return self._combine(pipeline, loss_sum, capture.values, stats.carried)

    def _combine(self, pipeline: Pipeline, loss: float, values: Logged, summed: Tensor | None) -> tuple[float, Logged]:
        """Sum the weighted values of the last stage's replicas (``summed`` when they rode along
        with the gradients); share them with every rank."""
        plan = pipeline.plan
        last_ranks = plan.stage_ranks(plan.num_stages - 1)
        if pipeline.is_last and len(last_ranks) > 1:
            if summed is None:  # an evaluation step: no gradients to ride along with
                summed = _flatten_values(loss, values).to(self.device)  # NCCL sums device tensors only
                dist.all_reduce(summed, group=pipeline.stage_group)
            loss = float(summed[0])
            values = {n: (float(v), values[n][1]) for n, v in zip(sorted(values), summed[1:].tolist(), strict=True)}
        if dist.get_world_size() > len(last_ranks):  # ranks outside the last stage learn the values
            self.shared.wait()  # the previous step's, long done
            loss, values = share((loss, values), last_ranks[0], self.device, self.shared)
        return loss, values

    def log(self, values: Logged) -> None:
        for name, (value, kwargs) in values.items():
            self.module.log(name, torch.tensor(value, dtype=torch.float32), **kwargs)


class _LogCapture:
    """Collects what the user's step logs, weighted by each micro-batch's share of the batch."""

    def __init__(self, batch_rows: int) -> None:
        self.batch_rows = batch_rows
        self.weight = 1.0
        self.values: Logged = {}

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        if isinstance(value, Tensor):
            if value.numel() != 1:
                raise ValueError(f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; log scalars")
            number = float(value.detach())
        elif isinstance(value, int | float):
            number = float(value)
        else:
            raise TypeError(
                f"self.log({name!r}, ...) got a {type(value).__name__}; under dapple log tensors or numbers "
                "(metric objects are updated per micro-batch on the last stage only; log their computed value)"
            )
        kwargs.pop("sync_dist", None)  # values are combined exactly; nothing left to sync
        kwargs.pop("sync_dist_group", None)
        kwargs.setdefault("batch_size", self.batch_rows)
        total, _ = self.values.get(name, (0.0, kwargs))
        self.values[name] = (total + number * self.weight, kwargs)


def _flatten_values(loss: float, values: Logged) -> Tensor:
    """The loss and the logged values (in name order) as one float64 tensor, to be summed."""
    return torch.tensor([loss, *(values[n][0] for n in sorted(values))], dtype=torch.float64)


def to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value


def concat_outputs(pieces: list[Any]) -> Any:
    """Join per-slice outputs along the batch: tensors are concatenated, containers element-wise."""
    if not pieces:
        return None
    first = pieces[0]
    if isinstance(first, Tensor):
        return torch.cat(pieces) if first.dim() > 0 else pieces
    if isinstance(first, tuple | list):
        return type(first)(concat_outputs(list(parts)) for parts in zip(*pieces))
    if isinstance(first, Mapping):
        return {k: concat_outputs([p[k] for p in pieces]) for k in first}
    return pieces
