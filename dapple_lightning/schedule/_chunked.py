"""Orders of rank groups that hold several stages (chunks): interleaved 1F1B and the V family.

Each function gives every rank group's list of actions, each naming its stage (``F3@2``: the
forward of micro-batch 3 on stage 2). ``G`` is the number of rank groups, ``C`` the chunks per
group, ``S = G x C`` the stages.

* ``interleaved`` (looped layout: group ``g`` holds stages ``g, g + G, ...``): Narayanan et al.'s
  virtual pipeline as Megatron-LM and torch's ``ScheduleInterleaved1F1B`` order it. Forwards run
  in rounds of ``G`` micro-batches per chunk (micro-batches ``0..G-1`` through chunk 0, then the
  same through chunk 1, ...), backwards likewise from the last chunk down; group ``g`` runs
  ``2(G - 1 - g) + (C - 1)G`` warm-up forwards, then alternates one forward and one backward, then
  drains (Megatron-LM runs every forward first when ``M = G``; this keeps the formula there too).
  ``M`` must be a multiple of ``G``. It holds at most ``min(MC, 2(G - 1 - g) + (C - 1)G + 1)``
  chunk micro-batches on group ``g`` (Megatron's warm-up depth plus the one in flight).
* ``zb-v`` (V layout: group ``g`` holds stages ``g`` and ``2G - 1 - g``): Qi et al.'s V-shaped zero
  bubble schedule, with split backwards (``B`` then ``W``). Group ``g`` runs ``2(G - g) - 1``
  forwards of its first chunk, then ``g`` pairs of forwards (second chunk, first chunk), then ``G - g``
  rounds of a second-chunk forward with its ``B`` and ``W``; then per step both chunks' forward,
  ``B`` and ``W``; in the cooldown ``B``s, with the ``W``s filling what the earlier groups leave. It
  holds at most ``2G`` chunk micro-batches on every group (``G`` stage micro-batches of an even cut:
  1F1B's first-stage peak) and needs ``M >= 2G``.
* ``v-half`` (V layout): the memory-bounded member of the family, at half of ZB-V's (and 1F1B's)
  activations plus one: at most ``G + 1`` chunk micro-batches per group, ``(G + 1) / 2`` stage
  micro-batches. Built by running the groups together in unit time slots: each slot a group runs
  the ready action first in this order: a ``B`` (oldest micro-batch, later stage first), a forward of
  its second chunk while it holds fewer than ``G + 1``, one of its first chunk while it holds fewer
  than ``G`` (the last place is kept for the micro-batch on its way back, so the oldest always
  finishes), else a ``W``. Needs ``M >= 2G`` like ZB-V.
"""

from __future__ import annotations

from dapple_lightning.schedule._orders import Action

__all__ = ["chunked_schedule", "peak_bound"]


def interleaved_warmup(groups: int, chunks: int, micro_batches: int, group: int) -> int:
    """Forwards group ``group`` runs before its first backward under interleaved 1F1B."""
    return min(micro_batches * chunks, 2 * (groups - 1 - group) + (chunks - 1) * groups)


