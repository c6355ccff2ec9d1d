"""The cost model's latency as a recurrence over suffixes of the pipeline, written once.

The step latency of ``_cost`` is the longest of its chains. It is computed from the last stage
backwards in five numbers per suffix starting at stage ``t`` (a :data:`Tail`); this is what
:meth:`CostModel.estimate` folds over a plan's stages and what the planner's dynamic program
(``_search``) carries per partial plan, so both call the functions here and agree to the last
bit::

    D_t  = max(M (F_t + B_t), F_t + B_t + D_{t+1})        # chains from t's first pass, to t
    RT_t = F_t + B_t + RT_{t+1}                          # one micro-batch's round trip
    X_t  = max(RT_t + AR_t, F_t + X_{t+1})               # ... and on to an all-reduce past t
    Z_t  = max(AR_t + D_t,                               # every chain, from t's first forward
               M F_t + (M - K_t) B_t + X_{t+1},
               M F_t + (M - K_t) B_t + RT_{t+1} + B_t + AR_t,
               F_t + Z_{t+1})
    latency = Z_0

(``M F_t + (M - K_t) B_t`` and ``D_t``'s first term are :func:`stage_chain`'s, which adds the
warm-up window and the ping-pong with the next stage.) Links enter as stages whose chains are
``M C^F + RT + C^B``, ``C^F + RT + M C^B`` or ``K' C^F + (F + B)' + M C^B`` to their last transfer
and ``M C^F`` up to their last forward one; RT is the round trip beyond them, ``K'`` and
``(F + B)'`` the next stage's warm-up depth and passes (its first backward waits for its
``K'``-th forward, so for ``K'`` activations through the link, before any gradient comes back). Prepending a stage to a suffix is two
steps: :func:`through_link` sees the suffix from the far side of the link in front of it (the
planner does this once per suffix and reuses it for every candidate stage), and
:func:`prepend` puts the stage in front of that (once per candidate). :func:`combine` is both.
"""

from __future__ import annotations

__all__ = [
    "Link",
    "Tail",
    "Terms",
    "attach",
    "chain_from",
    "combine",
    "prepend",
    "stage_chain",
    "stage_terms",
    "through_link",
]

Tail = tuple[float, float, float, float, float]
"""``(D, Z, RT, X, F + B)`` of a suffix: the recurrence's numbers of its first stage, and that
stage's passes of one micro-batch (for the ping-pong of the stage before it)."""

Link = tuple[float, float, float, float, float, float]
"""A suffix seen from the far side of the link in front of it: ``D, Z, RT, X`` of the link,
then ``M C^F + X`` of the suffix (the link's chain up to its last forward, on) and
``C^F + C^B + (F + B)`` of the suffix's first stage (a ping-pong's detour through it)."""


def stage_chain(
    forward: float,
    backward: float,
    micro_batches: int,
    depth: int,
    round_trip: float,
    partner: float | None,
    gpipe: bool,
) -> tuple[float, float]:
    """Longest chains from a stage's first forward to its last backward, and to its last forward.

    ``round_trip``: from the stage's output to the gradient coming back (0 for the last stage).
    ``partner``: transfers both ways plus the next stage's ``F + B``, when the next stage warms
    up one micro-batch less (DAPPLE, ``K_{s+1} = K_s - 1``), else ``None``. The chains: all
    passes in the stage's order; the warm-up window (micro-batch ``m + K`` waits for ``m``'s
    gradient, a full round trip); under DAPPLE, the ping-pong with the next stage (``B_j`` here,
    ``F_{j+K}`` here and there, ``B_{j+2}`` there and here: a detour through the next stage in
    place of this stage's ``B_{j+1}, F_{j+K+1}`` lengthens the chain by ``partner - F - B``);
    under GPipe, all forwards, the last one's round trip, all backwards.
    """
    terms = stage_terms(forward, backward, micro_batches, depth)
    return chain_from(terms, backward, round_trip, partner, gpipe)


Terms = tuple[float, float, int, float, float, float, float, int]
"""What :func:`stage_chain` computes of a stage before it knows the stages after it (the
planner prices one stage in front of many suffixes): ``F + B``, ``M (F + B)``, the warm-up
window's jumps and the backwards besides them, the passes up to the last forward, ``M F``,
``M B`` and ``M - K - 1``."""


def stage_terms(forward: float, backward: float, micro_batches: int, depth: int) -> Terms:
    """The part of :func:`stage_chain` that does not depend on the stages after the stage."""
    m = micro_batches
    fb = forward + backward
    jumps = (m - 1) // depth + 1
    return (
        fb,
        m * fb,
        jumps,
        (m - jumps * depth + depth - 1) * backward,
        m * forward + (m - depth if m > depth else 0) * backward,
        m * forward,
        m * backward,
        m - depth - 1,
    )


