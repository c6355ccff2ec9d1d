"""``DappleStrategy``: DAPPLE pipeline + data parallel training as a Lightning strategy.

Lifecycle glue only: it builds the process groups, asks model surgery for the rank's stage
(:mod:`~dapple_lightning.surgery`), hands each step to :class:`~._step.PipelinedSteps` (which runs
the rank's :class:`~dapple_lightning.runtime.Pipeline`), and keeps Lightning's contracts for
collectives (as DDP's, with barriers on a gloo host group), checkpoints (each rank saves and
loads only what it holds, in the single-device layout: :mod:`._checkpoint`; a state recovered
after torchrun's restart: :mod:`._resume`), ``plan="auto"`` (:mod:`._auto`), meta-device models
(:mod:`._materialize`) and launching. Whatever it changes on Lightning's, the optimizers' and the
user's objects goes through :mod:`._lightning`, which puts it back at ``teardown``. How one
optimizer step fits Lightning's automatic optimization is :mod:`._step`'s docstring.
"""

from __future__ import annotations

import atexit
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from dapple_lightning.plan import Plan
from dapple_lightning.planner import parse_memory
from dapple_lightning.runtime import Pipeline, StepStats, Timeline, follow_shards, unshard_stage
from dapple_lightning.strategy._auto import AutoSetting, choose_automatically, draw_global_batch
from dapple_lightning.strategy._batch import SameBatch, same_order
from dapple_lightning.strategy._checkpoint import Checkpoints, group_names
from dapple_lightning.strategy._failures import as_timeout, connect, host_group, note_lost_peer
from dapple_lightning.strategy._finetuning import adapt_finetuning
from dapple_lightning.strategy._heartbeat import SILENT, watch_peers
from dapple_lightning.strategy._lightning import (
    STATE_LEFT_IN_SPAWNED_RANKS,
    Patches,
    ScriptLauncher,
    SpawnLauncher,
    all_gather_if_available,
    default_backend_for,
    destroy_dist_connection,
    distributed_is_initialized,
    optimizers_to_device,
    silenced_log,
    sync_if_available,
)
from dapple_lightning.strategy._materialize import STAYS_CUT, materialize, meta_context, on_meta, unmoved_on_meta
from dapple_lightning.strategy._memory import warn_if_over_budget, write_trace
from dapple_lightning.strategy._parts import FitParts
from dapple_lightning.strategy._pipelines import Buffers, PipelineBuilder, broadcast_module
from dapple_lightning.strategy._recovery import Recovery, RecoveryMode, is_active
from dapple_lightning.strategy._refusals import auto_chunks_refusal, check_before_start, sharding_refusal
from dapple_lightning.strategy._resume import RECOVERED, begin, kept_plan, load_optimizers
from dapple_lightning.strategy._rng import RngStates, share_rng_states
from dapple_lightning.strategy._step import PipelinedSteps, clip_grad_norm_over_stages, local_optimizers
from dapple_lightning.strategy._summary import summarize_whole
from dapple_lightning.surgery import Chain, Cut

__all__ = ["DappleStrategy"]

PlanLike = Plan | Mapping[str, Any] | str | Any


