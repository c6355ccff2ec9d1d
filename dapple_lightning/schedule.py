"""Pipeline schedules as data: per-stage computation orders, lowered to per-rank programs.

A schedule says, for each stage, in which order it runs the forward (``F``) and backward
(``B``) pass of each micro-batch. :func:`lower` turns it, for a plan and a batch size, into
every rank's program: the computations with the point-to-point messages around them
(``SEND_F``/``RECV_F`` for activations, ``SEND_B``/``RECV_B`` for gradients, one per piece
where replica counts change) and the gradient sum (``REDUCE``). The runtime executes its
rank's program op by op; :func:`simulate` runs all of them together and proves that every
send meets its receive in an order both sides follow. Nothing here touches a device.

DAPPLE (early backward) for ``S = 3`` stages and ``M = 4`` micro-batches, one column a stage,
one row a time slot when every action costs one unit (``python -m dapple_lightning.schedule 3 4``)::

    t   stage0  stage1  stage2
    0   F0
    1   F1      F0
    2   F2      F1      F0
    3                   B0
    4           B0      F1
    5   B0      F2      B1
    6   F3      B1      F2
    ...

Stage ``s`` runs ``K_s = min(S - s, M)`` warm-up forwards, then alternates one backward and
one forward, then drains the remaining backwards, so at most ``K_s`` micro-batches hold
activations at once. GPipe runs every forward, then every backward, and holds all ``M``.

ZB-H1 (zero bubble, Qi et al., ICLR 2024; ``schedule="zb-h1"``) splits each backward into ``B``,
the gradient with respect to the stage's input (the previous stage waits for it), and ``W``, the
gradient with respect to the weights (nobody waits for it). Each stage keeps DAPPLE's order of
forwards and ``B``s and defers its ``W``s so that every stage holds at most ``min(S, M)``
micro-batches from forward to ``W``, the first stage's DAPPLE peak: the later a stage, the more
``W``s it stashes before its first one, and those stashed ``W``s fill the cooldown's bubble. With
``F = B = W`` and ``M >= S`` a step takes ``3M + S - 1`` units against DAPPLE's ``3M + 3(S - 1)``
(``python -m dapple_lightning.schedule 4 8 zb-h1``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from dapple_lightning.plan import Plan
from dapple_lightning.rows import Rows, even_split, transfers

__all__ = [
    "Action",
    "Op",
    "Program",
    "dapple_schedule",
    "gpipe_schedule",
    "grid",
    "lower",
    "lower_stages",
    "peak_in_flight",
    "peak_stashed",
    "schedule",
    "simulate",
    "warmup_depth",
    "zb_h1_schedule",
]


@dataclass(frozen=True, order=True)
class Action:
    """One pass of one micro-batch on one stage: ``F3`` is the forward of micro-batch 3.

    ``B3`` is its backward: all of it, or under a zero-bubble schedule only the gradient with
    respect to the stage's input, the weights' gradient being ``W3``.
    """

    kind: Literal["F", "B", "W"]
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        kind, index = text[0], text[1:]
        if kind not in "FBW" or not index.isdigit():
            raise ValueError(f"an action is F<n>, B<n> or W<n>, got {text!r}")
        return cls(kind, int(index))  # type: ignore[arg-type]


def _check(num_stages: int, micro_batches: int, stage: int) -> None:
    if num_stages < 1 or micro_batches < 1:
        raise ValueError(f"need num_stages >= 1 and micro_batches >= 1, got {num_stages} and {micro_batches}")
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")


def warmup_depth(num_stages: int, micro_batches: int, stage: int) -> int:
    """``K_s = min(S - s, M)``: forwards stage ``s`` runs before its first backward under DAPPLE."""
    _check(num_stages, micro_batches, stage)
    return min(num_stages - stage, micro_batches)


def dapple_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """Early-backward (1F1B) order of stage ``stage``."""
    k = warmup_depth(num_stages, micro_batches, stage)
    actions = [Action("F", m) for m in range(k)]
    for m in range(micro_batches - k):
        actions += [Action("B", m), Action("F", m + k)]
    actions += [Action("B", m) for m in range(micro_batches - k, micro_batches)]
    return actions


def gpipe_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """GPipe order of stage ``stage``: all forwards, then all backwards."""
    _check(num_stages, micro_batches, stage)
    return [Action("F", m) for m in range(micro_batches)] + [Action("B", m) for m in range(micro_batches)]


def zb_h1_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """Zero-bubble ZB-H1 order of stage ``stage``: DAPPLE's forwards and input backwards, with the
    weight backwards deferred.

    Stage ``s`` stashes ``min(S, M) - K_s`` weight backwards before running one after each input
    backward, so it holds at most ``min(S, M)`` micro-batches between forward and ``W``, as many
    as DAPPLE's first stage; in the cooldown each ``B`` is followed by the oldest stashed ``W``,
    and what is left runs last, where it fills the bubble DAPPLE leaves there.
    """
    k = warmup_depth(num_stages, micro_batches, stage)
    deferred = min(num_stages, micro_batches) - k
    actions = [Action("F", m) for m in range(k)]
    weights = 0  # W's emitted so far; they run in micro-batch order, each after its B
    for m in range(micro_batches):
        actions.append(Action("B", m))
        if m >= deferred or m >= micro_batches - k:
            actions.append(Action("W", weights))
            weights += 1
        if m + k < micro_batches:
            actions.append(Action("F", m + k))
    return actions + [Action("W", m) for m in range(weights, micro_batches)]


_SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "dapple": dapple_schedule,
    "gpipe": gpipe_schedule,
    "zb-h1": zb_h1_schedule,
}


def schedule(name: str, num_stages: int, micro_batches: int) -> list[list[Action]]:
    """Every stage's action list for the named schedule (``"dapple"``, ``"gpipe"`` or ``"zb-h1"``)."""
    try:
        make = _SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(_SCHEDULES)}") from None
    return [make(num_stages, micro_batches, s) for s in range(num_stages)]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward has run and backward has not, over one stage's list.

    A micro-batch with a ``W`` holds its activations until that ``W`` (the weights' gradient
    needs them), not until its ``B``.
    """
    split = {a.micro_batch for a in actions if a.kind == "W"}
    alive = peak = 0
    for action in actions:
        if action.kind == "F":
            alive += 1
        elif action.kind == "W" or action.micro_batch not in split:
            alive -= 1
        peak = max(peak, alive)
    return peak


def peak_stashed(actions: Sequence[Action]) -> int:
    """Most micro-batches whose ``B`` has run and ``W`` has not, over one stage's list."""
    if not any(a.kind == "W" for a in actions):
        return 0  # each backward does the weights' gradient too
    stashed = peak = 0
    for action in actions:
        stashed += {"B": 1, "W": -1}.get(action.kind, 0)
        peak = max(peak, stashed)
    return peak


