"""Lowering: a plan's per-stage orders turned into every rank's program, messages included."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from dapple_lightning.plan import Plan
from dapple_lightning.rows import Rows, even_split, transfers
from dapple_lightning.schedule._chunked import chunked_schedule
from dapple_lightning.schedule._orders import Action, schedule

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
    stage: int = -1
    """Where a rank holds several stages (chunks): the one this op computes for or carries from
    (a send) or to (a receive); ``-1`` where it holds one. Printed after ``@``."""
    local: bool = False
    """A message between two stages of the same rank (``peer`` is the rank itself): handed over
    in the process, never sent. Printed ``>local`` / ``<local``."""

    def __str__(self) -> str:
        if self.kind == "REDUCE":
            return "REDUCE" + (f"@{self.stage}" if self.stage >= 0 else "")
        text = f"{self.kind}{self.micro_batch}" + (f"@{self.stage}" if self.stage >= 0 else "")
        peer = "local" if self.local else str(self.peer)
        if self.kind.startswith("SEND"):
            text += f">{peer}"
        elif self.kind.startswith("RECV"):
            text += f"<{peer}"
        if self.rows is not None:
            text += f"[{self.rows.start}:{self.rows.stop}]"
        return text

    @classmethod
    def parse(cls, text: str) -> Op:
        """The op that ``str`` prints, e.g. ``"F0"``, ``"SEND_F0>1"``, ``"RECV_B2<3[0:4]"``, ``"REDUCE"``
        (``"F0@2"``, ``"SEND_F0@1>local"``, ``"REDUCE@1"`` where a rank holds several stages; a local
        message parses with peer ``-1``)."""
        found = re.fullmatch(
            r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)(?:@(\d+))?(?:([<>])(\d+|local))?(?:\[(\d+):(\d+)\])?", text
        )
        if reduce := re.fullmatch(r"REDUCE(?:@(\d+))?", text):
            return cls("REDUCE", stage=int(reduce.group(1)) if reduce.group(1) else -1)
        if found is None:
            raise ValueError(
                f"an op is F<m>, B<m>, W<m>, SEND_F<m>><rank>, RECV_F<m><<rank> (and _B), or REDUCE; got {text!r}"
            )
        kind, m, stage, arrow, peer, start, stop = found.groups()
        if (kind in _COMPUTE) != (arrow is None) or (arrow is not None and arrow != (">" if "SEND" in kind else "<")):
            raise ValueError(f"{text!r}: sends name their peer after '>', receives after '<', computations none")
        rows = Rows(int(start), int(stop)) if start is not None else None
        local = peer == "local"
        return cls(
            kind,  # type: ignore[arg-type]
            int(m),
            int(peer) if peer is not None and not local else -1,
            rows,
            int(stage) if stage is not None else -1,
            local,
        )

    @property
    def action(self) -> Action:
        """The computation this op belongs to (``SEND_F3`` and ``RECV_F3`` belong to ``F3``)."""
        return Action(self.kind[-1], self.micro_batch, self.stage)  # type: ignore[arg-type]


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
        """One line per rank: its stage (its rank group where it holds several) and its ops in order."""
        chunked = any(op.stage >= 0 for ops in self.ranks for op in ops)
        return "\n".join(
            f"rank {r} ({'group' if chunked else 'stage'} {s}): {' '.join(map(str, ops))}"
            for r, (ops, s) in enumerate(zip(self.ranks, self.stage_of, strict=True))
        )


def lower(plan: Plan, batch_rows: int, *, train: bool = True) -> Program:
    """Every rank's ops for a global batch of ``batch_rows`` rows under ``plan``.

    Training runs the plan's schedule; evaluation (``train=False``) runs the forwards in order.
    Between stages with different replica counts each micro-batch travels in pieces
    (split-concat, see :func:`~dapple_lightning.rows.transfers`), one message per piece. Where
    the plan gives a rank group several stages (chunks), each op names its stage and a message
    between two stages of one rank is local.
    """
    micro = even_split(batch_rows, plan.micro_batches, "batch rows (micro-batches)")
    if train and plan.chunks > 1:
        orders = chunked_schedule(plan.schedule, plan.num_groups, plan.chunks, plan.micro_batches)
    elif train:
        orders = schedule(plan.schedule, plan.num_stages, plan.micro_batches)
    else:  # evaluation: every forward, stage by stage in pipeline order, micro-batch by micro-batch
        orders = [
            [
                Action("F", m, s if plan.chunks > 1 else -1)  # naming its stage where a group holds several
                for m in range(plan.micro_batches)
                for s in range(plan.num_stages)
                if g == plan.group_of_stage(s)
            ]
            for g in range(plan.num_groups)
        ]
    groups = tuple(plan.group_of(r) for r in range(plan.world_size))
    return Program(tuple(_rank_ops(plan, r, micro, orders[groups[r]], train) for r in range(plan.world_size)), groups)


def _rank_ops(plan: Plan, rank: int, micro: list[Rows], order: Sequence[Action], train: bool) -> tuple[Op, ...]:
    """One rank's ops: each computation with the receives it needs before it and the sends of what it
    made after it, in the order both ends of every pair follow, and a ``REDUCE`` before each stage's
    last backward (its last ``W`` where it has them: the stage's gradients are final there)."""
    replica, last = plan.replica_of(rank), plan.num_stages - 1
    ends = {action.stage: index for index, action in enumerate(order) if action.kind != "F"}
    ops: list[Op] = []
    for index, action in enumerate(order):
        m, tag, rows = action.micro_batch, action.stage, len(micro[action.micro_batch])
        s = tag if tag >= 0 else plan.group_of(rank)  # an action names its stage where a rank holds several
        mine = plan.stages[s].replicas
        prev = plan.stage_ranks(s - 1) if s > 0 else ()
        next_ = plan.stage_ranks(s + 1) if s < last else ()
        upstream = [t for t in transfers(rows, len(prev), mine) if t.dst == replica] if prev else []
        downstream = [t for t in transfers(rows, mine, len(next_)) if t.src == replica] if next_ else []

        if action.kind == "F":
            ops += [_message("RECV_F", m, prev[t.src], t.dst_rows, tag, rank) for t in upstream]
            ops.append(Op("F", m, stage=tag))
            ops += [_message("SEND_F", m, next_[t.dst], t.src_rows, tag, rank) for t in downstream]
            continue
        if train and ends[tag] == index:
            ops.append(Op("REDUCE", stage=tag))
        if action.kind == "W":
            ops.append(Op("W", m, stage=tag))
            continue
        ops += [_message("RECV_B", m, next_[t.dst], t.src_rows, tag, rank) for t in downstream]
        ops.append(Op("B", m, stage=tag))
        ops += [_message("SEND_B", m, prev[t.src], t.dst_rows, tag, rank) for t in upstream]
    return tuple(ops)


def _message(kind: OpKind, m: int, peer: int, rows: Rows, stage: int, rank: int) -> Op:
    """A message of ``rank``'s stage ``stage``: local where the peer is ``rank`` itself."""
    return Op(kind, m, peer, rows, stage, local=peer == rank)


def lower_stages(stages: Sequence[Sequence[Action]]) -> Program:
    """A straight pipeline (one rank per list, one row per micro-batch) running the given
    computation orders; what :func:`simulate` and :func:`grid` take lists of actions as.

    Where the actions name their stages (a rank holding several), a message goes to the rank
    whose list holds the next (or previous) stage, locally where that is the same rank.
    """
    owner = {a.stage: r for r, order in enumerate(stages) for a in order if a.stage >= 0}
    ranks = []
    last = max(owner) if owner else len(stages) - 1
    for r, order in enumerate(stages):
        ops: list[Op] = []
        for action in order:
            m, s = action.micro_batch, action.stage if action.stage >= 0 else r
            tag = action.stage

            def message(kind: OpKind, to: int, m: int = m, tag: int = tag, r: int = r) -> list[Op]:
                peer = owner.get(to, to) if tag >= 0 else to
                return [Op(kind, m, peer, stage=tag, local=peer == r and tag >= 0)]

            if action.kind == "F":
                ops += (message("RECV_F", s - 1) if s > 0 else []) + [Op("F", m, stage=tag)]
                ops += message("SEND_F", s + 1) if s < last else []
            elif action.kind == "W":
                ops.append(Op("W", m, stage=tag))
            else:
                ops += (message("RECV_B", s + 1) if s < last else []) + [Op("B", m, stage=tag)]
                ops += message("SEND_B", s - 1) if s > 0 else []
        ranks.append(tuple(ops))
    return Program(tuple(ranks), tuple(range(len(stages))))
