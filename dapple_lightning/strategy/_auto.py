"""``plan="auto"`` inside the strategy's setup: profile on the real batch, measure close plans.

The profiling, the process-group measurements and the planner's choice are in
:mod:`dapple_lightning.autoplan`; this module gives them what only a running Lightning job has:
a global batch from the training loader, the user's own step, optimizer and precision, and
:class:`Trials`, which runs candidate plans for a few real training steps.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from dapple_lightning.autoplan import AutoPlan, choose_plan, draw_batch, optimizer_factory
from dapple_lightning.microbatch import Rows, batch_size_of, slice_batch
from dapple_lightning.plan import Plan
from dapple_lightning.planner import SETTLE_STEPS, Measured
from dapple_lightning.runtime import Pipeline, StageModule, Timeline
from dapple_lightning.strategy._auto_blocks import sample_chain
from dapple_lightning.strategy._lightning import training_loader
from dapple_lightning.strategy._pipelines import PipelineBuilder
from dapple_lightning.strategy._refusals import offload_refusal
from dapple_lightning.strategy._resident import Resident, parameter_bytes
from dapple_lightning.strategy._step import PipelinedSteps
from dapple_lightning.surgery import Chain, partition, split_ties, standing_for, unchanged

__all__ = ["AutoSetting", "Trials", "choose_automatically", "draw_global_batch", "step_seconds"]


@dataclass(frozen=True)
class AutoSetting:
    """What ``plan="auto"`` uses of the running job."""

    module: Any
    """The LightningModule, its container in place."""
    rank: int
    device: torch.device
    nodes: int
    pipelines: PipelineBuilder
    steps: PipelinedSteps
    context: Callable
    """The precision plugin's training-step context."""
    memory_limit: float | None = None
    """Bytes per rank no chosen plan may be predicted to exceed (``None``: the device's memory)."""
    chunks_refused: str | None = None
    """Why this run cannot train plans with several stages per rank group (then none is offered)."""
    shard_refused: Callable[[Plan], str | None] | None = None
    """Why this run cannot train a given plan's sharded stages (then the sharding lever skips it)."""