OpKind = Literal["F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B", "REDUCE"]
_COMPUTE = ("F", "B", "W")


@dataclass(frozen=True)
class Op:
    """One step of one rank's lowered program.

    ``F3``/``B3`` compute micro-batch 3's forward or backward on the rank's slice, ``W3`` its
    weights' gradient where the schedule splits the backward (it sends nothing).
    ``SEND_F3>2`` sends rank 2 the rows ``rows`` of F3's output, ``RECV_F3<0`` receives
    rank 0's piece of F3's input (pieces are concatenated in program order); ``SEND_B`` and
    ``RECV_B`` carry gradients back the same way. ``REDUCE`` stands before the rank's last
    backward (its last ``W`` where the schedule has them): from there on the stage's gradients are summed over its replicas as backward
    finishes them (the sums are waited for when the step ends).
    """

    kind: OpKind
    micro_batch: int = -1
    peer: int = -1
    rows: Rows | None = None
    """The rows of this rank's slice of the micro-batch that the message carries."""

    def __str__(self) -> str:
        if self.kind == "REDUCE":
            return "REDUCE"
        text = f"{self.kind}{self.micro_batch}"
        if self.kind.startswith("SEND"):
            text += f">{self.peer}"
        elif self.kind.startswith("RECV"):
            text += f"<{self.peer}"
        if self.rows is not None:
            text += f"[{self.rows.start}:{self.rows.stop}]"
        return text

    @classmethod
    def parse(cls, text: str) -> Op:
        """The op that ``str`` prints, e.g. ``"F0"``, ``"SEND_F0>1"``, ``"RECV_B2<3[0:4]"``, ``"REDUCE"``."""
        found = re.fullmatch(r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)(?:([<>])(\d+))?(?:\[(\d+):(\d+)\])?", text)
        if text == "REDUCE":
            return cls("REDUCE")
        if found is None:
            raise ValueError(
                f"an op is F<m>, B<m>, W<m>, SEND_F<m>><rank>, RECV_F<m><<rank> (and _B), or REDUCE; got {text!r}"
            )
        kind, m, arrow, peer, start, stop = found.groups()
        if (kind in _COMPUTE) != (arrow is None) or (arrow is not None and arrow != (">" if "SEND" in kind else "<")):
            raise ValueError(f"{text!r}: sends name their peer after '>', receives after '<', computations none")
        rows = Rows(int(start), int(stop)) if start is not None else None
        return cls(kind, int(m), int(peer) if peer is not None else -1, rows)  # type: ignore[arg-type]

    @property
    def action(self) -> Action:
        """The computation this op belongs to (``SEND_F3`` and ``RECV_F3`` belong to ``F3``)."""
        return Action(self.kind[-1], self.micro_batch)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Program:
    """Every rank's lowered ops for one step, and the stage each rank runs."""

    ranks: tuple[tuple[Op, ...], ...]
    stage_of: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.ranks) != len(self.stage_of):
            raise ValueError(f"{len(self.ranks)} op lists for {len(self.stage_of)} ranks")

    def __getitem__(self, rank: int) -> tuple[Op, ...]:
        return self.ranks[rank]

    def table(self) -> str:
        """One line per rank: its stage and its ops in order."""
        return "\n".join(
            f"rank {r} (stage {s}): {' '.join(map(str, ops))}"
            for r, (ops, s) in enumerate(zip(self.ranks, self.stage_of, strict=True))
        )


