"""Executes one rank's share of a DAPPLE plan for one global batch.

The user's ``nn.Sequential`` is replaced, on every rank, by a :class:`StageModule` holding
only that rank's layers (under their original names, so state-dict keys do not change). The
user's own step function still calls it once per micro-batch:

* on the first stage it runs the local layers on the argument it is given;
* on later stages it ignores its argument and runs the local layers on the activation
  received from the previous stage;
* on every stage but the last it then hands the output to the pipeline and raises
  :class:`StageExit`, which ends the rest of the user's step there (no loss to compute).

:class:`Pipeline` walks the rank's schedule (see :mod:`dapple_lightning.schedule`), receives
and sends activations and gradients (split-concat between stages with different replica
counts, see :mod:`dapple_lightning.microbatch`), and runs each backward as the schedule says.
Gradients accumulate in ``.grad`` over the micro-batches; :class:`GradientReducer` sums them
once per step, bucket by bucket while the step's last backward runs: a stage's over its
replicas, the parameters outside the Sequential over every rank. Large gradients are summed in
place, and the last stage's loss rides along with its gradients.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dapple_lightning import comm
from dapple_lightning.microbatch import Rows, even_split, transfers
from dapple_lightning.plan import Plan
from dapple_lightning.schedule import Action, schedule
from dapple_lightning.timeline import Timeline

__all__ = ["GradientReducer", "Pipeline", "StageExit", "StageModule", "p2p_groups"]


class StageExit(BaseException):
    """Ends the user's step on ranks that do not hold the last stage.

    Derived from ``BaseException`` so that a user's ``except Exception`` cannot swallow it.
    """


Activation = torch.Tensor | tuple[torch.Tensor, ...]


def _as_list(value: Any, where: str) -> tuple[list[torch.Tensor], bool]:
    if isinstance(value, torch.Tensor):
        return [value], False
    if isinstance(value, tuple | list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return list(value), True
    raise TypeError(
        f"{where} is a {type(value).__name__}; what flows between pipeline stages must be a tensor or a "
        "tuple of tensors with the batch in dim 0 (wrap other values in the layers or pass them as tensors)"
    )


def _rebuild(tensors: list[torch.Tensor], as_tuple: bool) -> Activation:
    return tuple(tensors) if as_tuple else tensors[0]


class StageModule(nn.Sequential):
    """The layers ``[start, end)`` of the user's Sequential that live on this rank.

    Children keep their indices in the original Sequential as names (``"6"``, ``"7"``, ...),
    so ``state_dict`` keys equal those of the unpartitioned model.
    """

    def __init__(self, layers: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__(OrderedDict(layers))
        # A plain attribute, not a submodule: the pipeline is runtime state, not model state.
        self._pipeline: Pipeline | None = None

    def forward(self, input: Any) -> Any:
        pipeline = self._pipeline
        if pipeline is None:  # outside a pipelined step: behave like the original slice
            return super().forward(input)
        return pipeline._run_stage(super().forward, input)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_pipeline"] = None  # process groups do not pickle, and a copy has none
        return state


@dataclass
class _InFlight:
    """What one micro-batch leaves on this stage between its forward and its backward."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor] | None = None
    loss: torch.Tensor | None = None
    as_tuple: bool = False
    saved_bytes: int = 0


@dataclass
class StepStats:
    """What a step measured on this rank."""

    peak_live_microbatches: int = 0
    peak_live_bytes: int = 0
    losses: list[torch.Tensor] = field(default_factory=list)
    carried: torch.Tensor | None = None
    """The sum over the stage's replicas of what ``Pipeline.run(carry=...)`` gave (float64)."""


