"""Per-stage computation orders: which forward, input backward and weight backward each stage runs when."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, order=True)
class Action:
    """One pass of one micro-batch on one stage: ``F3`` is the forward of micro-batch 3.

    ``B3`` is its backward: all of it, or under a zero-bubble schedule only the gradient with
    respect to the stage's input, the weights' gradient being ``W3``.
    """

    kind: Literal["F", "B", "W"]
    micro_batch: int
    stage: int = -1
    """The stage it runs on where a rank holds several (chunks); ``-1``: the rank's one stage."""

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f"@{self.stage}" if self.stage >= 0 else "")

    @classmethod
    def parse(cls, text: str) -> Action:
        kind, index = text[0], text[1:]
        index, _, stage = index.partition("@")
        if kind not in "FBW" or not index.isdigit() or not (stage.isdigit() or (not stage and "@" not in text)):
            raise ValueError(f"an action is F<n>, B<n> or W<n>, with @<stage> where a rank holds several; got {text!r}")
        return cls(kind, int(index), int(stage) if stage else -1)  # type: ignore[arg-type]

    @property
    def key(self) -> tuple[int, int]:
        """``(stage, micro-batch)``: what a forward leaves and its backward and ``W`` take."""
        return self.stage, self.micro_batch


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
    return _one_f_one_b(micro_batches, warmup_depth(num_stages, micro_batches, stage))


def _one_f_one_b(micro_batches: int, warmup: int) -> list[Action]:
    """``warmup`` forwards, then per micro-batch its backward and the next forward, while one is left."""
    actions = [Action("F", m) for m in range(warmup)]
    for m in range(micro_batches):
        actions.append(Action("B", m))
        if m + warmup < micro_batches:
            actions.append(Action("F", m + warmup))
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
    return _deferred_weights(micro_batches, k, min(num_stages, micro_batches) - k)


def zb_h2_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """Zero-bubble ZB-H2 order of stage ``stage``: ZB-H1's with memory traded for the bubbles.

    Qi et al. bound ZB-H2 at ``(2S - 1)`` micro-batches of activations per stage, against ``S`` for
    1F1B and ZB-H1 (their Table 1). The warm-up grows to fill the bubble before the first ``B``:
    with unit passes, stage ``s``'s first gradient arrives ``2(S - 1 - s) + 1`` slots after its
    first forward, so it runs ``min(2(S - s) - 1, M)`` forwards first. Then, as ZB-H1, each ``B``
    is followed by a ``W`` once the stage has stashed enough, here ``min(2S - 1, M)`` minus its
    warm-up (``2s``), so every stage holds at most ``min(2S - 1, M)`` micro-batches from forward
    to ``W``, and the later stages end on up to ``2s + 1`` stashed ``W``s that run while the
    earlier stages finish (the paper's parallelogram).

    What the extra micro-batches buy: each stage runs up to ``S - 1 - s`` more forwards ahead of
    the next stage than under ZB-H1, so a late gradient or activation (a slow link, a stage slowed
    by other work) stalls the next stage later; with unit passes, free links and ``M >= S`` the step is
    ZB-H1's, ``3M + S - 1`` (the paper's further gain needs the next step's first forwards to start
    before the last stage's final ``W``s, which a step ending in the optimizer's update forbids).
    """
    _check(num_stages, micro_batches, stage)
    warmup = min(2 * (num_stages - stage) - 1, micro_batches)
    return _deferred_weights(micro_batches, warmup, min(2 * num_stages - 1, micro_batches) - warmup)