def _stage_ops(
    plan: Plan, stage: int, replica: int, micro: list[Rows], order: Sequence[Action], train: bool
) -> list[Op]:
    """One replica's ops: each computation with the receives it needs before it and the sends
    of what it made after it, in the order both ends of every pair follow."""
    prev = plan.stage_ranks(stage - 1) if stage > 0 else ()
    next_ = plan.stage_ranks(stage + 1) if stage < plan.num_stages - 1 else ()
    mine = plan.stages[stage].replicas
    # The weights' gradients are final in the last W, or in the last B where there is no W.
    weights = "W" if any(a.kind == "W" for a in order) else "B"
    last_backward = max((i for i, a in enumerate(order) if a.kind == weights), default=-1)
    ops: list[Op] = []
    for index, action in enumerate(order):
        m, rows = action.micro_batch, len(micro[action.micro_batch])
        upstream = [t for t in transfers(rows, len(prev), mine) if t.dst == replica] if prev else []
        downstream = [t for t in transfers(rows, mine, len(next_)) if t.src == replica] if next_ else []
        if action.kind == "F":
            ops += [Op("RECV_F", m, prev[t.src], t.dst_rows) for t in upstream]
            ops.append(Op("F", m))
            ops += [Op("SEND_F", m, next_[t.dst], t.src_rows) for t in downstream]
            continue
        if index == last_backward and train:
            ops.append(Op("REDUCE"))
        if action.kind == "W":
            ops.append(Op("W", m))
            continue
        ops += [Op("RECV_B", m, next_[t.dst], t.src_rows) for t in downstream]
        ops.append(Op("B", m))
        ops += [Op("SEND_B", m, prev[t.src], t.dst_rows) for t in upstream]
    return ops


