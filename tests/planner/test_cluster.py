"""Clusters: presets, parsing, and the all-reduce and transfer time models."""

from __future__ import annotations

import dataclasses

import pytest

from dapple_lightning.planner import GB, Cluster

LATENCY = 10e-6


def test_parse_gives_v100_servers():
    cluster = Cluster.parse("2x8")
    assert (cluster.nodes, cluster.devices_per_node, cluster.world_size) == (2, 8, 16)
    assert cluster.intra_allreduce_bw == 25 * GB
    assert cluster.inter_allreduce_bw == 3 * GB
    assert cluster.inter_p2p_bw == 1 * GB
    assert cluster.intra_p2p_bw == 25 * GB
    assert cluster.memory_bytes == 16 * GB
    assert cluster == Cluster.paper_2x8()
    assert Cluster.parse(" 4X1 ").name == "4x1"


def test_paper_16x1_has_the_slower_network():
    cluster = Cluster.paper_16x1()
    assert (cluster.nodes, cluster.devices_per_node) == (16, 1)
    assert cluster.inter_allreduce_bw == 1.25 * GB  # 10 Gbps
    assert cluster.inter_p2p_bw == 1 * GB


@pytest.mark.parametrize("text", ["2*8", "x8", "2x", "two by eight", ""])
def test_parse_rejects_other_text(text):
    with pytest.raises(ValueError, match="NODESxDEVICES"):
        Cluster.parse(text)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("nodes", 0, ValueError),
        ("nodes", True, TypeError),
        ("devices_per_node", 1.5, TypeError),
        ("inter_p2p_bw", 0, ValueError),
        ("memory_bytes", float("inf"), ValueError),
        ("latency_s", -1.0, ValueError),
        ("compute_units", 0, ValueError),
        ("compute_units", True, TypeError),
    ],
)
def test_validation(field, value, error):
    with pytest.raises(error, match=field):
        dataclasses.replace(Cluster.parse("1x2"), **{field: value})


def test_allreduce_is_a_ring_over_the_slowest_link():
    cluster = Cluster.parse("2x8")
    assert cluster.allreduce_time(10**9, 1) == 0.0
    assert cluster.allreduce_time(0, 8) == 0.0
    # 2 (r - 1) / r * bytes / bw + 2 (r - 1) * latency
    assert cluster.allreduce_time(10**9, 2, 1) == pytest.approx(1e9 / 25e9 + 2 * LATENCY)
    assert cluster.allreduce_time(10**9, 8, 1) == pytest.approx(2 * 7 / 8 * 1e9 / 25e9 + 14 * LATENCY)
    assert cluster.allreduce_time(10**9, 16, 2) == pytest.approx(2 * 15 / 16 * 1e9 / 3e9 + 30 * LATENCY)


@pytest.mark.parametrize(
    ("sender", "receiver", "seconds_per_gb"),
    [
        # Both on server 0: NVLink, min(2, 1) = 1 copy at a time.
        ((2, 0), (1, 0), 1 / 25),
        # Server 0 to server 1: every row leaves through server 0's network interface.
        ((2, 0), (0, 2), 1 / 1),
        # Scattered on both servers: half the rows on each, all stay (2 copies each side at 25 GB/s).
        ((1, 1), (1, 1), 0.5 / 25),
        # 15:1 on 2x8: server 0 holds 8/15 of the rows and must send them all to server 1.
        ((8, 7), (0, 1), 8 / 15),
    ],
)
def test_transfer_coefficient(sender, receiver, seconds_per_gb):
    cluster = Cluster.parse("2x8")
    assert cluster.transfer_coefficient(sender, receiver) * 1e9 == pytest.approx(seconds_per_gb)
    assert cluster.transfer_time(1e9, sender, receiver) == pytest.approx(seconds_per_gb + LATENCY)
    assert cluster.transfer_time(0, sender, receiver) == 0.0


def test_transfer_checks_its_arguments():
    with pytest.raises(ValueError, match="devices per server"):
        Cluster.parse("2x8").transfer_coefficient((1,), (1, 0))


def test_devices_per_server_and_span():
    cluster = Cluster.parse("2x4")
    assert cluster.devices_per_server([0, 3, 4]) == (2, 1)
    assert cluster.span([0, 3]) == 1 and cluster.span([3, 4]) == 2
    with pytest.raises(ValueError, match="outside"):
        cluster.node_of(8)
