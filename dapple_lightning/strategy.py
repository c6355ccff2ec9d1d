"""``DappleStrategy``: DAPPLE pipeline + data parallel training as a Lightning strategy.

Lifecycle glue only. The heavy lifting lives in plain modules:
:mod:`~dapple_lightning.plan` (what runs where), :mod:`~dapple_lightning.runtime` (one rank's
schedule), :mod:`~dapple_lightning.microbatch` (row arithmetic).

How one optimizer step maps onto Lightning's automatic optimization:

1. Lightning calls :meth:`DappleStrategy.training_step` with the global batch. The strategy
   sets aside the gradients already present (``accumulate_grad_batches`` may still need them),
   runs the rank's schedule, calling the user's ``training_step`` once per micro-batch (each
   loss scaled by the micro-batch's share of the global batch and back-propagated when the
   schedule says), sums gradients over the stage's replicas, moves the fresh gradients aside
   and puts the earlier ones back. Values the user logs are combined into global-batch values
   and logged on every rank. Every rank returns the global loss.
2. Lightning zeroes gradients (or not) and calls :meth:`DappleStrategy.backward`, which adds
   the fresh gradients instead of differentiating the returned loss.
3. Lightning steps each rank's optimizer over that rank's parameters only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, RandomSampler
from typing_extensions import override

from dapple_lightning.microbatch import Rows, batch_size_of, slice_batch
from dapple_lightning.plan import Plan
from dapple_lightning.runtime import Pipeline, StageModule, StepStats, partition, stage_group
from dapple_lightning.timeline import Timeline, write_chrome_trace

__all__ = ["DappleStrategy"]

log = logging.getLogger(__name__)

PlanLike = Plan | Mapping[str, Any] | str | Any


class DappleStrategy(ParallelStrategy):
    """Synchronous pipeline + data parallel training with a DAPPLE plan.

    Args:
        plan: a :class:`~dapple_lightning.plan.Plan`, a dict, an OmegaConf node, YAML text or a
            YAML file path. ``"auto"`` (the default) profiles the model and lets the planner
            choose (see :mod:`dapple_lightning.planner`).
        sequential: attribute path of the ``nn.Sequential`` to pipeline (e.g. ``"layers"`` or
            ``"model.blocks"``); found automatically when the module has exactly one.
        timeout: how long a rank waits on a peer before giving up; a dead or stuck peer ends
            the job after at most this long.
        start_method: ``"popen"`` re-launches the script once per rank (Lightning's default for
            scripts); ``"spawn"`` starts ranks with multiprocessing (notebooks, pytest).
        trace: write a Chrome trace (Perfetto) of every rank's forwards, backwards, sends,
            receives and all-reduces to this path when training ends.
        track_memory: count the activation bytes autograd keeps alive per micro-batch; the
            last step's peak is in ``strategy.step_stats.peak_live_bytes``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend: as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "dapple"

    def __init__(
        self,
        plan: PlanLike = "auto",
        *,
        sequential: str | None = None,
        timeout: timedelta = timedelta(seconds=120),
        start_method: Literal["popen", "spawn"] = "popen",
        trace: str | None = None,
        track_memory: bool = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if start_method not in ("popen", "spawn"):
            raise ValueError(f"start_method must be 'popen' or 'spawn', got {start_method!r}")
        # Parse early so a malformed plan fails in the constructor, before any process starts.
        self._plan_spec: Plan | str = "auto" if _is_auto(plan) else Plan.coerce(plan)
        self._sequential_name = sequential
        self._timeout = timeout
        self._start_method = start_method
        self._trace_path = trace
        self._track_memory = track_memory
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self.plan: Plan | None = None
        self._pipeline: Pipeline | None = None
        self._stage_module: StageModule | None = None
        self._stage_group: dist.ProcessGroup | None = None
        self._last_group: dist.ProcessGroup | None = None
        self._outside_params: list[nn.Parameter] = []
        self._stashed: dict[nn.Parameter, Tensor | None] = {}
        self._fresh: dict[nn.Parameter, Tensor | None] = {}
        self._full_state_keys: list[str] = []
        self._shuffle_seed = 0

    # ------------------------------------------------------------------ Lightning plumbing

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # False on purpose: the plan acts as one device, so every rank must see every batch in
        # the single-device order. Lightning injects a DistributedSampler (which also forces
        # shuffling) only for distributed strategies, and `self.log(sync_dist=True)` would
        # reduce values that the strategy already combined.
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _DappleSpawnLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError(
                "dapple supports automatic optimization only: the pipeline schedule runs each micro-batch's "
                "backward itself. Remove `self.automatic_optimization = False` or use strategy='ddp'"
            )
        name, sequential = find_sequential(module, self._sequential_name)
        self.precision_plugin.convert_module(module)
        _broadcast_module(module)  # same initial weights on every rank, as DDP does
        self._full_state_keys = list(module.state_dict().keys())
        self.plan = self._resolve_plan(sequential)
        rank = self.global_rank
        self._stage_module = partition(sequential, self.plan, rank)
        _set_submodule(module, name, self._stage_module)
        local = {id(p) for p in self._stage_module.parameters()}
        self._outside_params = [p for p in module.parameters() if id(p) not in local]
        self.model_to_device()
        self._stage_group = stage_group(self.plan, rank, timeout=self._timeout)
        timeline = Timeline(rank, self.plan.stage_of(rank), enabled=self._trace_path is not None)
        self._pipeline = Pipeline(
            self.plan,
            rank,
            self._stage_module,
            device=self.root_device,
            timeline=timeline,
            stage_group=self._stage_group,
            shared_params=self._outside_params,
            track_memory=self._track_memory,
        )
        seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)
        dist.broadcast(seed, 0)
        self._shuffle_seed = int(seed)
        rank_zero_info(f"dapple plan:\n{self.plan.table()}")
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _resolve_plan(self, sequential: nn.Sequential) -> Plan:
        num_layers = len(sequential)
        if self._plan_spec == "auto":
            # TODO(planner): profile and plan; until then every rank holds every layer.
            plan = Plan.data_parallel(num_layers, self.world_size)
        else:
            plan = self._plan_spec
        assert isinstance(plan, Plan)
        plan.check(num_layers=num_layers, world_size=self.world_size)
        return plan

    @property
    def step_stats(self) -> StepStats:
        """What the last pipelined step measured on this rank (peak live micro-batches and bytes)."""
        if self._pipeline is None:
            raise RuntimeError("the strategy has run no step yet")
        return self._pipeline.stats

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        # Every rank must draw the same order. A RandomSampler without a generator draws its
        # order from each process's global RNG, which the ranks consume differently (dropout in
        # different layers), so give it a generator seeded identically on every rank.
        sampler = getattr(dataloader, "sampler", None)
        if isinstance(dataloader, DataLoader) and isinstance(sampler, RandomSampler) and sampler.generator is None:
            sampler.generator = torch.Generator().manual_seed(self._shuffle_seed)
        return dataloader

    # ---------------------------------------------------------------------- training step

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        params = [p for p in module.parameters() if p.requires_grad]
        self._stashed = {p: p.grad for p in params}
        for p in params:
            p.grad = None
        loss, logged = self._run_pipeline("training_step", args, kwargs, train=True)
        self._fresh = {p: p.grad for p in params}
        for p in params:
            p.grad = self._stashed[p]
        self._stashed = {}
        self._log_combined(logged)
        return torch.tensor(loss, device=self.root_device)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # Lightning divides the returned loss by accumulate_grad_batches before backward; the
        # pipeline's gradients were taken of the undivided loss.
        scale = 1.0 / module.trainer.accumulate_grad_batches
        for p, fresh in self._fresh.items():
            if fresh is None:
                continue
            fresh = fresh * scale if scale != 1.0 else fresh
            p.grad = fresh if p.grad is None else p.grad + fresh
        self._fresh = {}
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", args, kwargs, self.precision_plugin.val_step_context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", args, kwargs, self.precision_plugin.test_step_context)

    def _eval_step(self, hook: str, args: tuple, kwargs: dict, context: Callable) -> None:
        _, logged = self._run_pipeline(hook, args, kwargs, train=False, context=context)
        self._log_combined(logged)
        return None

    def _run_pipeline(
        self, hook: str, args: tuple, kwargs: dict, *, train: bool, context: Callable | None = None
    ) -> tuple[float, dict[str, tuple[float, dict]]]:
        assert self._pipeline is not None
        module = self.lightning_module
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
                return None
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, Tensor):
                raise RuntimeError(
                    f"training_step returned {type(out).__name__}; with dapple it must return the loss tensor "
                    "(or a dict with 'loss') for every micro-batch"
                )
            loss_sum += float(loss.detach()) * weight
            return loss * weight

        module.log = capture.log  # instance attribute shadows the method during the step
        try:
            self._pipeline.run(
                total,
                forward,
                train=train,
                forward_context=context or self.precision_plugin.train_step_context,
            )
        finally:
            del module.log
        return self._combine(loss_sum, capture.values)

    def _combine(self, loss: float, values: dict[str, tuple[float, dict]]) -> tuple[float, dict]:
        """Sum the weighted values of the last stage's replicas; share them with every rank."""
        assert self.plan is not None and self._pipeline is not None
        last_ranks = self.plan.stage_ranks(self.plan.num_stages - 1)
        if self._pipeline.is_last and len(last_ranks) > 1:
            names = sorted(values)
            flat = torch.tensor([loss] + [values[n][0] for n in names], dtype=torch.float64)
            dist.all_reduce(flat, group=self._stage_group)
            loss = float(flat[0])
            values = {n: (float(v), values[n][1]) for n, v in zip(names, flat[1:].tolist())}
        if self.world_size > 1:
            box = [(loss, values)]
            dist.broadcast_object_list(box, src=last_ranks[0])
            loss, values = box[0]
        return loss, values

    def _log_combined(self, values: dict[str, tuple[float, dict]]) -> None:
        module = self.lightning_module
        for name, (value, kwargs) in values.items():
            module.log(name, torch.tensor(value, dtype=torch.float32), **kwargs)

    # --------------------------------------------------------------------- collectives

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not _distributed_is_initialized():
            return tensor
        from lightning.fabric.utilities.distributed import _sync_ddp_if_available

        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------------------------------ checkpoints

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state dict, keys as in the unpartitioned model (collective; complete on rank 0)."""
        module = self.lightning_module
        local = module.state_dict()
        if self.plan is None or not _distributed_is_initialized():
            return local
        mine = {k: v.detach().cpu() for k, v in local.items()} if self.plan.replica_of(self.global_rank) == 0 else {}
        gathered: list[Any] = [None] * self.world_size if self.global_rank == 0 else []
        dist.gather_object(mine, gathered if self.global_rank == 0 else None, dst=0)
        if self.global_rank != 0:
            return local
        merged: dict[str, Any] = {}
        for part in gathered:
            merged.update(part)
        order = {k: i for i, k in enumerate(self._full_state_keys)}
        return dict(sorted(merged.items(), key=lambda kv: order.get(kv[0], len(order))))

    @override
    def teardown(self) -> None:
        if self._pipeline is not None and self._trace_path is not None and _distributed_is_initialized():
            self._write_trace()
        if self._stage_module is not None:
            self._stage_module._pipeline = None
        super().teardown()

    def _write_trace(self) -> None:
        assert self._pipeline is not None
        events = self._pipeline.timeline.events
        gathered: list[Any] = [None] * self.world_size if self.global_rank == 0 else []
        dist.gather_object(events, gathered if self.global_rank == 0 else None, dst=0)
        if self.global_rank == 0:
            path = write_chrome_trace([e for part in gathered for e in part], self._trace_path)
            rank_zero_info(f"dapple: wrote Chrome trace to {path}")


class _LogCapture:
    """Collects what the user's step logs, weighted by each micro-batch's share of the batch."""

    def __init__(self, batch_rows: int) -> None:
        self.batch_rows = batch_rows
        self.weight = 1.0
        self.values: dict[str, tuple[float, dict]] = {}

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


def find_sequential(module: nn.Module, name: str | None = None) -> tuple[str, nn.Sequential]:
    """The ``nn.Sequential`` to pipeline: the one named, or the module's only one."""
    if name is not None:
        try:
            found = module.get_submodule(name)
        except AttributeError as e:
            raise ValueError(f"sequential={name!r}: the module has no submodule {name!r}") from e
        if not isinstance(found, nn.Sequential):
            raise TypeError(
                f"sequential={name!r} is a {type(found).__name__}; dapple pipelines an nn.Sequential of layers"
            )
        return name, found
    candidates = [(n, m) for n, m in module.named_children() if isinstance(m, nn.Sequential)]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no nn.Sequential attribute to pipeline; put the layers to split into "
            "one nn.Sequential (self.layers = nn.Sequential(...)) or name a nested one with "
            "DappleStrategy(sequential='path.to.it')"
        )
    names = ", ".join(repr(n) for n, _ in candidates)
    raise ValueError(
        f"{type(module).__name__} has several nn.Sequential attributes ({names}); choose one with "
        f"DappleStrategy(sequential={candidates[0][0]!r})"
    )


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, leaf, new)


