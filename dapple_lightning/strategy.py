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

import atexit
import logging
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import _augment_message
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, RandomSampler
from typing_extensions import override

from dapple_lightning.checkpoint import by_name, to_local, to_single_device
from dapple_lightning.microbatch import Rows, batch_size_of, slice_batch
from dapple_lightning.plan import Plan
from dapple_lightning.runtime import (
    Pending,
    Pipeline,
    StageModule,
    StepStats,
    Timeline,
    p2p_groups,
    share,
    stage_group,
    write_chrome_trace,
)
from dapple_lightning.surgery import capture_input, find_sequential, partition, set_submodule, unchanged

if TYPE_CHECKING:
    from dapple_lightning.autoplan import Measured

__all__ = ["DappleStrategy"]

log = logging.getLogger(__name__)

PlanLike = Plan | Mapping[str, Any] | str | Any

SUPPORTED_PRECISION = frozenset({"32-true", "32", "64-true", "64", "bf16-mixed", "bf16-true", "16-true"})


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
        self._last_group: dist.ProcessGroup | None = None
        self._outside_params: list[nn.Parameter] = []
        self._stashed: dict[nn.Parameter, Tensor | None] = {}
        self._fresh: dict[nn.Parameter, Tensor | None] = {}
        self._full_state_keys: list[str] = []
        self._full_optimizer_names: list[list[list[str]]] = []
        self._sequential: tuple[str, nn.Sequential] | None = None
        self._failed = False
        self._shared = Pending()  # the last stage's loss broadcasts, in flight
        self._p2p: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        self._stage_groups: dict[Plan, dist.ProcessGroup | None] = {}
        self.auto_plan: Any = None
        """With ``plan="auto"``: the profile, cluster and prediction behind the chosen plan."""
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
        self._validate()  # refuse bad input before any collective
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        # Without an explicit destroy, gloo's threads are torn down at interpreter exit and the
        # process aborts ("terminate called without an active exception").
        atexit.register(_destroy_dist_connection)
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"the process group has {dist.get_world_size()} ranks but this Trainer expects {self.world_size}; a "
                "process group left over from an earlier run in this process (e.g. a Hydra multirun with "
                "start_method='popen') cannot be reused for another size: use DappleStrategy(start_method='spawn')"
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        # Lightning advises sync_dist=True for epoch-level values in multi-process runs; under
        # dapple every rank already logs the exact global value, so the advice would only mislead.
        warnings.filterwarnings("ignore", message=r".*recommended to use `self\.log\(.*sync_dist=True")

    def _validate(self) -> tuple[str, nn.Sequential]:
        """Check the module and an explicit plan; raises before any process group exists."""
        module = self.lightning_module
        if not module.automatic_optimization:
            raise ValueError(
                "dapple supports automatic optimization only: the pipeline schedule runs each micro-batch's "
                "backward itself. Remove `self.automatic_optimization = False` or use strategy='ddp'"
            )
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"precision={precision!r} is not supported by dapple (supported: {sorted(SUPPORTED_PRECISION)}); "
                "16-mixed needs a gradient scaler inside the pipeline's backward, which dapple does not run yet: "
                "use precision='bf16-mixed'"
            )
        name, sequential = find_sequential(module, self._sequential_name)
        if isinstance(self._plan_spec, Plan):
            self._plan_spec.check(num_layers=len(sequential), world_size=self.world_size)
        return name, sequential

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        name, sequential = self._validate()
        self.precision_plugin.convert_module(module)
        _broadcast_module(module)  # same initial weights on every rank, as DDP does
        self._full_state_keys = list(module.state_dict().keys())
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self._full_optimizer_names = _optimizer_names(module)
        self.plan = self._resolve_plan(trainer, name, sequential)
        rank = self.global_rank
        self._stage_module = partition(sequential, self.plan, rank)
        self._sequential = (name, sequential)
        local = set(self._stage_module.children())
        for layer in sequential.children():
            if layer not in local:
                layer.to("meta")  # frees the memory of layers that live on other ranks
        set_submodule(module, name, self._stage_module)
        self.model_to_device()
        timeline = Timeline(rank, self.plan.stage_of(rank), enabled=self._trace_path is not None)
        self._pipeline = self._pipeline_for(self.plan, self._stage_module, timeline, track_memory=self._track_memory)
        self._outside_params = self._pipeline.shared_params
        seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64)
        dist.broadcast(seed, 0)
        self._shuffle_seed = int(seed)
        if self.auto_plan is None:
            rank_zero_info(f"dapple plan:\n{self.plan.table()}")
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        # Lightning clips with the norm of this rank's gradients; the norm must span all stages.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _resolve_plan(self, trainer: Trainer, name: str, sequential: nn.Sequential) -> Plan:
        if isinstance(self._plan_spec, Plan):
            return self._plan_spec
        world = self.world_size
        if trainer.state.fn != TrainerFn.FITTING:
            # Forward-only loops have no training batch to profile; every rank holds every layer.
            return Plan.data_parallel(len(sequential), world)
        from dapple_lightning.autoplan import choose_plan, draw_batch, optimizer_factory, time_step_outside

        module = self.lightning_module
        batch = self.batch_to_device(draw_batch(trainer.fit_loop._data_source.dataloader()))
        rows = batch_size_of(batch)
        # Profile on a micro-batch-sized slice: whole global batches make profiling slow, and the
        # cost model scales times with the micro-batch size.
        sample = slice_batch(batch, Rows(0, max(1, rows // max(world, 2))))
        set_sequential = partial(set_submodule, module, name)
        sample_input = capture_input(module, set_sequential, sequential, lambda: module.training_step(sample, 0))

        def step_outside(n: int) -> tuple[float, float]:
            part = slice_batch(sample, Rows(0, n))
            return time_step_outside(
                module,
                set_sequential,
                sequential,
                lambda: module.training_step(part, 0),
                slice_batch(sample_input, Rows(0, n)),
            )

        try:
            optimizer = optimizer_factory(module)
        except Exception as err:  # the plan can do without optimizer timings; say so and go on
            rank_zero_warn(f"dapple plan='auto' could not time optimizer steps ({err!r}); planning without them")
            optimizer = None

        with unchanged(module):
            trials = _Trials(self, batch, sequential, set_sequential, optimizer)
            try:
                chosen = choose_plan(
                    sequential,
                    sample_input,
                    self.root_device,
                    nodes=self.num_nodes,
                    global_batch=rows,
                    optimizer=optimizer,
                    step_outside=step_outside,
                    trial=trials,
                )
            finally:
                trials.close()
        rank_zero_info(chosen.report())
        self.auto_plan = chosen
        return chosen.plan

    def _pipeline_for(
        self, plan: Plan, stage: StageModule, timeline: Timeline, *, track_memory: bool = False
    ) -> Pipeline:
        """This rank's :class:`Pipeline` of ``plan`` (collective: creates process groups), with
        ``stage`` already standing in for the Sequential in the LightningModule; parameters
        outside it are summed over every rank."""
        local = {id(p) for p in stage.parameters()}
        outside = [p for p in self.lightning_module.parameters() if id(p) not in local]
        if plan.num_stages > 1 and self._p2p is None:
            self._p2p = p2p_groups(timeout=self._timeout)  # one pair for every plan: groups are costly
        if plan not in self._stage_groups:  # a trial's plan that is chosen keeps its group
            self._stage_groups[plan] = stage_group(plan, self.global_rank, timeout=self._timeout)
        return Pipeline(
            plan,
            self.global_rank,
            stage,
            device=self.root_device,
            timeline=timeline,
            stage_group=self._stage_groups[plan],
            shared_params=outside,
            track_memory=track_memory,
            p2p_groups=self._p2p if plan.num_stages > 1 else (None, None),
        )

    def _owned(self) -> set[int]:
        """Parameters this rank speaks for when something must count each parameter once."""
        assert self.plan is not None and self._stage_module is not None
        owned: set[int] = set()
        if self.plan.replica_of(self.global_rank) == 0:
            owned |= {id(p) for p in self._stage_module.parameters()}
        if self.global_rank == 0:
            owned |= {id(p) for p in self._outside_params}
        return owned

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        owned = self._owned()
        square = torch.zeros((), dtype=torch.float64, device=self.root_device)
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.grad is not None and id(p) in owned:
                    square += p.grad.detach().double().pow(2).sum()
        dist.all_reduce(square)
        coef = min(float(clip_val) / (float(square.sqrt()) + 1e-6), 1.0)
        for grad in grads:
            grad.detach().mul_(coef)

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

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Predictions of the whole global batch, in batch order, on every rank."""
        return self._eval_step("predict_step", args, kwargs, self.precision_plugin.predict_step_context)

    def _eval_step(self, hook: str, args: tuple, kwargs: dict, context: Callable) -> Any:
        outputs: list[tuple[int, Any]] = []
        _, logged = self._run_pipeline(hook, args, kwargs, train=False, context=context, outputs=outputs)
        self._log_combined(logged)
        if hook != "predict_step":
            return None
        # Only last-stage ranks hold outputs, one per micro-batch slice; put them in row order.
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, [(start, _to_cpu(out)) for start, out in outputs])
        pieces = [out for _, out in sorted((p for part in gathered for p in part), key=lambda p: p[0])]
        return _concat(pieces)

    def _run_pipeline(
        self,
        hook: str,
        args: tuple,
        kwargs: dict,
        *,
        train: bool,
        context: Callable | None = None,
        outputs: list[tuple[int, Any]] | None = None,
        pipeline: Pipeline | None = None,
    ) -> tuple[float, dict[str, tuple[float, dict]]]:
        """Run the user's ``hook`` over one global batch on ``pipeline`` (the training one by
        default; ``plan="auto"`` trials pass others)."""
        pipeline = pipeline or self._pipeline
        assert pipeline is not None
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
            stats = pipeline.run(
                total,
                forward,
                train=train,
                forward_context=context or self.precision_plugin.train_step_context,
                carry=carry,
            )
        finally:
            del module.log
        return self._combine(pipeline, loss_sum, capture.values, stats.carried)

    def _combine(
        self, pipeline: Pipeline, loss: float, values: dict[str, tuple[float, dict]], summed: Tensor | None
    ) -> tuple[float, dict]:
        """Sum the weighted values of the last stage's replicas (``summed`` when they rode along
        with the gradients); share them with every rank."""
        plan = pipeline.plan
        last_ranks = plan.stage_ranks(plan.num_stages - 1)
        if pipeline.is_last and len(last_ranks) > 1:
            if summed is None:  # an evaluation step: no gradients to ride along with
                summed = _flatten_values(loss, values).to(self.root_device)  # NCCL sums device tensors only
                dist.all_reduce(summed, group=pipeline.stage_group)
            loss = float(summed[0])
            values = {n: (float(v), values[n][1]) for n, v in zip(sorted(values), summed[1:].tolist(), strict=True)}
        if self.world_size > len(last_ranks):  # ranks outside the last stage learn the values
            self._shared.wait()  # the previous step's, long done
            loss, values = share((loss, values), last_ranks[0], self.root_device, self._shared)
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

    @property
    def _partitioned(self) -> bool:
        return self._sequential is not None and _distributed_is_initialized()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model's state dict, keys as in the unpartitioned model (collective; complete on rank 0)."""
        local = self.lightning_module.state_dict()
        if not self._partitioned:
            return local
        # The stage's entries come from its first replica, everything outside the Sequential from rank 0.
        assert self._sequential is not None and self.plan is not None
        prefix = f"{self._sequential[0]}."
        first_replica = self.plan.replica_of(self.global_rank) == 0
        mine = {
            key: _to_cpu(value)
            for key, value in local.items()
            if (first_replica if key.startswith(prefix) else self.global_rank == 0)
        }
        gathered = _gather_on_zero(mine)
        if gathered is None:
            return local
        merged = {k: v for part in gathered for k, v in part.items()}
        order = {k: i for i, k in enumerate(self._full_state_keys)}
        return dict(sorted(merged.items(), key=lambda kv: order.get(kv[0], len(order))))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state in the single-device layout (collective; complete on rank 0)."""
        if not self._partitioned:
            return optimizer.state_dict()
        index = next(i for i, o in enumerate(self.optimizers) if o is optimizer)
        local_names = self._local_optimizer_names(optimizer)
        local = optimizer.state_dict()
        owned = self._owned()
        owned_names = {n for n, p in self.lightning_module.named_parameters() if id(p) in owned}
        mine = {name: _to_cpu(value) for name, value in by_name(local, local_names).items() if name in owned_names}
        gathered = _gather_on_zero(mine)
        if gathered is None:
            return local
        states = {k: v for part in gathered for k, v in part.items()}
        return to_single_device(states, local["param_groups"], self._full_optimizer_names[index])

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        for index, (optimizer, state) in enumerate(zip(self.optimizers, checkpoint["optimizer_states"])):
            local = to_local(state, self._full_optimizer_names[index], self._local_optimizer_names(optimizer))
            optimizer.load_state_dict(local)
            _optimizer_to_device(optimizer, self.root_device)

    def _local_optimizer_names(self, optimizer: Optimizer) -> list[list[str]]:
        name_of = {id(p): n for n, p in self.lightning_module.named_parameters()}
        return [[name_of[id(p)] for p in group["params"]] for group in optimizer.param_groups]

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write on rank 0 to a temporary file, then rename: a crash mid-write keeps the old file intact."""
        if not self.is_global_zero:
            return
        path = Path(filepath)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self.checkpoint_io.save_checkpoint(checkpoint, tmp, storage_options=storage_options)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        _augment_message(
            exception,
            pattern=r"(?s).*(Connection closed by peer|Connection reset by peer|Broken pipe|Timed out).*",
            new_message=(
                f"dapple: rank {self.global_rank} lost a peer. Another rank failed or was killed; its own "
                "error is reported by that rank. (If no rank reports an error, a peer stalled for longer "
                f"than DappleStrategy(timeout={self._timeout.total_seconds():.0f} s).)"
            ),
        )

    @override
    def teardown(self) -> None:
        if self._pipeline is not None and self._trace_path is not None and not self._failed:
            self._write_trace()
        if self._failed:
            self._shared.abandon()
        else:
            self._shared.wait()
        if self._pipeline is not None:
            self._pipeline.close()
        if self._partitioned and not self._failed:
            self._restore_sequential()
        super().teardown()

    def _restore_sequential(self) -> None:
        """Put the whole Sequential back on every rank, with the trained weights of every stage."""
        assert self._sequential is not None
        name, sequential = self._sequential
        full = self.lightning_module_state_dict()
        box = [full if self.global_rank == 0 else None]
        dist.broadcast_object_list(box, 0)
        prefix = f"{name}."
        weights = {k[len(prefix) :]: v for k, v in box[0].items() if k.startswith(prefix)}
        local = set(self._stage_module.children()) if self._stage_module is not None else set()
        for layer in sequential.children():
            if layer not in local:
                layer.to_empty(device=self.root_device)
        sequential.load_state_dict(weights)
        set_submodule(self.lightning_module, name, sequential)
        self._sequential = None
        self._stage_module = None

    def _write_trace(self) -> None:
        assert self._pipeline is not None
        events = self._pipeline.timeline.events
        gathered = _gather_on_zero(events)
        if gathered is not None:
            path = write_chrome_trace([e for part in gathered for e in part], self._trace_path)
            rank_zero_info(f"dapple: wrote Chrome trace to {path}")


class _Trials:
    """``plan="auto"``'s trials: calling it with a plan runs that plan for a few real training
    steps (collective; see :func:`autoplan.measure_in_turns`, which calls it once per turn) and
    returns what they took. A plan's pipeline is built on its first turn and kept for the later
    ones, so that creating and connecting its process groups and its first, slower step are paid
    once and never counted. The steps train: the caller puts the weights back
    (``autoplan.unchanged``); :meth:`close` detaches the pipelines and puts the Sequential back.
    """

    def __init__(
        self,
        strategy: DappleStrategy,
        batch: Any,
        sequential: nn.Sequential,
        set_sequential: Callable[[nn.Module], None],
        optimizer: Callable[[list[nn.Parameter]], Optimizer] | None,
        *,
        steps: int = 2,
        budget_s: float = 0.25,
    ) -> None:
        self._strategy, self._batch = strategy, batch
        self._sequential, self._set_sequential = sequential, set_sequential
        self._make_optimizer = optimizer
        self._steps, self._budget_s = steps, budget_s
        # Per plan: its stage, pipeline, the parameters its rank holds, and its steps per turn.
        self._built: dict[Plan, tuple[StageModule, Pipeline, list[nn.Parameter], int]] = {}
        self._pipelines: list[Pipeline] = []  # every one built, to detach, even one whose warm-up failed
        self._covered: dict[int, nn.Parameter] = {}  # what the optimizer steps
        self._step: Callable[[], Any] = lambda: None

    def _cover(self, params: list[nn.Parameter]) -> None:
        """Have the optimizer step ``params`` too: a fresh one of the user's kind over every
        parameter a measured plan held on this rank, no more (a stage needs no state for the
        others). A fresh optimizer's first steps create its state and fault its pages in (see
        planner._measure): it takes those steps here, over zero gradients, so that the plan
        measured first does not pay for them."""
        from dapple_lightning.planner._measure import SETTLE_STEPS

        missing = [p for p in params if id(p) not in self._covered]
        if self._make_optimizer is None or not missing:
            return
        self._covered.update((id(p), p) for p in missing)
        covered = list(self._covered.values())
        self._step = self._make_optimizer(covered).step
        for p in covered:
            p.grad = torch.zeros_like(p)
        for _ in range(SETTLE_STEPS):
            self._step()
        for p in covered:
            p.grad = None

    def _train_step(self, pipeline: Pipeline, params: list[nn.Parameter]) -> None:
        self._strategy._run_pipeline("training_step", (self._batch, 0), {}, train=True, pipeline=pipeline)
        self._step()
        for p in params:
            p.grad = None

    def _build(self, plan: Plan) -> tuple[StageModule, Pipeline, list[nn.Parameter], int]:
        """``plan``'s stage, pipeline and parameters on this rank, after a warm-up step that also
        tells how many steps a turn takes (collective)."""
        strategy = self._strategy
        rank = strategy.global_rank
        stage = partition(self._sequential, plan, rank)
        self._set_sequential(stage)
        params = [p for p in strategy.lightning_module.parameters() if p.requires_grad]
        self._cover(params)
        pipeline = strategy._pipeline_for(plan, stage, Timeline(rank, plan.stage_of(rank)))
        self._pipelines.append(pipeline)
        dist.barrier()
        start = time.perf_counter()
        self._train_step(pipeline, params)  # connects the plan's process groups: not counted
        # Cheap steps are noisy: as many as fit the budget (every rank the same number).
        wanted = torch.tensor([math.ceil(self._budget_s / (time.perf_counter() - start))], dtype=torch.int64)
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX)
        return stage, pipeline, params, min(max(int(wanted), self._steps), 10 * self._steps)

    def __call__(self, plan: Plan) -> Measured:
        """Seconds per training step of ``plan`` and per pass of each stage: the real pipeline, the
        user's step and the user's kind of optimizer, as training runs them, over at least
        ``steps`` steps and about ``budget_s`` seconds."""
        from dapple_lightning.autoplan import Measured

        strategy = self._strategy
        rank = strategy.global_rank
        try:
            if plan not in self._built:
                self._built[plan] = self._build(plan)
            stage, pipeline, params, count = self._built[plan]
            self._set_sequential(stage)
            dist.barrier()
            timeline = pipeline.timeline
            timeline.events.clear()
            start = time.perf_counter()
            for _ in range(count):
                self._train_step(pipeline, params)
            seconds = (time.perf_counter() - start) / count
        finally:
            strategy._shared.wait()
        passes = [
            statistics.median([e.end - e.start for e in timeline.events if e.name == kind] or [0.0])
            for kind in ("forward", "backward")
        ]
        # Every rank's step time and passes; a step lasts until its slowest rank is done, and a
        # stage's pass until its slowest replica's.
        mine = torch.tensor([[plan.stage_of(rank), seconds, *passes]], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(strategy.world_size)]
        dist.all_gather(everyone, mine)
        table = torch.cat(everyone)
        stages = range(plan.num_stages)
        return Measured(
            step_s=float(table[:, 1].max()),
            forward_s=tuple(float(table[table[:, 0] == s, 2].max()) for s in stages),
            backward_s=tuple(float(table[table[:, 0] == s, 3].max()) for s in stages),
        )

    def close(self) -> None:
        for pipeline in self._pipelines:
            pipeline.close()
        self._pipelines.clear()
        self._built.clear()
        self._step = lambda: None  # and the optimizer's state with it
        self._set_sequential(self._sequential)


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


