"""Placement policies, drawn as literal rank tables."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple_lightning.planner import Cluster, allocate, place

C2X8 = Cluster.parse("2x8")


@pytest.mark.parametrize(
    ("policy", "replicas", "ranks"),
    [
        # append: consecutive ranks, stages straddle servers when they must.
        ("append", [2, 8, 6], [(0, 1), (2, 3, 4, 5, 6, 7, 8, 9), (10, 11, 12, 13, 14, 15)]),
        # fresh: the 8-device stage gets a server of its own.
        ("fresh", [2, 8, 6], [(8, 9), (0, 1, 2, 3, 4, 5, 6, 7), (10, 11, 12, 13, 14, 15)]),
        # scatter: every stage spread over both servers.
        ("scatter", [2, 8, 6], [(0, 8), (1, 2, 3, 4, 9, 10, 11, 12), (5, 6, 7, 13, 14, 15)]),
        ("append", [15, 1], [tuple(range(15)), (15,)]),
        ("fresh", [15, 1], [tuple(range(15)), (15,)]),
        ("scatter", [4, 4, 4, 4], [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13), (6, 7, 14, 15)]),
    ],
)
def test_literal_placements(policy, replicas, ranks):
    assert [list(r) for r in place(C2X8, policy, replicas)] == [list(r) for r in ranks]


def test_fresh_prefers_the_server_of_the_next_stage_among_equals():
    # Servers 0 and 1 both have 4 free devices; the next stage sits on server 1.
    left, take = allocate((4, 4), 2, "fresh", 8, next_take=(0, 4))
    assert take == (0, 2) and left == (4, 2)
    left, take = allocate((4, 4), 2, "fresh", 8, next_take=(4, 0))
    assert take == (2, 0)


def test_allocate_rejects_too_many_and_unknown_policies():
    with pytest.raises(ValueError, match="cannot place 9 replicas on 8 free devices"):
        allocate((8,), 9, "append", 8)
    with pytest.raises(ValueError, match="unknown placement policy 'random'"):
        allocate((8,), 1, "random", 8)


@settings(max_examples=60, derandomize=True)
@given(
    shape=st.sampled_from([(1, 4), (2, 2), (2, 4), (4, 2), (3, 3), (4, 1)]),
    policy=st.sampled_from(["append", "fresh", "scatter"]),
    data=st.data(),
)
def test_every_device_is_used_once(shape, policy, data):
    cluster = Cluster.v100(*shape)
    world = cluster.world_size
    cuts = data.draw(st.lists(st.integers(1, world - 1), unique=True, max_size=world - 1)) if world > 1 else []
    bounds = [0, *sorted(cuts), world]
    replicas = [b - a for a, b in itertools.pairwise(bounds)]
    ranks = place(cluster, policy, replicas)
    assert [len(r) for r in ranks] == replicas
    assert sorted(x for r in ranks for x in r) == list(range(world))
    if policy == "append":
        assert [x for r in ranks for x in r] == list(range(world))
