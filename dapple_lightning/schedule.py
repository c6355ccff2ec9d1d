"""Pipeline schedules as data: per-stage lists of forward and backward actions.

A schedule says, for each stage, in which order it runs the forward (``F``) and backward
(``B``) pass of each micro-batch. Nothing here touches a device: the runtime executes the
list of its own stage, the cost model and the tests replay all lists together.

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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Action",
    "dapple_schedule",
    "gpipe_schedule",
    "grid",
    "peak_in_flight",
    "schedule",
    "simulate",
    "warmup_depth",
]


@dataclass(frozen=True, order=True)
class Action:
    """One pass of one micro-batch on one stage: ``F3`` is the forward of micro-batch 3."""

    kind: Literal["F", "B"]
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> Action:
        kind, index = text[0], text[1:]
        if kind not in "FB" or not index.isdigit():
            raise ValueError(f"an action is F<n> or B<n>, got {text!r}")
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


_SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "dapple": dapple_schedule,
    "gpipe": gpipe_schedule,
}


def schedule(name: str, num_stages: int, micro_batches: int) -> list[list[Action]]:
    """Every stage's action list for the named schedule (``"dapple"`` or ``"gpipe"``)."""
    try:
        make = _SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(_SCHEDULES)}") from None
    return [make(num_stages, micro_batches, s) for s in range(num_stages)]


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward has run and backward has not, over one stage's list."""
    alive = peak = 0
    for action in actions:
        alive += 1 if action.kind == "F" else -1
        peak = max(peak, alive)
    return peak


@dataclass(frozen=True)
class Timed:
    """An action placed in time by :func:`simulate`."""

    stage: int
    action: Action
    start: float
    end: float


def simulate(
    stages: Sequence[Sequence[Action]],
    duration: Callable[[int, Action], float] = lambda stage, action: 1.0,
    transfer: Callable[[int, int, Action], float] = lambda src, dst, action: 0.0,
) -> list[Timed]:
    """Replay every stage's list in order, each action as soon as its inputs exist.

    ``F m`` on stage ``s`` needs ``F m`` of stage ``s - 1`` plus the transfer from ``s - 1``;
    ``B m`` needs ``F m`` on the same stage and ``B m`` of stage ``s + 1`` plus its transfer.
    Each stage runs one action at a time. Raises ``RuntimeError`` if the lists deadlock
    (no stage can make progress), which is how tests prove a schedule is deadlock free.
    """
    num = len(stages)
    done: dict[tuple[int, Action], float] = {}
    cursor = [0] * num
    clock = [0.0] * num
    out: list[Timed] = []
    remaining = sum(len(s) for s in stages)
    while remaining:
        progressed = False
        for s in range(num):
            while cursor[s] < len(stages[s]):
                action = stages[s][cursor[s]]
                ready = clock[s]
                if action.kind == "F":
                    deps = [] if s == 0 else [(s - 1, action, s - 1)]
                else:
                    if (s, Action("F", action.micro_batch)) not in done:
                        raise RuntimeError(f"stage {s} runs {action} before F{action.micro_batch}")
                    deps = [] if s == num - 1 else [(s + 1, action, s + 1)]
                blocked = False
                for dep_stage, dep_action, src in deps:
                    key = (dep_stage, dep_action)
                    if key not in done:
                        blocked = True
                        break
                    ready = max(ready, done[key] + transfer(src, s, action))
                if blocked:
                    break
                end = ready + duration(s, action)
                done[(s, action)] = end
                clock[s] = end
                out.append(Timed(s, action, ready, end))
                cursor[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {s: str(stages[s][cursor[s]]) for s in range(num) if cursor[s] < len(stages[s])}
            raise RuntimeError(f"schedule deadlocks: stages wait on each other at {stuck}")
    return out


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
