"""Executes one rank's lowered program (see :func:`dapple_lightning.schedule.lower`) for one global batch.

Each op of the program has a handler in a dispatch table: ``F``/``B`` run a micro-batch's
forward (the user's code, asked of the :class:`~dapple_lightning.runtime.UserStep` the run is
given, through the :class:`~dapple_lightning.runtime.StageCall` hand-off) or backward,
``RECV_*`` wait for a piece of a micro-batch's input or gradient, ``SEND_*`` send one, and
``REDUCE`` starts summing the stage's gradients as the last backward finishes them. The order
of messages is the program's, which the simulator has checked; the executor only posts each
receive one action ahead of need (see :class:`_Inbox`), which never reorders a pair's messages. Before a
program's first messages, every pair it uses (on any rank) is opened in one order common to all
ranks (see :func:`~dapple_lightning.runtime._comm.connect_pairs`).

Gradients accumulate in ``.grad`` over the micro-batches; :class:`GradientReducer` sums them
once per step, bucket by bucket while the step's last backward runs: a stage's over its
replicas, the parameters outside the Sequential over every rank. The last stage's replicas sum
their :meth:`~dapple_lightning.runtime.UserStep.replica_share` along with their gradients. A stage
whose replicas shard their state (``shard:``) sums its gradients into the shards with FSDP2 instead
(:class:`~dapple_lightning.runtime.ShardedReducer`).

Where the plan gives a rank several stages (chunks), its one program runs them all: each op
names its stage, a micro-batch's state is kept per stage, a message between two of the rank's
stages is handed over in the process (a detached copy, as a receive gives), and each stage's
gradients have their own reducer, armed before that stage's last backward (the parameters every
rank shares before the rank's last).

For recovery, a pipeline can show a callback every message it sends (:meth:`Pipeline.record_sends`)
and run steps again on a record of its receives, alone (:meth:`Pipeline.replay`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field

import torch
import torch._functorch.config
import torch.distributed as dist
from torch import nn

from dapple_lightning.plan import Plan
from dapple_lightning.rows import Rows, even_split
from dapple_lightning.runtime._comm import Incoming, Link, P2PGroups, Pending, concat_pieces, connect_pairs
from dapple_lightning.runtime._contract import StepStats, UserStep
from dapple_lightning.runtime._linear_split import LinearStore, StoredGrads, backward_stored, storable_linears
from dapple_lightning.runtime._recorded import Message, RecordedLink, recorded_links
from dapple_lightning.runtime._reducer import GradientReducer
from dapple_lightning.runtime._sharding import ShardedReducer, local_part, shard_stage
from dapple_lightning.runtime._split_backward import WeightWork, backward_input, backward_weight
from dapple_lightning.runtime._stage import StageCall, StageExit, StageModule, count_saved
from dapple_lightning.runtime._timeline import Timeline
from dapple_lightning.schedule import Op, lower

__all__ = ["Pipeline", "Recorder"]

Recorder = Callable[[str, int, list[torch.Tensor], bool], None]
"""Called with each message a rank sends: its link (``"F"`` or ``"B"``), destination, tensors, tuple flag."""


@dataclass
class _InFlight:
    """What one micro-batch leaves on this stage between its forward and its backward."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None
    loss: torch.Tensor | None = None
    as_tuple: bool = False
    saved_bytes: int = 0
    weight_work: WeightWork | None = None
    """Under a zero-bubble schedule, from its ``B`` to its ``W``: what the weights' gradient needs."""
    stored: StoredGrads | None = None
    """Under a zero-bubble schedule, the linear layers' weight work from ``B`` to ``W``."""