class DappleStrategy(ParallelStrategy):
    """Synchronous pipeline + data parallel training with a DAPPLE plan.

    Args:
        plan: a :class:`~dapple_lightning.plan.Plan`, a dict, an OmegaConf node, YAML text or a
            YAML file path. ``"auto"`` (the default) profiles the model and lets the planner
            choose (see :mod:`dapple_lightning.planner`). A plan search's best plan comes from
            :func:`dapple_lightning.search.strategy_from_study`.
        sequential: attribute path of the ``nn.Sequential`` or ``nn.ModuleList`` to pipeline (e.g.
            ``"layers"``, ``"model.transformer.h"``), or a list of them that forward runs in turn
            (``["features", "classifier"]``); found automatically when the module has exactly one.
        timeout: how long a rank waits on a peer before giving up (a ``timedelta`` or seconds); a
            dead or stuck peer ends the job after at most this long. Under NCCL it is the watchdog's limit for each
            collective; barriers wait on the host, for at least 30 minutes (a checkpoint write).
        start_method: ``"popen"`` re-launches the script once per rank (Lightning's default for
            scripts); ``"spawn"`` starts ranks with multiprocessing (notebooks, pytest);
            ``"forkserver"`` is ``"spawn"`` with ranks forked from a server process that imported
            torch and Lightning once, so each rank starts without importing them again.
        trace: write a Chrome trace (Perfetto) of every rank's forwards, backwards, sends,
            receives and all-reduces to this path when training ends.
        track_memory: count the activation bytes autograd keeps alive per micro-batch; the
            last step's peak is in ``strategy.step_stats.peak_live_bytes``.
        lazy_batch: copy each tensor of a micro-batch to the device when the rank's step first
            reads it, so that a stage copies only what its step reads (:mod:`._batch_leaves`).
            ``None``: on CUDA; ``False``: every tensor before the step runs, as Lightning does
            (for code that needs plain tensors: a C++ extension or a collective handed a batch
            tensor itself); ``True``: on the CPU too, where nothing is copied but the bytes that
            would move are counted. The last step's bytes are in ``strategy.step_stats.batch_bytes_moved``.
        memory_limit: per-rank budget, bytes or ``"6GiB"``, for the plan's predicted peak (:mod:`._memory`).
        state_dict_type: ``"full"`` writes one single-device checkpoint file, streamed by rank
            0 one tensor at a time; ``"sharded"`` writes a torch.distributed.checkpoint
            directory in which each stage's first replica writes its own state (resumable
            under any plan; ``python -m dapple_lightning.strategy.consolidate`` makes the file).
        async_save: write checkpoints in the background; training waits only while the
            values are copied, and the next save waits for the previous one.
        recovery: survive a lost rank under torchrun's restarts without a checkpoint (:mod:`._recovery`);
            ``"auto"``: when ``torchrun --max-restarts`` > 0; ``"log"``: on, and stages without a
            replica can be replayed from their neighbours' log (:mod:`._logbook`).
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
        process_group_backend: as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "dapple"

    def __init__(
        self,
        plan: PlanLike = "auto",
        *,
        sequential: str | Sequence[str] | None = None,
        timeout: timedelta | float = timedelta(seconds=120),
        start_method: Literal["popen", "spawn", "forkserver"] = "popen",
        trace: str | None = None,
        track_memory: bool = False,
        lazy_batch: bool | None = None,
        memory_limit: float | str | None = None,
        state_dict_type: Literal["full", "sharded"] = "full",
        async_save: bool = False,
        recovery: RecoveryMode = "auto",
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
        if start_method not in ("popen", "spawn", "forkserver"):
            raise ValueError(f"start_method must be 'popen', 'spawn' or 'forkserver', got {start_method!r}")
        if isinstance(plan, str) and plan.strip().startswith("optuna://"):
            raise ValueError(
                f"plan={plan!r} names a plan search's study; build the strategy with "
                "dapple_lightning.search.strategy_from_study(...) or resolve it with "
                "dapple_lightning.search.resolve_plan_spec(...)"
            )
        # Parse early so a malformed plan fails in the constructor, before any process starts.
        self._plan_spec: Plan | str = "auto" if _is_auto(plan) else Plan.coerce(plan)
        self._sequential_name = sequential
        self._timeout = as_timeout(timeout)
        self._start_method = start_method
        self._trace_path = trace
        self._track_memory = track_memory
        self._lazy_batch = lazy_batch
        self._memory_limit = None if memory_limit is None else parse_memory(memory_limit, "memory_limit")
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self.plan: Plan | None = None
        self.auto_plan: Any = None
        """With ``plan="auto"``: the profile, cluster and prediction behind the chosen plan."""
        self._cut: Cut | None = None
        self._pipeline: Pipeline | None = None
        self._buffers: Buffers | None = None
        self._steps: PipelinedSteps | None = None
        self._checkpoints = Checkpoints(state_dict_type, async_save, self._timeout)
        self._same_batch = SameBatch()
        self._spawned_ranks_kept_state = False
        self._leaves_at_exit = False
        self._materialized = False  # built on the meta device: each rank holds its part only, even after fit
        self._failed = False
        self._shuffle_seed = 0
        self._host_group: Any = None  # gloo, for barriers, when the world's backend is not gloo
        self._heartbeat = SILENT  # ends this rank within seconds of a peer's loss (see _heartbeat)
        self._recovery = Recovery(recovery)
        self._patches = Patches()  # what this fit changed on Lightning's, the optimizers' and the user's objects
        self.staged: Any = None
        """How rank 0's initial weights reached this rank (see ``_pipelines.Staged``)."""

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
            self._launcher = ScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = SpawnLauncher(self, self._start_method, self._state_left_in_ranks)

    def _state_left_in_ranks(self) -> None:
        self._spawned_ranks_kept_state = True

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.set_world_ranks()
        backend = self._process_group_backend or default_backend_for(self.root_device)
        self._process_group_backend = backend
        self._validate()  # refuse bad input before any collective
        assert self.cluster_environment is not None
        connect(self.cluster_environment, backend, self._timeout, self.world_size)
        if self._host_group is None:
            self._host_group = host_group(backend, self._timeout)
        share_rng_states(self.root_device, self._host_group)  # one device's streams on every rank (_rng)
        if not self._leaves_at_exit:
            atexit.register(self._leave)
            self._leaves_at_exit = True
        on_lost = self._recovery.on_peer_lost if is_active(self._recovery.mode) else None
        self._heartbeat = watch_peers(
            self.cluster_environment, self.global_rank, self.world_size, backend, self._timeout, on_lost
        )

    def _leave(self) -> None:
        """At exit, finish a save in flight, then leave the group (or gloo aborts the process)."""
        try:
            self._checkpoints.wait()
        finally:
            destroy_dist_connection()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        # Lightning advises sync_dist=True for epoch-level values in multi-process runs; under
        # dapple every rank already logs the exact global value, so the advice would only mislead.
        warnings.filterwarnings("ignore", message=r".*recommended to use `self\.log\(.*sync_dist=True")

    def _validate(self) -> Chain:
        """Check the module and an explicit plan; raises before any process group exists."""
        module, precision = self.lightning_module, str(getattr(self.precision_plugin, "precision", "32-true"))
        return check_before_start(
            module,
            precision,
            self._sequential_name,
            self._plan_spec,
            self.world_size,
            backend=self._process_group_backend or default_backend_for(self.root_device),
            device=self.root_device,
            node_devices=self.parallel_devices or (),
            ranks_per_node=self.num_processes,
            recovering=is_active(self._recovery.mode),
            logging=self._recovery.mode == "log",
        )

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self._cut is not None:
            raise RuntimeError(STAYS_CUT)
        streams = RngStates.take(self.root_device)  # what the user's code finds after setup (_rng)
        chain = self._validate()
        self.precision_plugin.convert_module(module)
        self._materialized = on_meta(module)
        if not self._materialized:  # same initial weights on every rank, as DDP does, before any moves
            self.staged = broadcast_module(module, self.root_device)
        seed = torch.tensor([torch.initial_seed() % 2**62], dtype=torch.int64, device=self.root_device)
        dist.broadcast(seed, 0)
        self._shuffle_seed = int(seed)
        keys = list(module.state_dict().keys())  # the whole model's, before the cut
        fitting = trainer.state.fn == TrainerFn.FITTING
        pipelines = PipelineBuilder(module, self.global_rank, self.root_device, self._timeout)
        self._steps = PipelinedSteps(module, self.root_device, lazy_batch=self._lazy_batch)
        self.plan = self._resolve_plan(trainer, chain, pipelines)
        pipelines.keep_only(self.plan)
        self._cut = Cut.apply(module, chain, self.plan, rank := self.global_rank)
        if self._materialized:  # this rank's part only, the same values under any plan
            materialize(module, self.root_device, self._shuffle_seed)
        self.model_to_device()
        timeline = Timeline(rank, self.plan.stages_of(rank)[0], enabled=self._trace_path is not None)
        # An earlier fit's optimizers (Lightning keeps them for validate, predict and a save) hold the whole weights.
        whole = {} if fitting else dict(self._cut.stage.named_parameters())
        self._pipeline = pipelines.build(self.plan, self._cut.stage, timeline, track_memory=self._track_memory)
        follow_shards(self._cut.stage, whole, self.optimizers)  # onto a sharded stage's shards, as in fit
        self._buffers = Buffers(module, self._pipeline, self.plan, fitting and self._layer_sync is not None)
        self._checkpoints.attach(module, self._cut, self.plan, rank, self.root_device, keys, self._host_group)
        if self.auto_plan is None:
            rank_zero_info(f"dapple plan:\n{self.plan.table()}")
        streams.restore()
        if fitting:
            with self._cut.whole():  # configure_optimizers sees the model as one device has it
                self.setup_optimizers(trainer)
                full_names = group_names(module, self.optimizers)
            local_optimizers(self._patches, self.optimizers, module, self._cut.stage)
            self._checkpoints.set_optimizers(self.optimizers, full_names)
            adapt_finetuning(self._patches, trainer.callbacks, self._fit_parts())
            summarize_whole(self._patches, trainer.callbacks, module, self._cut)  # not this rank's stage alone
        self.setup_precision_plugin()
        # Lightning clips with the norm of this rank's gradients; the norm must span all stages.
        clip = functools.partial(
            clip_grad_norm_over_stages, owned=self._checkpoints.owns_gradient, device=self.root_device
        )
        self._patches.set(self.precision_plugin, "clip_grad_by_norm", clip)
        if fitting:
            optimizers_to_device(self.optimizers, self.root_device)
            begin(self._recovery, trainer, self.plan, self._host_group, self._fit_parts(), self._patches)

    def _fit_parts(self) -> FitParts:
        assert self._pipeline is not None and self._steps is not None and self._cut is not None
        return FitParts(
            module=self.lightning_module,
            pipeline=self._pipeline,
            steps=self._steps,
            checkpoints=self._checkpoints,
            cut=self._cut,
            optimizers=self.optimizers,
            timeout=self._timeout,
            train_step_context=self.precision_plugin.train_step_context,
            load_checkpoint=self.load_checkpoint,
        )

    def _resolve_plan(self, trainer: Trainer, chain: Chain, pipelines: PipelineBuilder) -> Plan:
        if isinstance(self._plan_spec, Plan):
            with silenced_log(self.lightning_module):  # the user's step runs outside Lightning's loops
                warn_if_over_budget(self.lightning_module, chain, self._plan_spec, trainer, self._memory_limit)
            return self._plan_spec
        if trainer.state.fn != TrainerFn.FITTING:
            # Forward-only loops have no training batch to profile; every rank holds every layer.
            return Plan.data_parallel(len(chain), self.world_size)
        if (kept := kept_plan(self._recovery, self._host_group)) is not None:
            return kept  # after torchrun's restart: the plan the kept state belongs to
        assert self._steps is not None
        setting = AutoSetting(
            self.lightning_module,
            self.global_rank,
            self.root_device,
            self.num_nodes,
            pipelines,
            self._steps,
            self.precision_plugin.train_step_context,
            self._memory_limit,
            auto_chunks_refusal(self._recovery.mode == "log"),
            functools.partial(
                sharding_refusal,
                self.lightning_module,
                chain,
                ranks_per_node=self.num_processes,
                recovery=is_active(self._recovery.mode),
            ),
        )
        batch = draw_global_batch(trainer, super().batch_to_device)
        with silenced_log(self.lightning_module):  # the user's step runs outside Lightning's loops
            chosen = choose_automatically(setting, batch, chain)
        rank_zero_info(chosen.report())
        self.auto_plan = chosen
        return chosen.plan

    @property
    def step_stats(self) -> StepStats:
        """What the last pipelined step measured on this rank (peak live micro-batches and bytes)."""
        if self._pipeline is None:
            raise RuntimeError("the strategy has run no step yet")
        return self._pipeline.stats

    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Any:
        """``empty_init=True`` builds on the meta device; each rank materialises its part at setup."""
        return meta_context(self.precision_plugin) if empty_init else super().tensor_init_context(empty_init)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Rank 0's batch on every rank, compared on the host, and left there: each micro-batch's rows
        move to the device on the rank that computes them (``_batch``, ``_step``)."""
        if device is not None or self._pipeline is None or self._steps is None:
            return super().batch_to_device(batch, device, dataloader_idx)
        if self.lightning_module.trainer.training:
            self._recovery.safe_point()
        self._steps.dataloader_idx = dataloader_idx
        return self._same_batch(batch, self._host_group)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = same_order(self._patches, dataloader, self._shuffle_seed)
        self._recovery.track_loader(self._patches, dataloader, self.lightning_module.trainer)
        return dataloader

    @override
    def on_train_start(self) -> None:
        self._recovery.listen()

    # ---------------------------------------------------------------------- the steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Tensor:
        assert self._steps is not None and self._pipeline is not None and self._buffers is not None
        loss = self._steps.train(self._pipeline, args, kwargs, self.precision_plugin.train_step_context)
        self._recovery.after_step(args)
        self._buffers.agree()
        return loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        assert self._steps is not None
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        # Lightning divides the returned loss by accumulate_grad_batches before backward; the
        # pipeline's gradients were taken of the undivided loss.
        self._steps.add_fresh_gradients(1.0 / module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("validation_step", args, kwargs, self.precision_plugin.val_step_context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._evaluate("test_step", args, kwargs, self.precision_plugin.test_step_context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Predictions of the whole global batch, in batch order, on every rank."""
        return self._evaluate("predict_step", args, kwargs, self.precision_plugin.predict_step_context)

    def _evaluate(self, hook: str, args: tuple, kwargs: dict, context: Callable) -> Any:
        assert self._steps is not None and self._pipeline is not None
        return self._steps.evaluate(self._pipeline, hook, args, kwargs, context)

    # -------------------------------------------------- collectives (barriers on the host group)

    @override
    def barrier(self, name: str | None = None) -> None:
        if distributed_is_initialized():
            dist.barrier(group=self._host_group)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        if not isinstance(tensor, Tensor) or not distributed_is_initialized():
            return tensor
        return sync_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return all_gather_if_available(tensor, group=group, sync_grads=sync_grads)

    # ------------------------------------------------ checkpoints (each rank its own part)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # After the cut, each rank loads only what it holds (a sharded checkpoint reads only that).
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The unpartitioned state dict (collective); on rank 0, meta stand-ins for other ranks' entries,
        which :meth:`save_checkpoint` fills in as it writes."""
        attached = self._checkpoints.module is not None
        return self._checkpoints.model_state() if attached else self.lightning_module.state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state in the single-device layout (collective; stand-ins as above)."""
        known = bool(self._checkpoints.optimizers)
        return self._checkpoints.optimizer_state(optimizer) if known else optimizer.state_dict()

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Write a file (or a sharded directory) under a temporary name, then rename (collective)."""
        if self._spawned_ranks_kept_state:
            raise RuntimeError(STATE_LEFT_IN_SPAWNED_RANKS)
        self._checkpoints.save(checkpoint, filepath, storage_options, self.checkpoint_io)
        self._recovery.checkpointed(filepath, checkpoint.get("global_step", 0))

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save in flight is written; raise its error (collective-free)."""
        self._checkpoints.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self._recovery.recovered is not None:  # newer than the script's checkpoint, which it started from
            return self._recovery.recovered
        return self._checkpoints.load(checkpoint_path, self.checkpoint_io, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._checkpoints.module is None:
            super().load_model_state_dict(checkpoint, strict)
        else:
            self._checkpoints.load_model(checkpoint, strict and RECOVERED not in checkpoint)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if RECOVERED in checkpoint:
            load_optimizers(self.optimizers, checkpoint)
        else:
            self._checkpoints.load_optimizers(checkpoint)
        optimizers_to_device(self.optimizers, self.root_device)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self._checkpoints.remove(filepath, self.checkpoint_io)

    # -------------------------------------------------------------------------- the end

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        self._heartbeat.report_failure(type(exception).__name__)
        self._recovery.on_failure()
        note_lost_peer(exception, self.global_rank, self._timeout)

    @override
    def teardown(self) -> None:
        self._patches.remove()  # first: nothing below may leave Lightning's or the user's objects changed
        if self._pipeline is not None and self._trace_path is not None and not self._failed:
            write_trace(self._pipeline.timeline, self._trace_path)
        if self._steps is not None:
            self._steps.shared.abandon() if self._failed else self._steps.shared.wait()
        if self._pipeline is not None:
            self._pipeline.close()
        if self._buffers is not None:
            self._buffers.close()
        if not self._failed:
            self._checkpoints.wait()
            if self._cut is not None and distributed_is_initialized():
                unshard_stage(self._cut.stage, self.optimizers)  # each replica holds its whole weights again
            if self._cut is not None and distributed_is_initialized() and not self._materialized:
                # Whole containers back on every rank with every stage's weights, on the CPU (not a whole model on a GPU).
                self._cut.restore(self._checkpoints.whole_chain(), torch.device("cpu"))
                self._cut = None
                self._checkpoints.detach()
        with unmoved_on_meta(self.lightning_module):
            super().teardown()
        self._heartbeat.stop(failed=self._failed)
        self._recovery.close(failed=self._failed)
        self._failed or self.barrier()  # no rank ends (with the store) while a peer's heartbeat polls it


def _is_auto(plan: Any) -> bool:
    return plan is None or (isinstance(plan, str) and plan.strip().lower() == "auto")
