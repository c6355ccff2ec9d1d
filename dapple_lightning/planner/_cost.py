"""DAPPLE's analytic model of one training step of a plan: latency and memory.

Notation: ``S`` stages, ``M`` micro-batches, global batch ``G``. A micro-batch holds at most
``ceil(G / M)`` samples and stage ``s`` splits it over its ``r_s`` replicas, so the slowest
replica runs ``n_s = ceil(G / (M r_s))`` samples; times and activation bytes scale linearly
from the profile batch (see ``_profile``).

Per stage ``s`` and micro-batch: ``F_s``, ``B_s`` (forward, backward of the slowest replica;
affine in its samples, see ``_profile``; ``B_s`` also carries the average cost of adding into
gradients that earlier micro-batches created, ``accumulate_s (M - 1) / M``), ``AR_s`` (ring all-reduce of the stage's gradients
over its replica group, then the optimizer step over its parameters, once per step; written
``AR`` below for both).
Between stages ``s`` and ``s + 1`` the whole micro-batch's activations cross the cut
(``cut_bytes``), re-split when the replica counts differ (split-concat): ``C^F_s`` forward,
``C^B_s`` for the gradients coming back (same bytes). Rows that the receiving replicas need
on the server where they already are move over NVLink; the rest cross the servers' network
interfaces (``Cluster.transfer_coefficient``), so where the stages sit matters.

**Transfers are stages of their own** (as in the paper): the model works on the extended
pipeline ``stage 0, link 0, stage 1, link 1, ..., stage S-1`` whose link entries have
``F = C^F``, ``B = C^B`` and no all-reduce. A link carries one transfer at a time in each
direction, activations one way and gradients the other at once (full duplex), so its steady
work is its busier direction: ``M C^F`` or ``M C^B`` plus the round trip beyond it.

**Phases against a pivot.** For a pivot ``Q`` of the extended pipeline (a stage or a link)::

    T_w = sum_{k <= Q} F_k                        # micro-batch 0 reaches Q
    T_s = (M - 1) (F_Q + B_Q)                     # Q's remaining passes
    T_e = max_s (AR_s + remaining backward of s relative to Q)

For ``s <= Q`` the remaining backward is ``sum_{s <= k <= Q} B_k``: Q can do nothing before
micro-batch 0 arrives, runs its ``2M`` passes one after another and ends with ``B_{M-1}``,
which must then flow back to ``s``. For ``s > Q`` it is negative: Q's last forward
``F_{M-1}`` comes ``K_Q - 1`` backwards before its end (its schedule runs
``M F_Q + (M - K_Q) B_Q`` up to it; for a link, its ``M`` forward transfers), and from there
micro-batch ``M - 1`` goes to the last stage and back to ``s``; back at ``s = Q`` it adds
``B_Q`` (when that round trip outlasts Q's other ``K_Q - 1`` backwards, Q waits: the stall of
a 1F1B schedule whose warm-up does not cover the transfers). Each such sum is a chain of
actions that must run one after another, so each is a lower bound on the step; the step
latency is the longest. The pivot is the ``Q`` of the longest chain, ties going to the later
``Q``; this is the paper's iteration (start at the last stage, move the pivot to an earlier
stage when that stage's steady work outweighs the current pivot's plus the work between them)
written as a maximum. ``Estimate`` reports ``T_w``, ``T_s`` and ``T_e = step - T_w - T_s``.

Two more kinds of chain bound the steady phase when transfers and downstream stages are slow,
both missing from the paper's formula: a stage that runs ``K`` forwards ahead must wait for
micro-batch ``m``'s gradient before it may start ``m + K``, so
``ceil(M / K) (F + B + round trip) + ...`` runs one after another (in ``D``); under GPipe, a
stage's first backward waits for its last forward's round trip, ``M F + round trip + M B``.
The GPipe schedule otherwise has the same chains with ``K_t = M``.

The same maximum is computed from the back in five numbers per suffix (``_recurrence``: what
:meth:`CostModel.estimate` folds over a plan's stages and the planner's dynamic program
carries); :func:`chains` writes every chain out, as a check and to name the pivot.

**Shared compute.** Devices are independent unless ``Cluster.compute_units`` says a server's
devices share fewer compute units (CPU processes on one machine's cores). Then no step is
shorter than the busiest server's compute (every device's ``M (F + B)``, all-reduce and update)
over its units: a plan that keeps every process busy, like data parallelism, waits for the
cores, and one that keeps only as many busy as there are units does not.

**Memory** per device of stage ``s``: parameters, gradients and optimizer state, ``K_s``
micro-batches kept for the backward (``K_s = min(S - s, M)`` for DAPPLE, ``M`` for GPipe) and
one micro-batch's transient peak (``_stage_memory`` says what each term counts). A stage that
recomputes (``Stage.recompute``) keeps only its layers' inputs and runs its forward again in
each backward: ``B_s`` grows by ``F_s``. Zero bubble (``zb-h1``, ``zb-h2``, ``zb-tail``) is replayed, its memory
at the schedule's peak of live micro-batches (``_zero_bubble``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from dapple_lightning.plan import ZERO_BUBBLE, Plan, whole
from dapple_lightning.planner import _zero_bubble
from dapple_lightning.planner._cluster import Cluster
from dapple_lightning.planner._profile import ModelProfile
from dapple_lightning.planner._recurrence import Tail, combine, stage_chain
from dapple_lightning.planner._sharding import shard_price
from dapple_lightning.planner._stage_memory import StageMemory, cumulative

__all__ = ["CostModel", "Estimate", "Placement", "chains", "estimate"]

# Relative slack when comparing chain lengths, so that float noise does not move the pivot.
_TIE = 1e-12


class Placement(NamedTuple):
    """Where a stage's replicas sit, as far as costs care: how many on each server.

    A named tuple rather than a dataclass: the planner builds and hashes millions of them.
    """

    replicas: int
    """Devices of the stage."""
    servers: int
    """Distinct servers those devices are on."""
    take: tuple[int, ...]
    """Devices of the stage on each server."""

    @classmethod
    def of(cls, cluster: Cluster, ranks: Sequence[int]) -> Placement:
        take = cluster.devices_per_server(ranks)
        return cls(len(ranks), sum(1 for c in take if c), take)


@dataclass(frozen=True)
class Estimate:
    """What the analytic model predicts for one plan."""

    plan: Plan
    step_s: float
    """Predicted seconds per optimizer step (one global batch)."""
    pivot: int
    """Pivot in the extended pipeline: ``2 s`` is stage ``s``, ``2 s + 1`` the link ``s -> s+1``."""
    warmup_s: float
    """``T_w``: forwards (and transfers) until micro-batch 0 has passed the pivot."""
    steady_s: float
    """``T_s = (M - 1) (F_Q + B_Q)``: the pivot's other passes."""
    ending_s: float
    """``T_e = step - T_w - T_s``: the drain after the pivot and the all-reduces (and, when
    shared compute units bound the step, the wait for them)."""
    micro_batch_size: int
    """Samples in the largest micro-batch, ``ceil(G / M)``."""
    samples: tuple[int, ...]
    """Samples each replica of each stage runs per micro-batch (its slowest replica)."""
    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    allreduce_s: tuple[float, ...]
    """Gradient all-reduce per stage (0 for one replica)."""
    update_s: tuple[float, ...]
    """Optimizer step per stage, after its all-reduce."""
    send_forward_s: tuple[float, ...]
    """Activation (and gradient) transfer time across each cut (``S - 1`` entries)."""
    memory_bytes: tuple[float, ...]
    """Peak bytes on one device of each stage."""
    memory_limit: float
    pipeline_s: float = 0.0
    """The longest chain of actions that must run one after another (the paper's latency)."""
    weight_s: tuple[float, ...] = ()
    """Under a zero-bubble schedule, each stage's ``W`` (the weights' part of ``backward_s``); else empty."""
    shared_compute_s: float = 0.0
    """The busiest server's compute seconds over its compute units when its devices share them
    (``Cluster.compute_units``), else 0. ``step_s`` is the larger of this and ``pipeline_s``."""

    @property
    def fits(self) -> bool:
        return max(self.memory_bytes) <= self.memory_limit

    @property
    def pivot_name(self) -> str:
        s, link = divmod(self.pivot, 2)
        return f"link {s}->{s + 1}" if link else f"stage {s}"

    @property
    def bubble_fraction(self) -> float:
        """Share of device time the stages spend idle within the step (all-reduce counts as idle)."""
        m = self.plan.micro_batches
        busy = sum(m * (f + b) for f, b in zip(self.forward_s, self.backward_s))
        return 1.0 - busy / (len(self.forward_s) * self.step_s) if self.step_s > 0 else 0.0