@dataclass
class _Step:
    """The state of one step's program while it runs."""

    rows: list[Rows]
    user: UserStep
    train: bool
    inbox: _Inbox
    split: frozenset[tuple[int, int]] = frozenset()
    """Micro-batches (by stage and micro-batch) whose backward the program splits into ``B``
    (inputs) and ``W`` (weights); the others' ``B`` is their whole backward."""
    live: dict[tuple[int, int], _InFlight] = field(default_factory=dict)
    """By stage and micro-batch (a rank with several stages holds a micro-batch once per stage)."""
    pieces: list[tuple[list[torch.Tensor], bool]] = field(default_factory=list)
    """Received pieces of the next computation's input or gradient, in program order."""
    input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    """Per micro-batch whose backward has run, the gradients its SEND_B ops send back."""
    activation_sends: dict[tuple[int, int], Pending] = field(default_factory=dict)
    """Per micro-batch, until its gradient comes back (then the peers surely have it)."""
    gradient_sends: Pending = field(default_factory=Pending)
    local: dict[tuple[str, int, int], tuple[list[torch.Tensor], bool]] = field(default_factory=dict)
    """Messages between two stages of this rank, by link, receiving stage and micro-batch."""
    reduces_left: int = 0
    """``REDUCE`` ops still to come; the last arms the sum of the parameters every rank shares."""

    def outstanding(self) -> list[Pending]:
        return [*self.activation_sends.values(), self.gradient_sends]