class Pipeline:
    """Runs one rank's actions of a plan.

    Args:
        plan: the plan all ranks run.
        rank: this process's global rank.
        module: this rank's :class:`StageModule`.
        device: where activations live.
        timeline: optional event recorder.
        stage_group: process group of this stage's replicas (``None`` for one replica); their
            gradients are summed over it at the end of each training step.
        shared_params: parameters outside the pipelined Sequential, held by every rank; their
            gradients are summed over all ranks at the end of each training step.
        track_memory: count the bytes autograd saves per micro-batch (costs a hook call per
            saved tensor); the peak is reported in :attr:`stats`.
        p2p_groups: process groups (over all ranks) for activations and for gradients; ``None``
            uses the default group. With gloo, a connection per direction matters (see
            :func:`p2p_groups`).
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
        track_memory: bool = False,
        p2p_groups: tuple[dist.ProcessGroup | None, dist.ProcessGroup | None] = (None, None),
    ) -> None:
        self.plan, self.rank, self.module, self.device = plan, rank, module, device
        self.stage_group = stage_group
        self.stage = plan.stage_of(rank)
        self.replica = plan.replica_of(rank)
        self.replicas = plan.stages[self.stage].replicas
        self.is_first = self.stage == 0
        self.is_last = self.stage == plan.num_stages - 1
        self.prev_ranks = plan.stage_ranks(self.stage - 1) if not self.is_first else ()
        self.next_ranks = plan.stage_ranks(self.stage + 1) if not self.is_last else ()
        self.timeline = timeline or Timeline(rank, self.stage, enabled=False)
        self.track_memory = track_memory
        self.stats = StepStats()
        module._pipeline = self
        # Activations go downstream on one link, gradients upstream on the other.
        self.activations = comm.Link(device, p2p_groups[0])
        self.gradients = comm.Link(device, p2p_groups[1])
        # Gradients are summed while the step's last backward still runs: the stage's over its
        # replicas, the parameters outside the Sequential over every rank.
        self.reducers: list[GradientReducer] = []
        self.stage_reducer: GradientReducer | None = None
        if stage_group is not None:
            self.stage_reducer = GradientReducer(module.parameters(), stage_group, device=device)
            self.reducers.append(self.stage_reducer)
        self.shared_params = list(shared_params)
        shared = [p for p in self.shared_params if p.requires_grad]
        if shared and dist.is_initialized() and dist.get_world_size() > 1:
            self.reducers.append(GradientReducer(shared, None, device=device))
        self._param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
        # Per-call state, set by `run` around each user step call.
        self._input: list[torch.Tensor] | None = None
        self._input_tuple = False
        self._output: list[torch.Tensor] | None = None
        self._output_tuple = False
        self._calls = 0

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

    def run(
        self,
        batch_rows: int,
        forward: Callable[[int, Rows], torch.Tensor | None],
        *,
        train: bool = True,
        forward_context: Callable[[], Any] = nullcontext,
        carry: Callable[[], torch.Tensor] | None = None,
    ) -> StepStats:
        """Run this rank's actions for a global batch of ``batch_rows`` rows.

        Args:
            batch_rows: rows of the global batch (same on every rank).
            forward: ``forward(m, rows)`` runs the user's step on this rank's ``rows`` of
                micro-batch ``m``; the step must call the :class:`StageModule` exactly once.
                On the last stage, when training, it returns the loss to back-propagate
                (already scaled by the micro-batch's share of the global batch).
            train: run the schedule's backwards (otherwise forwards only, in order).
            forward_context: entered around each forward (e.g. autocast); backwards run outside.
            carry: when training on a last stage with replicas, called once after the step's last
                forward; the 1-D tensor it returns is summed over the stage's replicas along with
                the gradients (no collective of its own) into ``stats.carried``.
        """
        rows = self.rows(batch_rows)
        micro = even_split(batch_rows, self.plan.micro_batches)
        if train:
            actions = schedule(self.plan.schedule, self.plan.num_stages, self.plan.micro_batches)[self.stage]
        else:
            actions = [Action("F", m) for m in range(self.plan.micro_batches)]
        self.stats = StepStats()
        live: dict[int, _InFlight] = {}
        sent: dict[int, comm.Pending] = {}  # activation sends per micro-batch, until its gradient is back
        pending = comm.Pending()  # gradient sends, until the step ends
        inbox = _Inbox([self._sources(a, len(micro[a.micro_batch])) for a in actions])
        last_backward = max((i for i, a in enumerate(actions) if a.kind == "B"), default=-1)
        try:
            for index, action in enumerate(actions):
                m = action.micro_batch
                if index == last_backward:
                    for reducer in self.reducers:
                        reducer.arm(carry if reducer is self.stage_reducer and self.is_last else None)
                if action.kind == "F":
                    sent[m] = comm.Pending()
                    live[m] = self._forward(
                        m, rows[m], len(micro[m]), forward, forward_context, inbox, index, sent[m], train
                    )
                    if not train:
                        live.pop(m)
                    self._note_peak(live)
                else:
                    self._backward(m, len(micro[m]), live.pop(m), inbox, index, pending)
                    # The peers have received activation m: they sent its gradient back.
                    sent.pop(m).wait()
            for outstanding in (*sent.values(), pending):
                outstanding.wait()
        except BaseException:
            # The step is lost; pending sends to a failed peer would only raise again and bury
            # the original error.
            for outstanding in (*sent.values(), pending):
                outstanding.abandon()
            for reducer in self.reducers:
                reducer.abandon()
            raise
        finally:
            self._input = self._output = None
        if train:
            self._sync_gradients()
        self.timeline.step += 1
        return self.stats

    def close(self) -> None:
        """Detach from the module: remove the gradient hooks and the stage call's redirection."""
        for reducer in self.reducers:
            reducer.remove()
        if self.module._pipeline is self:
            self.module._pipeline = None

    def _sync_gradients(self) -> None:
        with self.timeline.span("allreduce"):
            for reducer in self.reducers:
                carried = reducer.finish()
                if reducer is self.stage_reducer:
                    self.stats.carried = carried

    # --------------------------------------------------------------------- the stage call

    def _run_stage(self, layers: Callable[[Any], Any], arg: Any) -> Any:
        self._calls += 1
        if self._calls > 1:
            raise RuntimeError(
                "training_step/validation_step called the pipelined Sequential more than once for one batch; "
                "dapple needs each step to pass the batch through the Sequential exactly once"
            )
        if self.is_first:
            tensors, as_tuple = _as_list(arg, "the input of the pipelined Sequential")
            self._input, self._input_tuple = tensors, as_tuple
        else:
            tensors, as_tuple = self._input, self._input_tuple
        out = layers(_rebuild(tensors, as_tuple))
        self._output, self._output_tuple = _as_list(out, f"the output of stage {self.stage}")
        if not self.is_last:
            raise StageExit
        return out

    # ----------------------------------------------------------------------- forward pass

    def _forward(self, m, rows, micro_rows, forward, forward_context, inbox, index, pending, train) -> _InFlight:
        if not self.is_first:
            with self.timeline.span("recv", m):
                tensors, as_tuple = self._concat(m, inbox.take(index))
            if train and torch.is_grad_enabled():
                for t in tensors:
                    if t.is_floating_point():
                        t.requires_grad_(True)
            self._input, self._input_tuple = tensors, as_tuple
        self._output, self._calls = None, 0
        loss = None
        saved: dict[int, int] = {}
        hooks = self._saved_tensor_counter(saved) if (self.track_memory and train) else nullcontext()
        with self.timeline.span("forward", m), hooks, forward_context(), suppress(StageExit):
            loss = forward(m, rows)
        if self._calls == 0:
            raise RuntimeError(
                "training_step/validation_step did not call the pipelined Sequential; dapple needs each step to "
                "pass the batch through the Sequential exactly once"
            )
        if self.is_last and train and loss is None:
            raise RuntimeError("training_step returned no loss; dapple needs a loss from every micro-batch")
        state = _InFlight(inputs=self._input or [], outputs=self._output, loss=loss, as_tuple=self._output_tuple)
        if self.track_memory and train:
            for t in (*state.inputs, *(state.outputs or [])):
                saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            state.saved_bytes = sum(saved.values())
        if not self.is_last:
            with self.timeline.span("send", m):
                self._send_pieces(state.outputs, state.as_tuple, micro_rows, self.next_ranks, pending, downstream=True)
        if not train:
            state.inputs, state.outputs = [], None
        return state

    def _saved_tensor_counter(self, saved: dict[int, int]):
        params = self._param_storages

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in params:
                saved.setdefault(ptr, storage.nbytes())
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def _note_peak(self, live: dict[int, _InFlight]) -> None:
        self.stats.peak_live_microbatches = max(self.stats.peak_live_microbatches, len(live))
        self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, sum(s.saved_bytes for s in live.values()))

    # ---------------------------------------------------------------------- backward pass

    def _backward(
        self, m: int, micro_rows: int, state: _InFlight, inbox: _Inbox, index: int, pending: comm.Pending
    ) -> None:
        if self.is_last:
            assert state.loss is not None
            with self.timeline.span("backward", m):
                if state.loss.requires_grad:
                    torch.autograd.backward(state.loss)
            self.stats.losses.append(state.loss.detach())
        else:
            with self.timeline.span("recv", m):
                grads, _ = self._concat(m, inbox.take(index))
            outs = [t for t in state.outputs or [] if t.is_floating_point()]
            if len(outs) != len(grads):
                raise RuntimeError(
                    f"stage {self.stage} expected {len(outs)} gradients for micro-batch {m}, got {len(grads)}"
                )
            pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
            with self.timeline.span("backward", m):
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not self.is_first:
            grads = []
            for t in state.inputs:
                if t.is_floating_point():
                    grads.append(t.grad if t.grad is not None else torch.zeros_like(t))
            with self.timeline.span("send", m):
                self._send_pieces(grads, False, micro_rows, self.prev_ranks, pending, downstream=False)

    # ------------------------------------------------------------------- split / concat

    def _send_pieces(self, tensors, as_tuple, micro_rows, peers, pending, *, downstream: bool) -> None:
        """Send this replica's rows to the peer stage's replicas that own them."""
        if downstream:
            moves = [
                (t.dst, t.src_rows) for t in transfers(micro_rows, self.replicas, len(peers)) if t.src == self.replica
            ]
        else:
            moves = [
                (t.src, t.dst_rows) for t in transfers(micro_rows, len(peers), self.replicas) if t.dst == self.replica
            ]
            moves.sort()
        for peer, rows in moves:
            piece = [t[rows.start : rows.stop] for t in tensors]
            link = self.activations if downstream else self.gradients
            link.send(piece, peers[peer], len(rows), pending, as_tuple=as_tuple)

    def _sources(self, action: Action, micro_rows: int) -> list[tuple[comm.Link, int, int]]:
        """What ``action`` receives: (link, global rank, rows) per piece, in concatenation order."""
        if action.kind == "F":
            if self.is_first:
                return []
            # activations from the previous stage
            moves = transfers(micro_rows, len(self.prev_ranks), self.replicas)
            return [(self.activations, self.prev_ranks[t.src], len(t.dst_rows)) for t in moves if t.dst == self.replica]
        if self.is_last:
            return []
        # gradients from the next stage, for the rows this replica sent
        moves = transfers(micro_rows, self.replicas, len(self.next_ranks))
        return [
            (self.gradients, self.next_ranks[t.dst], len(t.src_rows))
            for t in sorted(moves, key=lambda t: t.dst)
            if t.src == self.replica
        ]

    def _concat(self, m: int, pieces: list[tuple[list[torch.Tensor], bool]]) -> tuple[list[torch.Tensor], bool]:
        """Concatenate the pieces of this replica's slice received from the peer stage's replicas."""
        as_tuple = pieces[0][1]
        counts = {len(p[0]) for p in pieces}
        if len(counts) != 1:
            raise RuntimeError(f"stage {self.stage} received pieces of micro-batch {m} with different tensor counts")
        if len(pieces) == 1:
            return pieces[0][0], as_tuple
        return [torch.cat(parts) for parts in zip(*(p[0] for p in pieces))], as_tuple