def _interleaved(groups: int, chunks: int, micro_batches: int) -> list[list[Action]]:
    """Every group's interleaved 1F1B order (looped layout); ``micro_batches`` a multiple of ``groups``."""
    if micro_batches % groups:
        raise ValueError(f"interleaved 1F1B needs micro_batches a multiple of the {groups} groups, got {micro_batches}")
    total = micro_batches * chunks

    def nth(k: int, backward: bool, group: int) -> Action:
        within = k % (groups * chunks)
        chunk = within // groups
        chunk = chunks - 1 - chunk if backward else chunk
        m = (k // (groups * chunks)) * groups + within % groups
        return Action("B" if backward else "F", m, chunk * groups + group)

    orders = []
    for g in range(groups):
        warmup = interleaved_warmup(groups, chunks, micro_batches, g)
        actions = [nth(k, False, g) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [nth(warmup + k, False, g), nth(k, True, g)]
        actions += [nth(k, True, g) for k in range(total - warmup, total)]
        orders.append(actions)
    return orders


def _zb_v(groups: int, micro_batches: int) -> list[list[Action]]:
    """Every group's ZB-V order (V layout); ``micro_batches >= 2 x groups``."""
    return [_zb_v_group(groups, micro_batches, g) for g in range(groups)]


def _zb_v_group(groups: int, micro_batches: int, g: int) -> list[Action]:
    down, up = g, 2 * groups - 1 - g  # the group's stage on the way down the V, and on the way back
    count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0, "W0": 0, "W1": 0}
    actions: list[Action] = []

    def run(kind: str, chunk: int) -> None:
        name = f"{kind}{chunk}"
        actions.append(Action(kind, count[name], up if chunk else down))  # type: ignore[arg-type]
        count[name] += 1

    for _ in range(2 * (groups - g) - 1):
        run("F", 0)
    for _ in range(g):
        run("F", 1)
        run("F", 0)
    for _ in range(groups - g):
        run("F", 1)
        run("B", 1)
        run("W", 1)
    while count["F1"] < micro_batches:
        if count["F0"] < micro_batches:
            run("F", 0)
        run("B", 0)
        run("W", 0)
        run("F", 1)
        run("B", 1)
        run("W", 1)
    for _ in range(g):
        run("B", 0)
        run("B", 1)
    for _ in range(groups - g):
        run("B", 0)
        run("W", 0)
    while count["W1"] < micro_batches:
        run("W", 1)
    while count["W0"] < micro_batches:
        run("W", 0)
    return actions


def _v_half(groups: int, micro_batches: int) -> list[list[Action]]:
    """Every group's V-Half order (V layout): at most ``groups + 1`` chunk micro-batches per group;
    ``micro_batches >= 2 x groups``."""
    last = 2 * groups - 1
    cap = groups + 1
    done: set[Action] = set()  # finished by the end of the previous slot
    forwards = [0] * (2 * groups)  # per stage, the next micro-batch to forward
    backwards = [0] * (2 * groups)
    weights = [0] * (2 * groups)
    live = [0] * groups
    orders: list[list[Action]] = [[] for _ in range(groups)]
    total = 3 * 2 * groups * micro_batches
    while sum(map(len, orders)) < total:
        now: list[Action | None] = []
        for g in range(groups):
            down, up = g, last - g
            ready = [
                Action("B", backwards[s], s)
                for s in (up, down)
                if backwards[s] < forwards[s]
                and (s == last or Action("B", backwards[s], s + 1) in done)
                and Action("F", backwards[s], s) in done
            ]
            for s, room in ((up, cap), (down, cap - 1)):
                m = forwards[s]
                if m < micro_batches and live[g] < room and (s == 0 or Action("F", m, s - 1) in done):
                    ready.append(Action("F", m, s))
            ready += [Action("W", weights[s], s) for s in (up, down) if weights[s] < backwards[s]]
            now.append(ready[0] if ready else None)
        if not any(now):
            raise RuntimeError("v-half: no group can run (a bug in the generator)")
        for g, action in enumerate(now):
            if action is None:
                continue
            orders[g].append(action)
            counter = {"F": forwards, "B": backwards, "W": weights}[action.kind]
            counter[action.stage] += 1
            live[g] += {"F": 1, "W": -1}.get(action.kind, 0)
        done.update(a for a in now if a is not None)
    return orders


_CHUNKED = {"interleaved": 0, "zb-v": 2, "v-half": 2}
"""Chunks each schedule needs (0: any)."""


def chunked_schedule(name: str, groups: int, chunks: int, micro_batches: int) -> list[list[Action]]:
    """Every rank group's action list for a schedule of several stages per group."""
    if name not in _CHUNKED:
        raise ValueError(f"unknown chunked schedule {name!r}; choose one of {sorted(_CHUNKED)}")
    if _CHUNKED[name] and chunks != _CHUNKED[name]:
        raise ValueError(f"{name} runs {_CHUNKED[name]} chunks per group (the V layout), not {chunks}")
    if groups < 1 or micro_batches < 1:
        raise ValueError(f"need groups >= 1 and micro_batches >= 1, got {groups} and {micro_batches}")
    if _CHUNKED[name] and micro_batches < 2 * groups:
        raise ValueError(f"{name} needs at least 2 x {groups} groups = {2 * groups} micro-batches, got {micro_batches}")
    if name == "interleaved":
        return _interleaved(groups, chunks, micro_batches)
    return _zb_v(groups, micro_batches) if name == "zb-v" else _v_half(groups, micro_batches)


def peak_bound(name: str, groups: int, chunks: int, micro_batches: int, group: int) -> int:
    """The most chunk micro-batches the schedule holds on ``group`` at once (its published bound)."""
    if name == "interleaved":
        return min(micro_batches * chunks, interleaved_warmup(groups, chunks, micro_batches, group) + 1)
    return 2 * groups if name == "zb-v" else groups + 1