@dataclass(frozen=True)
class CostModel:
    """A profile on a cluster at a global batch: per-stage costs, fast, from prefix sums."""

    profile: ModelProfile
    cluster: Cluster
    global_batch: int
    optimizer_factor: float = 2.0
    """Optimizer state per parameter byte when the profile gives none (Adam: 2, SGD+momentum: 1)."""
    _forward: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _backward: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _params: tuple[float, ...] = field(init=False, repr=False, compare=False)
    memory: StageMemory = field(init=False, repr=False, compare=False)
    """Any stage's bytes per device (``_stage_memory``)."""
    _forward_fixed: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _backward_fixed: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _update: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _accumulate: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _forward_var: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _backward_var: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.profile, ModelProfile):
            raise TypeError(f"profile must be a ModelProfile, got {type(self.profile).__name__}")
        if not isinstance(self.cluster, Cluster):
            raise TypeError(f"cluster must be a Cluster, got {type(self.cluster).__name__}")
        whole(self.global_batch, "global_batch")
        factor = self.optimizer_factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not (0 <= factor < math.inf):
            raise ValueError(f"optimizer_factor must be a number >= 0 (Adam: 2), got {factor!r}")
        prefix = cumulative
        layers = self.profile.layers
        object.__setattr__(self, "_forward", prefix([x.forward_s for x in layers]))
        object.__setattr__(self, "_backward", prefix([x.backward_s for x in layers]))
        object.__setattr__(self, "_params", prefix([float(x.param_bytes) for x in layers]))
        object.__setattr__(self, "memory", StageMemory(self.profile, factor))
        object.__setattr__(self, "_forward_fixed", prefix([x.forward_fixed_s for x in layers]))
        object.__setattr__(self, "_backward_fixed", prefix([x.backward_fixed_s for x in layers]))
        object.__setattr__(self, "_update", prefix([x.update_s for x in layers]))
        object.__setattr__(self, "_accumulate", prefix([x.accumulate_s for x in layers]))
        object.__setattr__(self, "_forward_var", tuple(a - b for a, b in zip(self._forward, self._forward_fixed)))
        object.__setattr__(self, "_backward_var", tuple(a - b for a, b in zip(self._backward, self._backward_fixed)))

    # ---------------------------------------------------------------------------- pieces

    @property
    def num_layers(self) -> int:
        return self.profile.num_layers

    def prefix_sums(self) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
        """Prefix sums over layers of forward s and backward s (at the profile batch) and of parameter bytes."""
        return self._forward, self._backward, self._params

    def affine_prefix_sums(self) -> tuple[tuple[float, ...], ...]:
        """Prefix sums over layers, at the profile batch, of the batch-independent forward and
        backward seconds, of the per-sample rest of each and of the optimizer step seconds."""
        return self._forward_fixed, self._backward_fixed, self._forward_var, self._backward_var, self._update

    def micro_batch_size(self, micro_batches: int) -> int:
        return -(-self.global_batch // micro_batches)

    def max_replicas(self, micro_batches: int) -> int:
        """Most replicas a stage may have so that each gets a sample of every micro-batch."""
        return self.global_batch // micro_batches

    def samples(self, micro_batches: int, replicas: int) -> int:
        """Samples the slowest replica runs per micro-batch: ``ceil(G / (M r))``."""
        return -(-self.global_batch // (micro_batches * replicas))

    def compute(self, start: int, end: int, samples: int) -> tuple[float, float]:
        """Forward and backward seconds of layers ``[start, end)`` on ``samples`` samples."""
        scale = samples / self.profile.profile_batch_size
        return (
            self._forward_fixed[end]
            - self._forward_fixed[start]
            + (self._forward_var[end] - self._forward_var[start]) * scale,
            self._backward_fixed[end]
            - self._backward_fixed[start]
            + (self._backward_var[end] - self._backward_var[start]) * scale,
        )

    def passes(
        self, start: int, end: int, micro_batches: int, samples: int, recompute: bool = False
    ) -> tuple[float, float]:
        """Forward and backward seconds of one micro-batch of ``samples`` samples through layers
        ``[start, end)`` in a step of ``micro_batches``, the backward with its average cost of
        adding into gradients (:meth:`accumulate`) and, when the stage ``recompute``s, its forward."""
        forward, backward = self.compute(start, end, samples)
        backward = backward + self.accumulate(start, end, micro_batches)
        return forward, backward + forward if recompute else backward

    def accumulate(self, start: int, end: int, micro_batches: int) -> float:
        """Average extra seconds per backward of layers ``[start, end)`` for adding into gradients
        (all of a step's backwards but the first add into existing ones)."""
        return (self._accumulate[end] - self._accumulate[start]) * ((micro_batches - 1) / micro_batches)

    def allreduce(self, start: int, end: int, place: Placement) -> float:
        """Gradient all-reduce of layers ``[start, end)`` over the stage's replicas."""
        return self.cluster.allreduce_time(self._params[end] - self._params[start], place.replicas, place.servers)

    def update(self, start: int, end: int) -> float:
        """Optimizer step over the parameters of layers ``[start, end)``."""
        return self._update[end] - self._update[start]

    def cut_bytes(self, cut: int, micro_batches: int) -> float:
        """Bytes of one micro-batch's tensors crossing the cut before layer ``cut``."""
        return self.profile.cut_bytes[cut] * self.micro_batch_size(micro_batches) / self.profile.profile_batch_size

    def transfer(self, cut: int, micro_batches: int, sender: Placement, receiver: Placement) -> float:
        """Seconds to move one micro-batch's tensors across the cut before layer ``cut``."""
        return self.cluster.transfer_time(self.cut_bytes(cut, micro_batches), sender.take, receiver.take)

    # ------------------------------------------------------------------------------ plans

    def check(self, plan: Plan) -> None:
        """Raise ``ValueError`` unless the plan fits this model, cluster and batch."""
        plan.check(num_layers=self.num_layers)
        if plan.world_size > self.cluster.world_size:
            raise ValueError(
                f"the plan needs {plan.world_size} devices but the cluster {self.cluster.name} has "
                f"{self.cluster.world_size}"
            )
        if plan.micro_batches > self.global_batch:
            raise ValueError(
                f"{plan.micro_batches} micro-batches cannot split a global batch of {self.global_batch}; "
                "use at most one micro-batch per sample"
            )
        most = max(s.replicas for s in plan.stages)
        if most > self.max_replicas(plan.micro_batches):
            raise ValueError(
                f"a stage with {most} replicas leaves some without samples: a micro-batch has only "
                f"{self.global_batch // plan.micro_batches} (global batch {self.global_batch} / "
                f"{plan.micro_batches} micro-batches); use fewer micro-batches or replicas"
            )

    def placements(self, plan: Plan) -> list[Placement]:
        return [Placement.of(self.cluster, plan.stage_ranks(s)) for s in range(plan.num_stages)]

    def estimate(self, plan: Plan) -> Estimate:
        """Predicted step latency, phases, per-stage costs and memory of ``plan``."""
        self.check(plan)
        if plan.schedule in ZERO_BUBBLE:
            return _zero_bubble.zero_bubble(self, plan)
        m = plan.micro_batches
        places = self.placements(plan)
        stages = plan.stages
        count = len(stages)
        samples = tuple(self.samples(m, s.replicas) for s in stages)
        fwd, bwd = zip(*(self.passes(s.start, s.end, m, n, s.recompute) for s, n in zip(stages, samples)))
        ar = tuple(self.allreduce(s.start, s.end, p) for s, p in zip(stages, places))
        update = tuple(self.update(s.start, s.end) for s in stages)
        closing = tuple(a + u for a, u in zip(ar, update))
        send = tuple(self.transfer(stages[k].end, m, places[k], places[k + 1]) for k in range(count - 1))
        depth = [min(count - k, m) if plan.schedule == "dapple" else m for k in range(count)]
        memory = tuple(
            self.memory.stage_bytes(s.start, s.end, samples[k], depth[k], s.replicas, m, s.recompute, s.offload)
            for k, s in enumerate(stages)
        )
        if any(s.shard is not None for s in stages):
            memory, ar = self._sharded(plan, samples, depth, memory, ar)
            closing = tuple(a + u for a, u in zip(ar, update))
        tail: Tail | None = None
        for k in range(count - 1, -1, -1):
            sf = send[k] if k < count - 1 else 0.0
            after = depth[k + 1] if k < count - 1 else 0
            tail = combine(fwd[k], bwd[k], closing[k], sf, sf, m, depth[k], tail, after, plan.schedule == "gpipe")
        pipeline = tail[1] if tail is not None else 0.0
        shared = self._shared_compute(plan, fwd, bwd, closing)
        step = max(pipeline, shared)
        pivot, warm_s, steady_s = _pivot(fwd, bwd, closing, send, depth, m, plan.schedule == "gpipe")
        ending_s = step - warm_s - steady_s
        return Estimate(
            plan=plan,
            step_s=step,
            pivot=pivot,
            warmup_s=warm_s,
            steady_s=steady_s,
            ending_s=ending_s,
            micro_batch_size=self.micro_batch_size(m),
            samples=samples,
            forward_s=tuple(fwd),
            backward_s=tuple(bwd),
            allreduce_s=ar,
            update_s=update,
            send_forward_s=send,
            memory_bytes=memory,
            memory_limit=self.cluster.memory_bytes,
            pipeline_s=pipeline,
            shared_compute_s=shared,
        )

    def _sharded(
        self,
        plan: Plan,
        samples: Sequence[int],
        depth: Sequence[int],
        memory: tuple[float, ...],
        ar: tuple[float, ...],
    ) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """``memory`` and ``ar`` with each sharded stage's peak per rank and its collectives' time (its
        all-reduce plus what sharding adds) from ``_sharding.shard_price``."""
        memory, ar = list(memory), list(ar)
        for k, s in enumerate(plan.stages):
            if s.shard is None:
                continue
            price = shard_price(
                self.profile,
                self.cluster,
                s.start,
                s.end,
                replicas=s.replicas,
                mode=s.shard,
                samples=samples[k],
                depth=depth[k],
                micro_batches=plan.micro_batches,
                optimizer_factor=self.optimizer_factor,
                nodes_spanned=self.cluster.span(plan.stage_ranks(k)),
            )
            memory[k], ar[k] = price.bytes, ar[k] + price.added_seconds
        return tuple(memory), tuple(ar)

    def _shared_compute(
        self, plan: Plan, fwd: Sequence[float], bwd: Sequence[float], closing: Sequence[float]
    ) -> float:
        """The step's lower bound from compute units the devices share (0 when they do not).

        Each device of stage ``s`` computes ``M (F_s + B_s)`` plus its all-reduce and update
        (on CPUs the all-reduce's arithmetic and copies use the same cores); a server's units
        can do at most ``compute_units`` devices' worth of that at once.
        """
        cluster = self.cluster
        if not cluster.shares_compute:
            return 0.0
        work = [0.0] * cluster.nodes
        for k in range(plan.num_stages):
            per_device = plan.micro_batches * (fwd[k] + bwd[k]) + closing[k]
            for rank in plan.stage_ranks(k):
                work[cluster.node_of(rank)] += per_device
        return max(work) / cluster.compute_units  # type: ignore[operator]


def chains(
    forward: Sequence[float],
    backward: Sequence[float],
    allreduce: Sequence[float],
    send: Sequence[float],
    depth: Sequence[int],
    micro_batches: int,
    gpipe: bool = False,
) -> list[tuple[float, int, int]]:
    """Every chain of the model as ``(length, pivot, s)`` over the extended pipeline.

    Positions: ``2 k`` is stage ``k``, ``2 k + 1`` the link ``k -> k+1``. Written out one by one
    (quadratic in stages), as a check on :func:`combine` and to name the pivot.
    """
    m = micro_batches
    count = len(forward)
    f: list[float] = []
    b: list[float] = []
    ar: list[float] = []
    lead: list[float] = []
    work: list[float] = []
    for k in range(count):
        f.append(forward[k])
        b.append(backward[k])
        ar.append(allreduce[k])
        # Round trip of one micro-batch from stage k's output to its gradient coming back.
        trip = 2 * sum(send[k:]) + sum(forward[k + 1 :]) + sum(backward[k + 1 :])
        partner = None
        if k < count - 1 and not gpipe and depth[k + 1] == depth[k] - 1:
            partner = 2 * send[k] + forward[k + 1] + backward[k + 1]
        chain, to_last_forward = stage_chain(
            forward[k], backward[k], m, depth[k], trip, partner, gpipe and k < count - 1
        )
        work.append(chain)
        lead.append(to_last_forward)
        if k < count - 1:
            f += [send[k]]
            b += [send[k]]
            ar += [0.0]
            lead += [m * send[k]]
            after = sum(forward[k + 1 :]) + sum(backward[k + 1 :]) + 2 * sum(send[k + 1 :])
            # The next stage's first backward waits for its depth's worth of activations.
            warm_up = depth[k + 1] * send[k] + forward[k + 1] + backward[k + 1] + m * send[k]
            work += [max(m * send[k] + after + send[k], send[k] + after + m * send[k], warm_up)]
    out: list[tuple[float, int, int]] = []
    for q in range(len(f)):
        before = sum(f[:q])
        # Pivot q runs all its passes, then micro-batch M-1 drains back to stage s <= q.
        for s in range(0, q + 1, 2):
            out.append((before + work[q] + sum(b[s:q]) + ar[s], q, s))
        # Pivot q sends micro-batch M-1 on; it goes to the end and back to stage s > q, or
        # to a stage pivot itself, which then runs its last backward.
        for s in range(q + 1 if q % 2 else q, len(f), 2):
            out.append((before + lead[q] + sum(f[q + 1 :]) + sum(b[s:]) + ar[s], q, s))
    return out


def _pivot(
    forward: Sequence[float],
    backward: Sequence[float],
    allreduce: Sequence[float],
    send: Sequence[float],
    depth: Sequence[int],
    m: int,
    gpipe: bool,
) -> tuple[int, float, float]:
    """The pivot (longest chain, ties to the later pivot) and its warm-up and steady phases."""
    found = chains(forward, backward, allreduce, send, depth, m, gpipe)
    longest = max(length for length, _, _ in found)
    pivot = max(q for length, q, _ in found if length >= longest * (1 - _TIE))
    stage, link = divmod(pivot, 2)
    f = send[stage] if link else forward[stage]
    b = send[stage] if link else backward[stage]
    warm = sum(forward[: stage + 1]) + sum(send[: stage + link])
    return pivot, warm, (m - 1) * (f + b)


def estimate(
    plan: Plan,
    profile: ModelProfile,
    cluster: Cluster,
    global_batch: int,
    *,
    optimizer_factor: float = 2.0,
) -> Estimate:
    """Predict step latency, phases and memory of ``plan`` (see the module docstring)."""
    return CostModel(profile, cluster, global_batch, optimizer_factor).estimate(plan)
