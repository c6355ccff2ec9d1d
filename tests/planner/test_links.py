"""measure_cluster on real gloo processes: links within a node from the node's own ranks, across
nodes from pairs and rings that span them, the same figures on every rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dapple_lightning.planner import MEMORY_MARGIN, Cluster, compute_units, device_memory, measure_cluster, node_ranks

from distributed import run_ranks


def test_node_ranks_are_node_major():
    assert node_ranks(4, 2) == [[0, 1], [2, 3]]
    assert node_ranks(3, 1) == [[0, 1, 2]]
    assert node_ranks(2, 2) == [[0], [1]]


@pytest.mark.parametrize("nodes", [0, 3, True, 1.0])
def test_node_ranks_refuse_uneven_or_bad_nodes(nodes):
    with pytest.raises(ValueError, match="nodes"):
        node_ranks(4, nodes)


def _spied(rank: int, world: int, nodes: int) -> tuple[dict, list[list[int]], list[list[int]]]:
    """The cluster as a dict, the groups this rank created, and the ranks of each all-reduce it joined."""
    created: list[list[int]] = []
    reduced: list[list[int]] = []
    new_group, all_reduce = dist.new_group, dist.all_reduce

    def spy_new_group(ranks=None, *args, **kwargs):
        created.append(list(ranks))
        return new_group(ranks, *args, **kwargs)

    def spy_all_reduce(tensor, *args, group=None, **kwargs):
        members = list(range(world)) if group is None else dist.get_process_group_ranks(group)
        reduced.append(members)
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.new_group, dist.all_reduce = spy_new_group, spy_all_reduce
    try:
        cluster = measure_cluster(torch.device("cpu"), nodes=nodes, repeats=3)
    finally:
        dist.new_group, dist.all_reduce = new_group, all_reduce
    return vars(cluster), created, reduced


def test_two_nodes_measure_within_each_node_and_across():
    results = run_ranks(_spied, 4, 2)
    clusters = [Cluster(**c) for c, _, _ in results]
    assert all(c == clusters[0] for c in clusters), "every rank plans from rank 0's figures"
    cluster = clusters[0]
    assert (cluster.nodes, cluster.devices_per_node) == (2, 2)
    for rank, (_, created, reduced) in enumerate(results):
        assert created == [[0, 1], [2, 3]], "every rank creates every node's group, in node order"
        own = [0, 1] if rank < 2 else [2, 3]
        # the node's own ring (once to connect, then timed), then the world ring, then the memory's minimum
        assert own in reduced and [0, 1, 2, 3] in reduced
        assert reduced.index(own) < reduced.index([0, 1, 2, 3])
    cores = len(os.sched_getaffinity(0))
    assert cluster.compute_units == max(1, cores)  # the ranks run one thread each (tests/distributed.py)


@pytest.mark.parametrize(("world", "nodes"), [(2, 1), (2, 2)])
def test_one_node_or_one_rank_per_node_needs_no_groups(world, nodes):
    results = run_ranks(_spied, world, nodes)
    cluster = Cluster(**results[0][0])
    assert (cluster.nodes, cluster.devices_per_node) == (nodes, world // nodes)
    assert all(created == [] for _, created, _ in results)
    # the figures of the link the cluster lacks are those of the one it has
    assert cluster.intra_p2p_bw == cluster.inter_p2p_bw
    assert cluster.intra_allreduce_bw == cluster.inter_allreduce_bw


def test_one_process_knows_its_cores_and_memory():
    cluster = measure_cluster(torch.device("cpu"))
    assert cluster.world_size == 1
    assert cluster.compute_units == max(1, len(os.sched_getaffinity(0)) // torch.get_num_threads())
    assert cluster.memory_bytes == device_memory(torch.device("cpu"), 1)


def test_cpu_ranks_share_the_machines_memory_and_cores():
    cpu = torch.device("cpu")
    assert device_memory(cpu, 4) == pytest.approx(device_memory(cpu, 1) / 4)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(len(os.sched_getaffinity(0)) + 1)
        assert compute_units(cpu) == 1
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_budget_is_free_memory_less_the_margin():
    device = torch.device("cuda", 0)
    free, total = torch.cuda.mem_get_info(device)
    budget = device_memory(device, 1)
    assert budget < total
    slack = 64 * 2**20  # other processes on the GPU may allocate between the two readings
    assert abs(budget - (free + torch.cuda.memory_reserved(device) - MEMORY_MARGIN * total)) < slack
    assert compute_units(device) is None