class _Inbox:
    """Receives of one step, each posted as soon as the previous one on the same channel is in.

    ``needs[i]`` lists what action ``i`` receives, as (link, global rank, rows) per piece; a
    channel is a link and a peer. Messages on a channel are matched in posting order, so at
    most one per channel is posted ahead.
    """

    def __init__(self, needs: list[list[tuple[comm.Link, int, int]]]) -> None:
        self.needs = needs
        self.queues: dict[tuple[int, int], deque[tuple[int, comm.Link, int]]] = {}
        for index, need in enumerate(needs):
            for link, peer, rows in need:
                self.queues.setdefault((id(link), peer), deque()).append((index, link, rows))
        self.posted: dict[tuple[int, int], tuple[int, comm.Incoming]] = {}
        for channel in self.queues:
            self._post_next(channel)

    def _post_next(self, channel: tuple[int, int]) -> None:
        if self.queues[channel]:
            index, link, rows = self.queues[channel].popleft()
            self.posted[channel] = (index, link.post(channel[1], rows))

    def take(self, index: int) -> list[tuple[list[torch.Tensor], bool]]:
        """Wait for action ``index``'s messages, posting each channel's next receive as its message lands."""
        out = []
        for link, peer, _ in self.needs[index]:
            channel = (id(link), peer)
            posted_for, incoming = self.posted.pop(channel)
            assert posted_for == index, f"receive posted for action {posted_for}, taken by action {index}"
            out.append(incoming.wait())
            self._post_next(channel)
        return out


