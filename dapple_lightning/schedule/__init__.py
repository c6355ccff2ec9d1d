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
forwards and ``B``s and defers its ``W``s into the cooldown's bubble, holding at most ``min(S, M)``
micro-batches, DAPPLE's first stage's peak (:func:`zb_h1_schedule`). With ``F = B = W`` and
``M >= S`` a step takes ``3M + S - 1`` units against DAPPLE's ``3M + 3(S - 1)``
(``python -m dapple_lightning.schedule 4 8 zb-h1``).

ZB-H2 (``schedule="zb-h2"``) trades memory for slack: up to ``min(2S - 1, M)`` micro-batches per
stage, the paper's bound, with a longer warm-up on the early stages and more stashed ``W``s on the
late ones (``python -m dapple_lightning.schedule 4 8 zb-h2``; see :func:`zb_h2_schedule`).

``schedule="zb-tail"`` splits only where a ``W`` moves: ZB-H2's warm-up, whole backwards in the
steady state, and each stage's last ``2s + 1`` backwards split, their ``W``s run after its last
``B`` while the earlier stages finish (:func:`zb_tail_schedule`). A micro-batch without a ``W``
in its stage's list runs its whole backward in its ``B``, in the runtime and in every replay.

Plans with several stages per rank group (``chunks``) run ``interleaved`` (looped layout) or
``zb-v`` / ``v-half`` (V layout), each action naming its stage (see
:mod:`~dapple_lightning.schedule._chunked`; ``python -m dapple_lightning.schedule 2 4 zb-v``).
Lowered, a message between two stages of the same rank is marked local: the runtime hands it
over in the process.
"""

from dapple_lightning.schedule._chunked import chunked_schedule, peak_bound
from dapple_lightning.schedule._lower import Op, Program, lower
from dapple_lightning.schedule._orders import (
    Action,
    dapple_schedule,
    gpipe_schedule,
    peak_in_flight,
    peak_stashed,
    schedule,
    split_backwards,
    warmup_depth,
    zb_h1_schedule,
    zb_h2_schedule,
    zb_tail_schedule,
)
from dapple_lightning.schedule._simulate import Timed, grid, simulate

__all__ = [
    "Action",
    "Op",
    "Program",
    "Timed",
    "chunked_schedule",
    "dapple_schedule",
    "gpipe_schedule",
    "grid",
    "lower",
    "peak_bound",
    "peak_in_flight",
    "peak_stashed",
    "schedule",
    "simulate",
    "split_backwards",
    "warmup_depth",
    "zb_h1_schedule",
    "zb_h2_schedule",
    "zb_tail_schedule",
]