class Pipeline:
    """Runs one rank's share of a plan, step after step.

    Args:
        plan: the plan all ranks run.
        rank: this process's global rank.
        module: this rank's :class:`StageModule`.
        device: where activations live.
        timeline: optional event recorder.
        stage_group: process group of this stage's replicas (``None`` for one replica); their
            gradients are summed over it at the end of each training step.
        shared_params: parameters held by every rank (outside the pipelined containers, or tied
            across stages); their gradients are summed over all ranks at the end of each training
            step, and never over the stage's replicas alone.
        idle_params: shared parameters this rank holds only to take part in their sum (tied
            weights of other stages' layers): no optimizer here clears their gradients, so each
            training step starts by doing so.
        track_memory: count the bytes autograd saves per micro-batch (costs a hook call per
            saved tensor); the peak is reported in :attr:`stats`.
        p2p_groups: process groups (over all ranks) for activations and for gradients, and on NCCL
            the gloo groups for what the host reads (a :class:`~dapple_lightning.runtime.P2PGroups`);
            ``None`` uses the default group. With gloo, a connection per direction matters (see
            :func:`~dapple_lightning.runtime.p2p_groups`).
    """

    def __init__(
        self,
        plan: Plan,
        rank: int,
        module: StageModule,
        *,
        device: torch.device,
        timeline: Timeline | None = None,
        stage_group: dist.ProcessGroup | None = None,
        shared_params: Sequence[nn.Parameter] = (),
        idle_params: Sequence[nn.Parameter] = (),
        track_memory: bool = False,
        p2p_groups: P2PGroups | tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
    ) -> None:
        self.plan, self.rank, self.module, self.device = plan, rank, module, device
        self.stage_group = stage_group
        self.stages = plan.stages_of(rank)
        """The stages this rank holds: one, or with chunks several, all run from one program."""
        self.stage = self.stages[0]
        self.replica = plan.replica_of(rank)
        self.replicas = plan.stages[self.stage].replicas
        self.is_first = 0 in self.stages
        self.is_last = plan.num_stages - 1 in self.stages
        self._chunk_layers = _chunk_layers(plan, self.stages, module)
        self.timeline = timeline or Timeline(rank, self.stage, enabled=False)
        self.timeline.time_on(device)
        self.track_memory = track_memory
        self.stats = StepStats()
        groups = P2PGroups(*p2p_groups)
        # Activations go downstream on one link, gradients upstream on the other.
        self._links: dict[str, Link | RecordedLink] = {
            "F": Link(device, groups.activations, groups.activation_headers),
            "B": Link(device, groups.gradients, groups.gradient_headers),
        }
        self.host_group = groups.host
        """A gloo group over every rank for values the host reads, where the links' groups are NCCL's."""
        self._recorder: Recorder | None = None
        self._replaying = False
        self._pairs: dict[tuple[int, bool], frozenset[tuple[str, int, int]]] = {}
        self._connected: set[tuple[str, int, int]] = set()
        # Gradients are summed while the step's last backward still runs: the stage's over its
        # replicas, the parameters outside the Sequential over every rank.
        self.shared_params = list(shared_params)
        self.idle_params = list(idle_params)
        self.reducers: list[GradientReducer | ShardedReducer] = []
        self.stage_reducer: GradientReducer | ShardedReducer | None = None
        self._stage_reducers: dict[int, GradientReducer] = {}
        """With chunks, each stage's reducer over the replicas, armed before that stage's last backward."""
        self._shared_reducer: GradientReducer | None = None
        shard = plan.stages[self.stage].shard
        # A sharded stage's layers sum their gradients themselves, into shards (see _sharding).
        self.sharded = None if shard is None or stage_group is None else shard_stage(module, shard, stage_group, device)
        self._trainable: tuple[bool, ...] = ()
        self._build_reducers()
        self._param_storages = {local_part(p).untyped_storage().data_ptr() for p in module.parameters()}
        # Stage 0's B is empty (its W is the whole backward): its layers gain nothing from the store.
        plain = (self.is_first and plan.chunks == 1) or module.offload is not None
        linears = [] if plain else storable_linears(module, self.shared_params)
        # A compiled block runs its linear layers in its own graph: routed through the store, each
        # would break that graph in two. Their weight work is split like any other layer's.
        compiled = {id(m) for block in module.modules() if _is_compiled(block) for m in block.modules()}
        self._linears = LinearStore([layer for layer in linears if id(layer) not in compiled])
        self._programs: dict[tuple[int, bool], tuple[Op, ...]] = {}
        self._handlers: dict[str, Callable[[_Step, Op], None]] = {
            "F": self._forward,
            "B": self._backward,
            "SEND_F": self._send,
            "SEND_B": self._send,
            "RECV_F": self._receive,
            "RECV_B": self._receive,
            "REDUCE": self._reduce,
            "W": self._weight_backward,
        }

    # ------------------------------------------------------------------------ public API

    def rows(self, batch_rows: int) -> list[Rows]:
        """This rank's rows of the global batch, one range per micro-batch.

        Every rank checks every stage, so a batch too small for the plan stops all ranks with
        the same message instead of one rank failing and the others losing a peer.
        """
        micro = even_split(batch_rows, self.plan.micro_batches, "batch rows (micro-batches)")
        widest = max(range(self.plan.num_stages), key=lambda s: self.plan.stages[s].replicas)
        replicas = self.plan.stages[widest].replicas
        smallest = min(range(len(micro)), key=lambda m: len(micro[m]))
        if len(micro[smallest]) < replicas:
            raise ValueError(
                f"micro-batch {smallest} has {len(micro[smallest])} rows but stage {widest} has {replicas} replicas; "
                f"use a global batch of at least {self.plan.micro_batches * replicas} rows or fewer micro-batches"
            )
        return [even_split(len(r), self.replicas)[self.replica].shift(r.start) for r in micro]

    def program(self, batch_rows: int, *, train: bool) -> tuple[Op, ...]:
        """This rank's ops for a global batch of ``batch_rows`` rows."""
        key = (batch_rows, train)
        if key not in self._programs:
            programs = lower(self.plan, batch_rows, train=train)
            self._programs[key] = programs[self.rank]
            # Every rank's pairs, so that every rank opens the same ones in the same order.
            self._pairs[key] = frozenset(
                (op.kind[-1], min(r, op.peer), max(r, op.peer))
                for r, ops in enumerate(programs)
                for op in ops
                if op.kind.startswith("SEND") and not op.local
            )
        return self._programs[key]

    def run(self, batch_rows: int, user: UserStep, *, train: bool = True) -> StepStats:
        """Run this rank's program for a global batch of ``batch_rows`` rows.

        Args:
            batch_rows: rows of the global batch (same on every rank).
            user: what the program asks of the step: the user's code per micro-batch, the context
                around it, and on a last stage with replicas the values summed over them (see
                :class:`~dapple_lightning.runtime.UserStep`).
            train: run the schedule's backwards (otherwise forwards only, in order).
        """
        if train and self._requires_grad() != self._trainable:
            # Layers were frozen or unfrozen (e.g. by BaseFinetuning): every replica sees the same
            # flags, so every replica rebuilds the same buckets.
            self._build_reducers()
        if train:
            for p in self.idle_params:
                p.grad = None
        if self.sharded is not None:
            self.sharded.begin(train)
        rows = self.rows(batch_rows)
        program = self.program(batch_rows, train=train)
        if not self._replaying and (fresh := self._pairs[(batch_rows, train)] - self._connected):
            connect_pairs(fresh, self._links, self.rank)  # before any of the step's messages
            self._connected |= fresh
        step = _Step(rows, user, train, _Inbox(program, self._links))
        step.split = frozenset((self._at(op), op.micro_batch) for op in program if op.kind == "W")
        step.reduces_left = sum(op.kind == "REDUCE" for op in program)
        self.stats = StepStats()
        offload = self.module.offload
        if offload is not None:
            offload.begin(self.module.shared)
        try:
            # A split backward keeps the graph for W: compiled blocks must not donate the buffers
            # their backward reads (AOTAutograd's donated buffers need the graph freed at once).
            with torch._functorch.config.patch(donated_buffer=False) if step.split else nullcontext():
                for position, op in enumerate(program):
                    step.inbox.reach(position)
                    self._handlers[op.kind](step, op)
                    if self.timeline.enabled and op.kind in _Inbox.ACTIONS:  # the memory after each pass
                        self.timeline.counter("memory", self._memory_in_use(step))
            for outstanding in step.outstanding():
                outstanding.wait()
        except BaseException:
            # The step is lost; pending sends to a failed peer would only raise again and bury
            # the original error.
            for outstanding in step.outstanding():
                outstanding.abandon()
            for reducer in self.reducers:
                reducer.abandon()
            self.timeline.abandon()
            raise
        if train:
            self._sync_gradients()
        if offload is not None:
            offload.finish(self.stage_group if train else None)  # its own sum, layer by layer
        self.timeline.end_step()
        return self.stats

    def record_sends(self, recorder: Recorder | None) -> None:
        """From now on, show ``recorder`` every message this rank sends (``None``: stop)."""
        self._recorder = recorder

    @property
    def replaying(self) -> bool:
        """Whether the steps run now are a :meth:`replay`."""
        return self._replaying

    @contextmanager
    def replay(self, inbox: Mapping[tuple[str, int], Sequence[Message]]) -> Iterator[None]:
        """Run the steps in this block alone, on ``inbox`` (messages by link ``"F"``/``"B"`` and source
        rank, in the order they were sent): receives are served from it, sends go nowhere, no connection
        is opened and no collective runs. A stage with replicas or shared parameters (whose gradients
        are summed with other ranks) cannot run alone."""
        if self.reducers:
            raise RuntimeError("dapple replay: only a stage without replicas or shared parameters can run alone")
        links, self._links = self._links, recorded_links(self.device, inbox, kinds=tuple(self._links))
        self._replaying = True
        try:
            yield
        finally:
            self._links, self._replaying = links, False

    def _build_reducers(self) -> None:
        """Reducers for the parameters that are trainable now (frozen ones get no gradient)."""
        for reducer in self.reducers:
            reducer.remove()
        self.reducers, self.stage_reducer, self._stage_reducers, self._shared_reducer = [], None, {}, None
        if self.sharded is not None:
            self.stage_reducer = self.sharded
            self.reducers.append(self.sharded)
        elif self.stage_group is not None:
            shared = {id(p) for p in self.shared_params}
            offload = self.module.offload
            shared |= {id(p) for layer in offload.layers for p in layer.params} if offload else set()
            for stage in self.stages:  # with chunks one reducer per stage, later stages first
                own = [p for p in self._stage_parameters(stage) if id(p) not in shared]
                self._stage_reducers[stage] = GradientReducer(own, self.stage_group, device=self.device)
            last = self.plan.num_stages - 1
            self.stage_reducer = self._stage_reducers.get(last, self._stage_reducers[self.stage])
            self.reducers += [self._stage_reducers[s] for s in sorted(self._stage_reducers, reverse=True)]
        shared = [p for p in self.shared_params if p.requires_grad]
        if shared and dist.is_initialized() and dist.get_world_size() > 1:
            self._shared_reducer = GradientReducer(shared, None, device=self.device)
            self.reducers.append(self._shared_reducer)
        self._trainable = self._requires_grad()

    def _stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """The parameters of one of this rank's stages (all of the module's without chunks)."""
        layers = self._chunk_layers.get(stage)
        if layers is None:
            return list(self.module.parameters())
        return list(dict.fromkeys(p for layer in layers for p in layer.parameters()))  # a tensor hashes by identity

    def _at(self, op: Op) -> int:
        """The stage ``op`` runs on: the one it names, or this rank's only one."""
        return op.stage if op.stage >= 0 else self.stage

    def _requires_grad(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in (*self.module.parameters(), *self.shared_params))

    def close(self) -> None:
        """Detach from the module: remove the gradient hooks."""
        for reducer in self.reducers:
            reducer.remove()
        if self.module.offload is not None:  # the stage's layers back in memory, the files removed
            self.module.offload.close()

    def _memory_in_use(self, step: _Step) -> int:
        """Bytes this rank holds now: the allocator's count on CUDA; elsewhere (no allocator count)
        what its live micro-batches keep: with ``track_memory`` what autograd saved for them, else
        their inputs and outputs."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        total, seen = 0, set()
        for state in step.live.values():
            if state.saved_bytes:
                total += state.saved_bytes
                continue
            for storage in (t.untyped_storage() for t in (*state.inputs, *(state.outputs or []))):
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    # ---------------------------------------------------------------------- the handlers

    def _receive(self, step: _Step, op: Op) -> None:
        if op.local:  # from another of this rank's stages, handed over by its send
            step.pieces.append(step.local.pop((op.kind[-1], op.stage, op.micro_batch)))
            return
        with self.timeline.span("recv", op.micro_batch):
            step.pieces.append(step.inbox.take(op))

    def _send(self, step: _Step, op: Op) -> None:
        assert op.rows is not None
        key = (self._at(op), op.micro_batch)
        if op.kind == "SEND_F":
            state = step.live[key]
            assert state.outputs is not None
            tensors, as_tuple, pending = state.outputs, state.as_tuple, step.activation_sends[key]
        else:
            tensors, as_tuple, pending = step.input_grads[key], False, step.gradient_sends
        piece = [t[op.rows.start : op.rows.stop] for t in tensors]
        if op.local:
            # As a real send would: a copy without the sender's graph (the receiver makes it a leaf
            # and may free or change it in place, while the sender keeps its output for backward).
            to = op.stage + (1 if op.kind == "SEND_F" else -1)
            step.local[(op.kind[-1], to, op.micro_batch)] = ([t.detach().clone() for t in piece], as_tuple)
            return
        with self.timeline.span("send", op.micro_batch):
            self._links[op.kind[-1]].send(piece, op.peer, len(op.rows), pending, as_tuple=as_tuple)
        if self._recorder is not None:
            self._recorder(op.kind[-1], op.peer, piece, as_tuple)

    def _reduce(self, step: _Step, op: Op) -> None:
        step.reduces_left -= 1
        if op.stage < 0:
            armed = self.reducers
        else:  # one stage of several: its own sum now, the shared parameters' at the rank's last backward
            armed = [r for r in (self._stage_reducers.get(op.stage),) if r is not None]
            armed += [self._shared_reducer] if self._shared_reducer is not None and not step.reduces_left else []
        last = self._at(op) == self.plan.num_stages - 1
        for reducer in armed:
            reducer.arm(step.user.replica_share if reducer is self.stage_reducer and last else None)

    def _forward(self, step: _Step, op: Op) -> None:
        m, stage = op.micro_batch, self._at(op)
        first, last = stage == 0, stage == self.plan.num_stages - 1
        call = StageCall(
            stage, first, last, blocks=self.module.blocks, names=self.module.names, layers=self._chunk_layers.get(stage)
        )
        if not first:
            call.received, call.received_tuple = concat_pieces(stage, m, step.pieces)
            if step.train and torch.is_grad_enabled():
                for t in call.received:
                    if t.is_floating_point():
                        t.requires_grad_(True)
        step.pieces = []
        if not step.train:
            step.live.clear()  # the previous micro-batch's sends have gone out
        saved: dict[int, int] = {}
        hooks = count_saved(self._param_storages, saved) if (self.track_memory and step.train) else nullcontext()
        loss = None  # stays None on stages the user's step leaves through StageExit
        # With chunks the rank's other stages use the store; stage 0's B is empty all the same.
        storable = step.train and (stage, m) in step.split and (stage != 0 or self.plan.chunks == 1)
        stored = StoredGrads() if storable else None
        storing = self._linears.storing(stored)
        span = self.timeline.span("forward", m)
        with self.module.calling(call), span, hooks, storing, step.user.context(), suppress(StageExit):
            loss = step.user.run(m, step.rows[m])
        call.check_called()
        if last and step.train and loss is None:
            raise RuntimeError("training_step returned no loss; dapple needs a loss from every micro-batch")
        state = _InFlight(call.inputs, call.outputs, loss, call.output_tuple, stored=stored)
        if self.track_memory and step.train:
            for t in (*state.inputs, *(state.outputs or [])):
                saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            state.saved_bytes = sum(saved.values())
        step.live[stage, m] = state
        step.activation_sends[stage, m] = Pending()
        if step.train:
            self.stats.peak_live_microbatches = max(self.stats.peak_live_microbatches, len(step.live))
            self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, sum(s.saved_bytes for s in step.live.values()))

    def _backward(self, step: _Step, op: Op) -> None:
        m, stage = op.micro_batch, self._at(op)
        first, last, key = stage == 0, stage == self.plan.num_stages - 1, (stage, m)
        split = key in step.split
        state = step.live[key] if split else step.live.pop(key)
        outs, grads = self._output_grads(step, state, stage, m)
        step.pieces = []
        inputs = [t for t in state.inputs if t.is_floating_point()]
        if split:
            # Only the inputs' gradients now (the previous stage waits for them); the weights' in
            # this micro-batch's W: the linear layers' from their store (the other weights' are
            # computed now), or else from the graph kept until then. The first stage sends no input
            # gradient: its B does nothing, its W the whole backward. Recomputed layers run their
            # forward again in B: through the store, as the first time.
            with self.timeline.span("backward-input", m), self._linears.storing(state.stored):
                if self._linears.layers and state.stored is not None:
                    found = backward_stored(outs, grads, inputs, self._weights(stage), state.stored)
                    state.weight_work = WeightWork([])
                else:
                    found, state.weight_work = backward_input(
                        outs, grads, [] if first else inputs, self._weights(stage)
                    )
            if not first:
                step.input_grads[key] = [g if g is not None else torch.zeros_like(t) for t, g in zip(inputs, found)]
        else:
            with self.timeline.span("backward", m):
                if outs:
                    torch.autograd.backward(outs, grads)
            if not first:
                step.input_grads[key] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs]
        if last:
            assert state.loss is not None
            self.stats.losses.append(state.loss.detach())
        # The peers have received activation m: they sent its gradient back.
        step.activation_sends.pop(key).wait()

    def _output_grads(self, step: _Step, state: _InFlight, stage: int, m: int) -> tuple[list[torch.Tensor], list]:
        """The tensors micro-batch ``m``'s backward starts from, and their gradients (``None``: a loss)."""
        if stage == self.plan.num_stages - 1:
            assert state.loss is not None
            return ([state.loss], [None]) if state.loss.requires_grad else ([], [])
        grads, _ = concat_pieces(stage, m, step.pieces)
        outs = [t for t in state.outputs or [] if t.is_floating_point()]
        if len(outs) != len(grads):
            raise RuntimeError(f"stage {stage} expected {len(outs)} gradients for micro-batch {m}, got {len(grads)}")
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _weight_backward(self, step: _Step, op: Op) -> None:
        state = step.live.pop((self._at(op), op.micro_batch))  # its graph goes with it
        assert state.weight_work is not None, f"W{op.micro_batch} before B{op.micro_batch}"
        with self.timeline.span("backward-weight", op.micro_batch):
            backward_weight(state.weight_work, state.stored.take() if state.stored else None)

    def _weights(self, stage: int) -> list[nn.Parameter]:
        """What a ``W`` of ``stage`` computes gradients for: the stage's parameters and the shared ones."""
        return list(dict.fromkeys(p for p in (*self._stage_parameters(stage), *self.shared_params) if p.requires_grad))

    # ------------------------------------------------------------------------ the rest

    def _sync_gradients(self) -> None:
        with self.timeline.span("allreduce"):
            for reducer in self.reducers:
                summed = reducer.finish()
                if reducer is self.stage_reducer:
                    self.stats.replica_sum = summed