def choose_automatically(setting: AutoSetting, batch: Any, chain: Chain) -> AutoPlan:
    """Profile the layers of ``chain`` on a slice of ``batch`` (a global batch on the device), measure
    close plans in real steps, and return the choice (collective on every rank).

    One Sequential's layers are profiled as they are; the blocks of a ModuleList, or the layers of
    several containers with the user's code between them, as the chain that the user's step makes
    of them (see :func:`~dapple_lightning.strategy._auto_blocks.sample_chain`).

    The module comes on the host (the CPU) and leaves with the chain's layers there, the rest on the
    device; meanwhile the device holds only the layers in use (:mod:`._resident`; a profiling window
    is at most a rank's share of an even split).
    """
    module = setting.module
    resident = Resident(module, chain, setting.device)
    share = parameter_bytes(resident.layers) // dist.get_world_size()
    window = None if setting.device == resident.home else max(share, 1)
    rows = batch_size_of(batch)
    # Profile on a micro-batch-sized slice: whole global batches make profiling slow, and the
    # cost model scales times with the micro-batch size.
    sample = slice_batch(batch, Rows(0, max(1, rows // max(dist.get_world_size(), 2))))
    try:
        optimizer = optimizer_factory(module)
    except Exception as err:  # the plan can do without optimizer timings; say so and go on
        rank_zero_warn(f"dapple plan='auto' could not time optimizer steps ({err!r}); planning without them")
        optimizer = None
    # Learning the container's input runs the user's step too: what it draws from the RNG or moves
    # in buffers (a batch norm before the container) is put back with the rest.
    with unchanged(module):
        layers, sample_input, step_outside, blocks = sample_chain(module, chain, sample, resident)
        trials = Trials(setting, batch, chain, optimizer, resident)
        try:
            chosen = choose_plan(
                layers,
                sample_input,
                setting.device,
                nodes=setting.nodes,
                hold=resident.hold,
                window_bytes=window,
                global_batch=rows,
                optimizer=optimizer,
                step_outside=step_outside,
                trial=trials,
                memory_limit=setting.memory_limit,
                offload_refused=offload_refusal(module.trainer, chain, setting.device),
                chunks_refused=setting.chunks_refused,
                shard_refused=setting.shard_refused,
            )
        finally:
            trials.close()  # the chain's layers home again
    return chosen if blocks is None else replace(chosen, profile=blocks.named(chosen.profile))


def draw_global_batch(trainer: Any, to_device: Callable[[Any], Any]) -> Any:
    """The first training batch, on the device, leaving the loader's order as it was."""
    return to_device(draw_batch(training_loader(trainer)))


class Trials:
    """``plan="auto"``'s trials: calling it with a plan runs that plan for a few real training
    steps (collective; see :func:`autoplan.measure_in_turns`, which calls it once per turn) and
    returns what they took. A plan's pipeline is built on its first turn and kept for the later
    ones, so that creating and connecting its process groups and its first, slower step are paid
    once and never counted; how many steps a turn times follows from a second, warm step
    (:func:`step_seconds`), not from the first. The steps are timed by one wait for the device at
    each end of a turn, their passes by device events read once after it (no step waits). The steps
    train: the caller puts the weights back (``surgery.unchanged``, its copy kept on the CPU);
    :meth:`close` detaches the pipelines and puts the container back.

    While a plan runs, the device holds that plan's stage of this rank (``resident``), and the
    optimizer (made anew for each turn, its first steps untimed) holds state for the stage alone.
    The stage stands in for the containers as training's cut puts it (``surgery.Cut``): for one
    Sequential the stage itself; else one stand-in per container holding the stage's layers among
    placeholders (``runtime.stand_in_layers``), whose hooks come off when another plan takes its turn.
    """

    def __init__(
        self,
        setting: AutoSetting,
        batch: Any,
        chain: Chain,
        optimizer: Callable[[list[nn.Parameter]], Optimizer] | None,
        resident: Resident | None = None,
        *,
        steps: int = 2,
        budget_s: float = 0.25,
    ) -> None:
        self._setting, self._batch = setting, batch
        self._chain, self._put = chain, partial(chain.put, setting.module)
        self.resident = resident if resident is not None else Resident(setting.module, chain, setting.device)
        self._unhook: Callable[[], None] = lambda: None  # the hooks of the stage standing in now
        self._make_optimizer = optimizer
        self._steps, self._budget_s = steps, budget_s
        # Per plan: its stage, pipeline, the parameters its rank holds, and its steps per turn.
        self._built: dict[Plan, tuple[StageModule, Pipeline, list[nn.Parameter], int]] = {}
        self._pipelines: list[Pipeline] = []  # every one built, to detach, even one whose warm-up failed
        self._step: Callable[[], Any] = lambda: None

    def _cover(self, params: list[nn.Parameter]) -> None:
        """Have the optimizer step ``params``, the plan's on this rank, and no others: a fresh one of
        the user's kind, whose state lives on the device only while the stage does. A fresh
        optimizer's first steps create its state and fault its pages in (see planner.SETTLE_STEPS):
        it takes those steps here, over zero gradients, untimed."""
        self._step = lambda: None  # the previous plan's state goes first
        if self._make_optimizer is None or not params:
            return
        self._step = self._make_optimizer(params).step
        for p in params:
            p.grad = torch.zeros_like(p)
        for _ in range(SETTLE_STEPS):
            self._step()
        for p in params:
            p.grad = None

    def _train_step(self, pipeline: Pipeline, params: list[nn.Parameter]) -> None:
        setting = self._setting
        setting.steps.run(pipeline, "training_step", (self._batch, 0), {}, train=True, context=setting.context)
        self._step()
        for p in params:
            p.grad = None

    def _build(self, plan: Plan) -> tuple[StageModule, Pipeline, list[nn.Parameter], int]:
        """``plan``'s stage, pipeline and parameters on this rank, after a warm-up step that also
        tells how many steps a turn takes (collective)."""
        setting = self._setting
        rank = setting.rank
        stage = partition(self._chain, plan, rank)
        stage.shared = tuple(split_ties(setting.module, self._chain, plan))  # summed over every rank, as in training
        self._stand_in(plan, stage)
        params = [p for p in setting.module.parameters() if p.requires_grad]
        self._cover(params)
        pipeline = setting.pipelines.build(plan, stage, Timeline(rank, plan.stages_of(rank)[0]))
        self._pipelines.append(pipeline)
        dist.barrier()
        once = step_seconds(lambda: self._train_step(pipeline, params), partial(_clock, setting.device))
        # Cheap steps are noisy: as many as fit the budget (every rank the same number).
        wanted = torch.tensor([math.ceil(self._budget_s / max(once, 1e-9))], dtype=torch.int64, device=setting.device)
        dist.all_reduce(wanted, op=dist.ReduceOp.MAX)
        return stage, pipeline, params, min(max(int(wanted), self._steps), 10 * self._steps)

    def __call__(self, plan: Plan) -> Measured:
        """Seconds per training step of ``plan`` and per pass of each stage: the real pipeline, the
        user's step and the user's kind of optimizer, as training runs them, over at least
        ``steps`` steps and about ``budget_s`` seconds."""
        setting = self._setting
        rank = setting.rank
        try:
            if plan not in self._built:
                self._built[plan] = self._build(plan)
            stage, pipeline, params, count = self._built[plan]
            self._stand_in(plan, stage)
            self._cover(params)
            dist.barrier()
            timeline = pipeline.timeline
            timeline.events.clear()
            start = _clock(setting.device)
            for _ in range(count):
                self._train_step(pipeline, params)
            seconds = (_clock(setting.device) - start) / count
        finally:
            setting.steps.shared.wait()
        # A zero-bubble backward is timed in its two parts; the cost model's backward is both.
        median = {
            kind: statistics.median([e.end - e.start for e in timeline.events if e.name == kind] or [0.0])
            for kind in ("forward", "backward", "backward-input", "backward-weight")
        }
        passes = [median["forward"], median["backward"] + median["backward-input"] + median["backward-weight"]]
        # Every rank's step time and passes; a step lasts until its slowest rank is done, and a
        # stage's pass until its slowest replica's. The timeline labels a rank's passes with its
        # group, not the stage: a chunked plan's stages of one group (cut to equal compute) each
        # get the median over all of the group's passes.
        mine = torch.tensor([[plan.group_of(rank), seconds, *passes]], dtype=torch.float64, device=setting.device)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        table = torch.cat(everyone).cpu()  # one copy to the host, read below
        groups = [plan.group_of_stage(s) for s in range(plan.num_stages)]
        return Measured(
            step_s=float(table[:, 1].max()),
            forward_s=tuple(float(table[table[:, 0] == g, 2].max()) for g in groups),
            backward_s=tuple(float(table[table[:, 0] == g, 3].max()) for g in groups),
        )

    def close(self) -> None:
        for pipeline in self._pipelines:
            pipeline.close()
        self._pipelines.clear()
        self._built.clear()
        self._step = lambda: None  # and the optimizer's state with it
        self._unhook()
        self._unhook = lambda: None
        self._put(self._chain.containers)
        self.resident.hold([])  # every layer home: the cut then moves the chosen stage's to the device

    def _stand_in(self, plan: Plan, stage: StageModule) -> None:
        """Put ``plan``'s stage of this rank where the containers are."""
        self._unhook()
        self._unhook = lambda: None
        rank = self._setting.rank
        # The rank's stages on the device, the other layers home.
        self.resident.hold([i for s in plan.stages_of(rank) for i in range(plan.stages[s].start, plan.stages[s].end)])
        stand_ins, self._unhook = standing_for(self._chain, stage, plan, rank)
        self._put(stand_ins)


def step_seconds(step: Callable[[], None], clock: Callable[[], float]) -> float:
    """Seconds one ``step`` takes once warm: the first runs untimed (it creates and connects the plan's
    communicators, the optimizer's state, the allocator's blocks), then one is timed on ``clock``."""
    step()
    start = clock()
    step()
    return clock() - start


def _clock(device: torch.device) -> float:
    """Seconds now, once the device has finished what it was given: the schedule does not wait for
    the GPU, so a clock read alone would time kernel launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