@torch.no_grad()
def _broadcast_module(module: nn.Module) -> None:
    """Give every rank rank 0's parameters and buffers."""
    if not _distributed_is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [t for t in module.state_dict(keep_vars=True).values() if isinstance(t, Tensor)]
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, 0)
        offset = 0
        for t in same:
            n = t.numel()
            t.data.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def _is_auto(plan: Any) -> bool:
    return plan is None or (isinstance(plan, str) and plan.strip().lower() == "auto")


class _DappleSpawnLauncher(_MultiProcessingLauncher):
    """Lightning's spawn launcher, but the weights sent back are the consolidated model's."""

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        strategy = trainer.strategy
        assert isinstance(strategy, DappleStrategy)
        original = trainer.lightning_module.state_dict
        full = strategy.lightning_module_state_dict()
        trainer.lightning_module.state_dict = lambda *a, **k: full  # type: ignore[method-assign]
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            trainer.lightning_module.state_dict = original  # type: ignore[method-assign]
            # Leave together: a rank that exits while a peer still talks to it aborts that peer.
            if _distributed_is_initialized():
                dist.barrier()
                dist.destroy_process_group()


StrategyRegistry.register(
    "dapple", DappleStrategy, description="DAPPLE synchronous pipeline + data parallel training (plan='auto')"
)