def chain_from(
    terms: Terms, backward: float, round_trip: float, partner: float | None, gpipe: bool
) -> tuple[float, float]:
    """:func:`stage_chain` from the stage's :func:`stage_terms` and what comes after it."""
    fb, all_passes, jumps, between, lead, all_forwards, all_backwards, last = terms
    # The planner calls this for every partial plan it prices: the maxima are written out as
    # comparisons, the very ones ``max`` makes (first of equals kept), without its call.
    work = all_passes
    window = jumps * (fb + round_trip) + between
    if window > work:
        work = window
    if gpipe:
        drain = all_forwards + round_trip + all_backwards
        if drain > work:
            work = drain
    if partner is not None:
        # Detours start at F_{j+K}, j >= 0, at least two apart. One at j = M - K - 1 (from the
        # last forward) skips only B_{j+1}; earlier ones skip B_{j+1} and F_{j+K+1}. Before the
        # last forward, only detours that land (at B_{j+2}) ahead of it count.
        if last >= 0:
            detour = partner - fb
            detours = all_passes + (partner - backward) + (last // 2) * (detour if detour > 0.0 else 0.0)
            if detours > work:
                work = detours
        if last >= 2 and partner > fb:
            lead = lead + ((last - 2) // 2 + 1) * (partner - fb)
    return work, lead


def through_link(
    d: float,
    z: float,
    round_trip: float,
    x: float,
    passes: float,
    send_forward: float,
    send_backward: float,
    micro_batches: int,
    depth: int,
) -> Link:
    """The suffix whose :data:`Tail` is ``(d, z, round_trip, x, passes)``, seen from the far side
    of the link in front of it, which takes ``send_forward`` and ``send_backward`` per
    micro-batch (the link's entry of the recurrence, then the two sums :func:`prepend` needs).
    ``depth``: the warm-up depth ``K`` of the suffix's first stage."""
    m = micro_batches
    both = send_forward + send_backward
    # max of the three, written out as in chain_from
    d_link = both + d
    forwards = m * send_forward + round_trip + send_backward
    if forwards > d_link:
        d_link = forwards
    backwards = send_forward + round_trip + m * send_backward
    if backwards > d_link:
        d_link = backwards
    warm_up = depth * send_forward + passes + m * send_backward
    if warm_up > d_link:
        d_link = warm_up
    return (
        d_link,
        send_forward + z,
        both + round_trip,
        send_forward + x,
        m * send_forward + x,
        both + passes,
    )


def prepend(
    forward: float,
    backward: float,
    closing: float,
    micro_batches: int,
    depth: int,
    link: Link | None,
    pairs: bool,
    gpipe: bool,
) -> Tail:
    """The :data:`Tail` of a stage put in front of ``link`` (``None``: the stage is the last).

    ``forward``, ``backward``: the stage's passes of one micro-batch; ``closing``: its
    all-reduce and optimizer step; ``depth``: its warm-up depth ``K``; ``pairs``: the next stage
    warms up one micro-batch less (``K - 1``), so the two ping-pong (DAPPLE only).
    """
    terms = stage_terms(forward, backward, micro_batches, depth)
    return attach(forward, backward, closing, terms, link, pairs, gpipe)


def attach(
    forward: float, backward: float, closing: float, terms: Terms, link: Link | None, pairs: bool, gpipe: bool
) -> Tail:
    """:func:`prepend` from the stage's :func:`stage_terms` (computed once for many links)."""
    fb = terms[0]
    if link is None:
        d = terms[1]
        return d, closing + d, fb, fb + closing, fb
    d_link, z_link, rt_link, x_link, z_last_forward, partner = link
    work, lead = chain_from(terms, backward, rt_link, partner if pairs else None, gpipe)
    # The maxima written out as in chain_from: d = max(work, F + B + D_link), x = max(RT + AR,
    # F + X_link), z = max of the five chains in this order.
    d = fb + d_link
    if not d > work:
        d = work
    rt = fb + rt_link
    x = rt + closing
    through = forward + x_link
    if through > x:
        x = through
    z = closing + d
    chain = lead + x_link
    if chain > z:
        z = chain
    chain = lead + (rt_link + backward + closing)
    if chain > z:
        z = chain
    chain = forward + z_last_forward
    if chain > z:
        z = chain
    chain = forward + z_link
    if chain > z:
        z = chain
    return d, z, rt, x, fb


def combine(
    forward: float,
    backward: float,
    allreduce: float,
    send_forward: float,
    send_backward: float,
    micro_batches: int,
    depth: int,
    tail: Tail | None,
    next_depth: int = 0,
    gpipe: bool = False,
) -> Tail:
    """``(D, Z, RT, X, F + B)`` of a stage, its link and a suffix whose own values are ``tail``.

    ``depth`` is the stage's warm-up depth ``K`` and ``next_depth`` the next stage's (``M`` for
    GPipe); ``allreduce`` is the stage's all-reduce and optimizer step.
    """
    link = None if tail is None else through_link(*tail, send_forward, send_backward, micro_batches, next_depth)
    pairs = not gpipe and next_depth == depth - 1
    return prepend(forward, backward, allreduce, micro_batches, depth, link, pairs, gpipe)