def _is_compiled(module: nn.Module) -> bool:
    """Whether ``module`` runs compiled: ``module.compile()``, or the wrapper ``torch.compile(module)`` returns."""
    return getattr(module, "_compiled_call_impl", None) is not None or hasattr(module, "_orig_mod")


def _chunk_layers(plan: Plan, stages: Sequence[int], module: StageModule) -> dict[int, list[nn.Module]]:
    """With chunks, each of the rank's stages' layers (the module holds them all, in stage order)."""
    if plan.chunks == 1:
        return {}
    layers, out, at = list(module), {}, 0
    for stage in stages:
        out[stage] = layers[at : at + plan.stages[stage].num_layers]
        at += plan.stages[stage].num_layers
    return out


class _Inbox:
    """A step's receives, each posted one action ahead of the action that needs it.

    A receive posted too early costs: on NCCL a posted receive is a kernel that holds its SMs
    until the data comes, so a first stage that posted its first gradient receive at the step's
    start would hold them through its whole warm-up. Posted too late, the data moves only once
    the action that needs it waits (gloo moves data only to a posted receive). So a receive is
    posted when the executor reaches the action (``F``, ``B`` or ``W``) before it: its data moves
    while that action runs.

    A channel is a direction (link) and a peer. Messages on a channel are matched in posting
    order, and the link learns what the next message holds from the previous one, so at most one
    receive per channel is posted at a time, in the program's order.
    """

    ACTIONS = ("F", "B", "W")

    def __init__(self, program: Sequence[Op], links: Mapping[str, Link | RecordedLink]) -> None:
        self.links = links
        # (the position from which a receive may be posted, the receive), in program order
        self.waiting: deque[tuple[int, Op]] = deque()
        action = 0  # the position of the latest action
        for index, op in enumerate(program):
            if op.kind in self.ACTIONS:
                action = index
            elif op.kind.startswith("RECV") and not op.local:  # local ones are handed over, never posted
                self.waiting.append((action, op))
        self.posted: dict[tuple[str, int], tuple[Op, Incoming]] = {}
        self.position = 0
        self.most_posted = 0
        """The most receives posted at once during the step."""

    def reach(self, position: int) -> None:
        """The executor is about to run the program's op at ``position``: post what is due."""
        self.position = position
        while self.waiting and self.waiting[0][0] <= position:
            op = self.waiting[0][1]
            channel = (op.kind[-1], op.peer)
            if channel in self.posted:  # its previous receive first
                break
            self.waiting.popleft()
            assert op.rows is not None
            self.posted[channel] = (op, self.links[channel[0]].post(channel[1], len(op.rows)))
            self.most_posted = max(self.most_posted, len(self.posted))

    def take(self, op: Op) -> tuple[list[torch.Tensor], bool]:
        """Wait for ``op``'s message, then post what its channel held back."""
        channel = (op.kind[-1], op.peer)
        posted_for, incoming = self.posted.pop(channel)
        assert posted_for == op, f"receive posted for {posted_for}, taken by {op}"
        out = incoming.wait()
        self.reach(self.position)
        return out