def lower(plan: Plan, batch_rows: int, *, train: bool = True) -> Program:
    """Every rank's ops for a global batch of ``batch_rows`` rows under ``plan``.

    Training runs the plan's schedule; evaluation (``train=False``) runs the forwards in order.
    Between stages with different replica counts each micro-batch travels in pieces
    (split-concat, see :func:`~dapple_lightning.rows.transfers`), one message per piece.
    """
    micro = even_split(batch_rows, plan.micro_batches, "batch rows (micro-batches)")
    orders = (
        schedule(plan.schedule, plan.num_stages, plan.micro_batches)
        if train
        else [[Action("F", m) for m in range(plan.micro_batches)]] * plan.num_stages
    )
    stage_of = tuple(plan.stage_of(r) for r in range(plan.world_size))
    ranks = tuple(
        tuple(_stage_ops(plan, stage_of[r], plan.replica_of(r), micro, orders[stage_of[r]], train))
        for r in range(plan.world_size)
    )
    return Program(ranks, stage_of)


def lower_stages(stages: Sequence[Sequence[Action]]) -> Program:
    """A straight pipeline (one rank per stage, one row per micro-batch) running the given
    per-stage computation orders; what :func:`simulate` and :func:`grid` take stage lists as."""
    ranks = []
    last = len(stages) - 1
    for s, order in enumerate(stages):
        ops: list[Op] = []
        for action in order:
            m = action.micro_batch
            if action.kind == "F":
                ops += [Op("RECV_F", m, s - 1)] * (s > 0) + [Op("F", m)] + [Op("SEND_F", m, s + 1)] * (s < last)
            elif action.kind == "W":
                ops.append(Op("W", m))
            else:
                ops += [Op("RECV_B", m, s + 1)] * (s < last) + [Op("B", m)] + [Op("SEND_B", m, s - 1)] * (s > 0)
        ranks.append(tuple(ops))
    return Program(tuple(ranks), tuple(range(len(stages))))


@dataclass(frozen=True)
class Timed:
    """A computation placed in time by :func:`simulate`."""

    stage: int
    action: Action
    start: float
    end: float
    rank: int = -1


class _Channels:
    """Messages in flight per (direction, sender, receiver): they meet in posting order, as on
    a gloo or NCCL pair, so the k-th receive a rank posts on a channel gets the k-th send."""

    def __init__(self) -> None:
        self.sent: dict[tuple[str, int, int], list[tuple[Op, float]]] = {}
        self.taken: dict[tuple[str, int, int], int] = {}

    def send(self, rank: int, op: Op, at: float) -> None:
        self.sent.setdefault((op.kind[-1], rank, op.peer), []).append((op, at))

    def receive(self, rank: int, op: Op) -> float | None:
        """When the message ``op`` waits for was sent, or ``None`` while it has not been."""
        channel = (op.kind[-1], op.peer, rank)
        k = self.taken.get(channel, 0)
        sent = self.sent.get(channel, [])
        if k >= len(sent):
            return None
        send, at = sent[k]
        if send.micro_batch != op.micro_batch or _size(send) != _size(op):
            raise RuntimeError(
                f"schedule deadlocks: rank {rank} posts {op} but rank {op.peer}'s next message on that channel is "
                f"{send} (messages between two ranks meet in the order both sides post them)"
            )
        self.taken[channel] = k + 1
        return at

    def unreceived(self) -> list[str]:
        return [
            f"rank {src}'s {op}"
            for channel, sent in self.sent.items()
            for op, _ in sent[self.taken.get(channel, 0) :]
            for src in (channel[1],)
        ]


