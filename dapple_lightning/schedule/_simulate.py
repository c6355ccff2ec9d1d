"""The simulator: every rank's program run together, to place it in time and prove it free of deadlocks."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dapple_lightning.rows import Rows
from dapple_lightning.schedule._lower import _COMPUTE, Op, Program, lower_stages
from dapple_lightning.schedule._orders import Action


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
        step = 1 if op.kind == "RECV_F" else -1  # the stage a message reaches, from the one it left
        if (
            send.micro_batch != op.micro_batch
            or _size(send) != _size(op)
            or (op.stage - send.stage != step and op.stage >= 0)
        ):
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
                    out.append(Timed(op.stage if op.stage >= 0 else stage_of[r], op.action, start, clock[r], r))
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
    if op.kind == "B" and Action("F", op.micro_batch, op.stage) not in done:
        raise RuntimeError(f"rank {rank} runs {op} before {Action('F', op.micro_batch, op.stage)}")
    if op.kind == "W" and Action("B", op.micro_batch, op.stage) not in done:
        raise RuntimeError(f"rank {rank} runs {op} before {Action('B', op.micro_batch, op.stage)}")
    for before, after in itertools.pairwise(pieces):
        if before.stop != after.start:
            raise RuntimeError(
                f"rank {rank}'s {op} would concatenate its input pieces out of row order "
                f"({', '.join(f'[{p.start}:{p.stop})' for p in pieces)})"
            )


def grid(stages: Sequence[Sequence[Action]]) -> str:
    """The schedule drawn as a table, one row per unit time slot, one column per stage (per rank
    group where the actions name their stages: ``F3@2`` is micro-batch 3's forward on stage 2)."""
    timed = simulate(stages)
    horizon = int(max((t.end for t in timed), default=0))
    cells = [[""] * len(stages) for _ in range(horizon)]
    for t in timed:
        cells[int(t.start)][t.rank] = str(t.action)
    chunked = any(a.stage >= 0 for order in stages for a in order)
    header = ["t"] + [f"{'group' if chunked else 'stage'}{s}" for s in range(len(stages))]
    rows = [header] + [[str(i), *row] for i, row in enumerate(cells)]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