class GradientReducer:
    """Sums gradients over a group of replicas, starting while the step's last backward runs.

    Parameters are cut into buckets in reverse registration order (about the order in which
    backward finishes their gradients). A parameter of at least ``alone_bytes`` is a bucket of
    its own, summed in place in its ``.grad``: no copy in and none out, where copies cost the
    most. Smaller ones are packed into flat buckets (the first small, so that communication
    starts early, then up to ``bucket_bytes``), each summed as one tensor whose views become the
    gradients. A collective has a price of its own: with gloo on 2 busy CPU cores, summing the
    benchmark transformer's sixteen 1 MiB weights alone made its step 0.9% slower than packing
    them (about 0.5 ms per collective beyond the copy it saves), while copying the VGG
    example's 4 and 8 MiB dense weights took 1 ms of its 87 ms step; hence 4 MiB. Once :meth:`arm` is called, each parameter's post-accumulate hook marks it final;
    a bucket's asynchronous all-reduce starts when all its parameters are final and every
    earlier bucket has started, so every replica issues the same collectives in the same order,
    as DDP's reducer does.

    The last bucket is always flat. It carries one flag per parameter (after the sum: how many
    replicas had a gradient) and what the caller asks to have summed along (``arm(carry=...)``,
    e.g. the step's loss), which saves a collective per step. :meth:`finish` starts what
    backward did not reach (parameters without a gradient in the last micro-batch), waits, and
    writes the sums into ``.grad``; a parameter keeps ``grad=None`` only if no replica produced
    a gradient for it, as on one device.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: dist.ProcessGroup | None,
        *,
        device: torch.device | None = None,
        bucket_bytes: int = 25 * 2**20,
        first_bucket_bytes: int = 2**20,
        alone_bytes: int = 4 * 2**20,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.device = device if device is not None else (self.params[0].device if self.params else torch.device("cpu"))
        self.buckets: list[list[nn.Parameter]] = []
        self.alone: list[bool] = []  # per bucket: one parameter, summed in its own .grad
        packing: list[nn.Parameter] = []  # the flat bucket being filled; alone buckets may pass it
        size, limit = 0, first_bucket_bytes
        for p in reversed(self.params):
            nbytes = p.numel() * p.element_size()
            if nbytes >= alone_bytes:
                self.buckets.append([p])
                self.alone.append(True)
                continue
            if packing and (size + nbytes > limit or packing[0].dtype != p.dtype):
                self.buckets.append(packing)
                self.alone.append(False)
                packing, size, limit = [], 0, bucket_bytes
            packing.append(p)
            size += nbytes
        if packing or (self.buckets and self.alone[-1]):  # the flags need a flat bucket last
            self.buckets.append(packing)
            self.alone.append(False)
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._armed = False
        self._missing: list[int] = []
        self._launched: list[tuple[torch.Tensor, Any]] = []
        self._carry: Callable[[], torch.Tensor] | None = None
        self._carried: torch.Tensor | None = None  # where the carried values are summed
        self._carried_work: Any = None  # their own collective, when they could not ride along
        self._carried_along = 0  # how many of them ride at the end of the last bucket

        def ready(param: torch.Tensor) -> None:  # a closure, not a bound method: deepcopy keeps it shared
            if self._armed:
                self._ready(param)

        self._handles = [p.register_post_accumulate_grad_hook(ready) for p in self.params]

    def arm(self, carry: Callable[[], torch.Tensor] | None = None) -> None:
        """The next backward is the step's last on this rank: start all-reduces as gradients land.

        ``carry``, called once when the last bucket starts (after this step's forwards), returns a
        1-D float64 tensor to sum over the replicas along with the gradients; :meth:`finish`
        returns the sum.
        """
        self._missing = [len(bucket) for bucket in self.buckets]
        self._launched = []
        self._carry = carry
        self._carried, self._carried_work, self._carried_along = None, None, 0
        self._armed = True

    def _ready(self, param: torch.Tensor) -> None:
        b = self._bucket_of.get(id(param))
        if b is None:
            return
        self._missing[b] -= 1
        while len(self._launched) < len(self.buckets) and self._missing[len(self._launched)] <= 0:
            self._launch(len(self._launched))

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if self.alone[b]:
            (p,) = bucket
            # A replica without a gradient adds zeros; the flags in the last bucket tell None apart.
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if not grad.is_contiguous():
                grad = grad.contiguous()
            self._launched.append((grad, dist.all_reduce(grad, group=self.group, async_op=True)))
            return
        pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]
        dtype = bucket[0].dtype if bucket else torch.float64
        last = b == len(self.buckets) - 1
        if last:
            pieces.append(torch.tensor([p.grad is not None for p in self.params], dtype=dtype, device=self.device))
            if self._carry is not None and dtype in (torch.float32, torch.float64):
                values = self._take_carry()
                pieces.append(values.to(dtype))
                self._carried_along = values.numel()
            elif self._carry is not None:  # bf16 or fp16 is too coarse for a loss: a collective of its own
                self._carry_alone()
        flat = torch.cat(pieces)
        self._launched.append((flat, dist.all_reduce(flat, group=self.group, async_op=True)))
        if last and self._carried_along:
            self._carried = flat[flat.numel() - self._carried_along :]

    def _take_carry(self) -> torch.Tensor:
        assert self._carry is not None
        carry, self._carry = self._carry, None
        return carry().to(device=self.device, dtype=torch.float64).reshape(-1)

    def _carry_alone(self) -> None:
        self._carried = self._take_carry()
        self._carried_work = dist.all_reduce(self._carried, group=self.group, async_op=True)

    def finish(self) -> torch.Tensor | None:
        """Start the remaining buckets, wait for all, and write the sums into ``.grad``; returns
        the sum of what :meth:`arm`'s ``carry`` gave (float64), if anything."""
        if not self._armed:  # no backward this step (nothing to sum), as for a forward-only step
            self.arm()
        self._armed = False
        while len(self._launched) < len(self.buckets):
            self._launch(len(self._launched))
        if not self.buckets and self._carry is not None:  # no gradients to ride along with
            self._carry_alone()
        for _, work in self._launched:
            work.wait()
        if self._carried_work is not None:
            self._carried_work.wait()
        if self.buckets:
            last, end = self._launched[-1][0], self._launched[-1][0].numel() - self._carried_along
            counts = dict(zip(map(id, self.params), last[end - len(self.params) : end].tolist(), strict=True))
            for bucket, alone, (summed, _) in zip(self.buckets, self.alone, self._launched, strict=True):
                offset = 0
                for p in bucket:
                    n = p.numel()
                    # The sum becomes the gradient in place: the parameter's own tensor or a view into the bucket.
                    grad = summed if alone else summed[offset : offset + n].view_as(p)
                    p.grad = grad if counts[id(p)] else None
                    offset += n
        self._launched = []
        carried = self._carried
        self._carried, self._carried_work, self._carried_along = None, None, 0
        return None if carried is None else carried.to(torch.float64)

    def abandon(self) -> None:
        """Forget outstanding all-reduces (the step failed; a peer may be gone)."""
        self._armed = False
        self._launched = []
        self._carry = None
        self._carried, self._carried_work, self._carried_along = None, None, 0

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def p2p_groups(**kwargs: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Two process groups over all ranks: one for activations, one for gradients (collective).

    Gloo keeps one connection per pair of ranks and group. With both directions of a pipeline
    on one connection, posting a receive took 1.3-1.9 ms on average (up to 7 ms) in a
    2-process 1F1B probe on 2 CPU cores, and a micro-batch cost 12.8 ms against 10.3 ms of
    compute; with a connection per direction, 0.03-0.05 ms and 10.6 ms. Activations flow only
    downstream and gradients only upstream, so one group per kind gives each direction its own
    connection.
    """
    return dist.new_group(**kwargs), dist.new_group(**kwargs)


def stage_group(plan: Plan, rank: int, **kwargs: Any) -> dist.ProcessGroup | None:
    """The process group of ``rank``'s stage replicas (``None`` for a stage on one rank).

    Every rank must call this with the same plan: creating a group is collective.
    """
    mine = None
    for index in range(plan.num_stages):
        ranks = list(plan.stage_ranks(index))
        if len(ranks) > 1:
            group = dist.new_group(ranks, **kwargs)
            if rank in ranks:
                mine = group
    return mine