def _flatten_values(loss: float, values: dict[str, tuple[float, dict]]) -> Tensor:
    """The loss and the logged values (in name order) as one float64 tensor, to be summed."""
    return torch.tensor([loss, *(values[n][0] for n in sorted(values))], dtype=torch.float64)


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
    """Lightning's spawn launcher; ranks leave the process group together."""

    @override
    def _collect_rank_zero_results(self, trainer: Trainer, results: Any) -> Any:
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            # Leave together: a rank that exits while a peer still talks to it aborts that peer.
            if _distributed_is_initialized():
                dist.barrier()
                dist.destroy_process_group()


StrategyRegistry.register(
    "dapple", DappleStrategy, description="DAPPLE synchronous pipeline + data parallel training (plan='auto')"
)


def _gather_on_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0 (``None`` elsewhere); collective."""
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def _to_cpu(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _optimizer_names(module: LightningModule) -> list[list[list[str]]]:
    """Parameter names of each param group of each optimizer, as ``configure_optimizers`` builds them on one device.

    Runs ``configure_optimizers`` once on the whole model (before partitioning) and throws the
    optimizers away: only their layout is needed, so checkpoints can store it.
    """
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [[[name_of[id(p)] for p in group["params"]] for group in o.param_groups] for o in optimizers]


def _concat(pieces: list[Any]) -> Any:
    """Join per-slice outputs along the batch: tensors are concatenated, containers element-wise."""
    if not pieces:
        return None
    first = pieces[0]
    if isinstance(first, Tensor):
        return torch.cat(pieces) if first.dim() > 0 else pieces
    if isinstance(first, tuple | list):
        return type(first)(_concat(list(parts)) for parts in zip(*pieces))
    if isinstance(first, Mapping):
        return {k: _concat([p[k] for p in pieces]) for k in first}
    return pieces