def simulate(
    program: Program | Sequence[Sequence[Action]],
    duration: Callable[[int, Action], float] = lambda stage, action: 1.0,
    transfer: Callable[[int, int, Action], float] = lambda src, dst, action: 0.0,
) -> list[Timed]:
    """Run every rank's ops in order, each as soon as what it waits for exists.

    A computation takes ``duration(stage, action)``; a send is posted at once (asynchronous);
    a receive waits for its message, which lands ``transfer(src_stage, dst_stage, action)``
    after it was sent. Each rank runs one op at a time. Stage lists of computations are taken
    as a straight pipeline (:func:`lower_stages`).

    Raises ``RuntimeError`` when the program cannot run: ranks wait on each other, a receive
    meets a message of another micro-batch or size on its channel, a send is never received,
    a backward runs before its forward (a ``W`` before its ``B``), or the pieces of one input
    arrive out of row order. This is how tests prove a schedule, and its lowering, free of deadlocks.
    """
    if not isinstance(program, Program):
        program = lower_stages(program)
    ranks, stage_of = program.ranks, program.stage_of
    channels = _Channels()
    cursor, clock = [0] * len(ranks), [0.0] * len(ranks)
    arrived: list[float] = [0.0] * len(ranks)  # latest piece of the current computation's input
    pieces: list[list[Rows]] = [[] for _ in ranks]
    done: list[set[Action]] = [set() for _ in ranks]
    out: list[Timed] = []
    remaining = sum(map(len, ranks))
    while remaining:
        progressed = False
        for r, ops in enumerate(ranks):
            while cursor[r] < len(ops):
                op = ops[cursor[r]]
                if op.kind.startswith("RECV"):
                    at = channels.receive(r, op)
                    if at is None:
                        break
                    arrived[r] = max(arrived[r], at + transfer(stage_of[op.peer], stage_of[r], op.action))
                    if op.rows is not None:
                        pieces[r].append(op.rows)
                elif op.kind.startswith("SEND"):
                    channels.send(r, op, clock[r])
                elif op.kind in _COMPUTE:
                    _check_input(r, op, pieces[r], done[r])
                    start = max(clock[r], arrived[r])
                    clock[r] = start + duration(stage_of[r], op.action)
                    done[r].add(op.action)
                    out.append(Timed(stage_of[r], op.action, start, clock[r], r))
                    arrived[r], pieces[r] = 0.0, []
                cursor[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(ops[cursor[r]]) for r, ops in enumerate(ranks) if cursor[r] < len(ops)}
            raise RuntimeError(f"schedule deadlocks: ranks wait on each other at {stuck}")
    if lost := channels.unreceived():
        raise RuntimeError(f"schedule deadlocks: {', '.join(lost)} is never received")
    return out


def _size(op: Op) -> int | None:
    return None if op.rows is None else len(op.rows)


def _check_input(rank: int, op: Op, pieces: list[Rows], done: set[Action]) -> None:
    if op.kind == "B" and Action("F", op.micro_batch) not in done:
        raise RuntimeError(f"rank {rank} runs {op} before F{op.micro_batch}")
    if op.kind == "W" and Action("B", op.micro_batch) not in done:
        raise RuntimeError(f"rank {rank} runs {op} before B{op.micro_batch}")
    for before, after in itertools.pairwise(pieces):
        if before.stop != after.start:
            raise RuntimeError(
                f"rank {rank}'s {op} would concatenate its input pieces out of row order "
                f"({', '.join(f'[{p.start}:{p.stop})' for p in pieces)})"
            )


def grid(stages: Sequence[Sequence[Action]]) -> str:
    """The schedule drawn as a table, one row per unit time slot, one column per stage."""
    timed = simulate(stages)
    horizon = int(max((t.end for t in timed), default=0))
    cells = [[""] * len(stages) for _ in range(horizon)]
    for t in timed:
        cells[int(t.start)][t.stage] = str(t.action)
    header = ["t"] + [f"stage{s}" for s in range(len(stages))]
    rows = [header] + [[str(i), *row] for i, row in enumerate(cells)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":  # pragma: no cover - a drawing aid
    import sys

    s, m = (int(a) for a in sys.argv[1:3])
    name = sys.argv[3] if len(sys.argv) > 3 else "dapple"
    print(grid(schedule(name, s, m)))