def zb_tail_schedule(num_stages: int, micro_batches: int, stage: int) -> list[Action]:
    """Zero bubble in the cooldown only: ZB-H2's warm-up and tail around whole backwards.

    Stage ``s`` runs ZB-H2's ``min(2(S - s) - 1, M)`` forwards first, then alternates backward
    and forward as DAPPLE does; the backwards are whole except those of its last
    ``d_s = min(2s + 1, M)`` micro-batches (none on the first stage, whose ``B`` sends nothing),
    which are ``B`` only, their ``W``s running after the stage's last ``B``, in micro-batch order,
    while the earlier stages finish. So at most ``min(2S - 1, M)`` micro-batches live on a stage,
    ZB-H2's bound.

    What it trades: a split backward costs more than a whole one (two passes instead of one,
    and a ``W`` that reads again what its ``B`` left), so this order pays that price only where
    a ``W`` moves, on the micro-batches whose ``W``s fill the cooldown. The steady state keeps
    whole backwards, so the bubbles a ZB-H1 or ZB-H2 ``W`` would fill there stay: with unit
    passes and ``M >= 2S - 1`` it matches ZB-H2 at ``S = 2`` and falls behind it from ``S = 3``
    on (``python -m dapple_lightning.schedule 4 8 zb-tail``). The planner prices both with the
    profiled ``W`` and picks.
    """
    _check(num_stages, micro_batches, stage)
    warmup = min(2 * (num_stages - stage) - 1, micro_batches)
    tail = 0 if stage == 0 else min(2 * stage + 1, micro_batches)
    return _one_f_one_b(micro_batches, warmup) + [Action("W", m) for m in range(micro_batches - tail, micro_batches)]


def _deferred_weights(micro_batches: int, warmup: int, deferred: int) -> list[Action]:
    """``warmup`` forwards, then per micro-batch its ``B``, a ``W`` (the oldest not yet run) once
    ``deferred`` of them are stashed or in the cooldown, and the next forward; the rest of the
    ``W``s last, in micro-batch order."""
    actions = [Action("F", m) for m in range(warmup)]
    weights = 0  # W's emitted so far; they run in micro-batch order, each after its B
    for m in range(micro_batches):
        actions.append(Action("B", m))
        if m >= deferred or m >= micro_batches - warmup:
            actions.append(Action("W", weights))
            weights += 1
        if m + warmup < micro_batches:
            actions.append(Action("F", m + warmup))
    return actions + [Action("W", m) for m in range(weights, micro_batches)]


_SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "dapple": dapple_schedule,
    "gpipe": gpipe_schedule,
    "zb-h1": zb_h1_schedule,
    "zb-h2": zb_h2_schedule,
    "zb-tail": zb_tail_schedule,
}


def schedule(name: str, num_stages: int, micro_batches: int) -> list[list[Action]]:
    """Every stage's action list for the named schedule (``"dapple"``, ``"gpipe"``, ``"zb-h1"``, ``"zb-h2"`` or ``"zb-tail"``)."""
    try:
        make = _SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(_SCHEDULES)}") from None
    _check(num_stages, micro_batches, 0)
    return [make(num_stages, micro_batches, s) for s in range(num_stages)]


def split_backwards(actions: Sequence[Action]) -> frozenset[int]:
    """The micro-batches whose backward one stage's list splits into ``B`` and ``W`` (those with a
    ``W``); every other micro-batch runs its whole backward in its ``B``."""
    return frozenset(a.micro_batch for a in actions if a.kind == "W")


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward has run and backward has not, over one stage's list
    (over one rank's, chunks counted apart: a micro-batch on two of its stages counts twice).

    A micro-batch with a ``W`` holds its activations until that ``W`` (the weights' gradient
    needs them), not until its ``B``.
    """
    split = {a.key for a in actions if a.kind == "W"}
    alive = peak = 0
    for action in actions:
        if action.kind == "F":
            alive += 1
        elif action.kind == "W" or action.key not in split:
            alive -= 1
        peak = max(peak, alive)
    return peak


def peak_stashed(actions: Sequence[Action]) -> int:
    """Most micro-batches whose ``B`` has run and ``W`` has not, over one stage's list (a
    micro-batch without a ``W`` runs its whole backward in its ``B`` and stashes nothing)."""
    split = {a.key for a in actions if a.kind == "W"}
    stashed = peak = 0
    for action in actions:
        if action.key in split:
            stashed += {"B": 1, "W": -1}.get(action.kind, 0)
            peak = max(peak, stashed)
    return peak
