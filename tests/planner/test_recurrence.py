"""The recurrence the cost model and the planner share, against the chains written out one by one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple_lightning.plan import Plan
from dapple_lightning.planner import estimate
from dapple_lightning.planner._cost import chains
from dapple_lightning.planner._recurrence import combine, prepend, through_link

from .test_cost import PROFILE, SLOW, TWO_BY_TWO


def test_recurrence_matches_the_written_out_chains():
    est = estimate(Plan(TWO_BY_TWO, 2), PROFILE, SLOW, 8)
    written = max(c[0] for c in chains(est.forward_s, est.backward_s, est.allreduce_s, est.send_forward_s, [2, 1], 2))
    assert written == est.step_s
    tail = combine(1.5, 1.5, 1.0, 0.0, 0.0, 2, 1, None)
    _d, z, rt, _x, fb = combine(1.0, 2.0, 1.0, 0.5, 0.5, 2, 2, tail, next_depth=1)
    assert z == est.step_s and rt == 1.0 + 2.0 + 0.5 + 0.5 + 3.0 and fb == 3.0


seconds = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)


@settings(max_examples=200, deadline=None)
@given(
    stages=st.integers(1, 5),
    micro_batches=st.integers(1, 9),
    gpipe=st.booleans(),
    numbers=st.lists(st.tuples(seconds, seconds, seconds, seconds), min_size=5, max_size=5),
)
def test_the_recurrence_is_the_longest_chain(stages, micro_batches, gpipe, numbers):
    forward, backward, allreduce, send = (list(column[:stages]) for column in zip(*numbers, strict=True))
    send = send[: stages - 1]
    depth = [micro_batches if gpipe else min(stages - k, micro_batches) for k in range(stages)]
    tail = None
    for k in range(stages - 1, -1, -1):
        sf = send[k] if k < stages - 1 else 0.0
        after = depth[k + 1] if k < stages - 1 else 0
        tail = combine(forward[k], backward[k], allreduce[k], sf, sf, micro_batches, depth[k], tail, after, gpipe)
    longest = max(c[0] for c in chains(forward, backward, allreduce, send, depth, micro_batches, gpipe))
    assert tail[1] == pytest.approx(longest, rel=1e-9, abs=1e-12)


def test_combine_is_a_link_then_a_stage():
    tail = (7.0, 9.0, 3.0, 5.0, 2.0)
    link = through_link(*tail, 0.5, 0.25, 4, 1)
    # D of the link: both transfers then D; M forwards, the round trip, one backward; or the reverse.
    assert link == (max(0.75 + 7.0, 4 * 0.5 + 3.0 + 0.25, 0.5 + 3.0 + 4 * 0.25), 9.5, 3.75, 5.5, 7.0, 2.75)
    # ... or, when the next stage warms up deeper, its K forwards' activations, its passes, M gradients.
    slow = through_link(*tail, 4.0, 4.0, 4, 4)
    assert slow[0] == 4 * 4.0 + 2.0 + 4 * 4.0 > max(8.0 + 7.0, 4 * 4.0 + 3.0 + 4.0)
    assert combine(1.0, 2.0, 0.5, 0.5, 0.25, 4, 2, tail, next_depth=1) == prepend(
        1.0, 2.0, 0.5, 4, 2, link, True, False
    )
    assert prepend(1.0, 2.0, 0.5, 4, 1, None, True, False) == (12.0, 12.5, 3.0, 3.5, 3.0)
