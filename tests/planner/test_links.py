"""measure_cluster on real gloo processes: links within a node from the node's own ranks, across
nodes from pairs and rings that span them, the same figures on every rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from dapple_lightning.planner import (
    MEMORY_MARGIN,
    MESSAGE_SIZES,
    Cluster,
    LayerProfile,
    ModelProfile,
    ShardCosts,
    compute_units,
    device_memory,
    fit_link,
    measure_cluster,
    message_sizes,
    node_ranks,
    shard_sizes,
)

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


def test_a_link_is_fitted_as_latency_plus_size_over_bandwidth():
    sizes = [2**16, 2**20, 2**23]
    latency, bandwidth = fit_link(sizes, [20e-6 + n / 300e9 for n in sizes])  # NVLink-like: 20 us, 300 GB/s
    assert latency == pytest.approx(20e-6) and bandwidth == pytest.approx(300e9)


def test_a_fit_below_zero_latency_goes_through_zero_and_a_flat_one_keeps_the_best_rate():
    latency, bandwidth = fit_link([1e3, 1e6], [1e-6, 2e-3])  # the line would cross below zero
    assert latency == 0.0 and bandwidth == pytest.approx((1e6**2 + 1e6) / (1e3 * 1e-6 + 1e6 * 2e-3))
    latency, bandwidth = fit_link([1e3, 1e6], [1e-3, 1e-3])  # no slope: noise
    assert latency == 0.0 and bandwidth == pytest.approx(1e9)
    with pytest.raises(ValueError, match="as many timings as sizes"):
        fit_link([1e3, 1e6], [1e-3])


def test_message_sizes_span_what_plans_of_the_model_send():
    layers = tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 2**20, 2**22 * (i + 1)) for i in range(4))
    profile = ModelProfile(layers, 8, cut_bytes=(0, 2**20, 2**21, 2**20, 0))  # at 8 samples
    p2p, reduce = message_sizes(profile, global_batch=64)
    # activations: one sample's smallest cut (128 KiB) to the whole batch's largest (16 MiB)
    assert p2p[0] == 2**17 and p2p[-1] == 2**24 and len(p2p) == 3
    # gradients: the smallest layer's (4 MiB) to the model's (40 MiB)
    assert reduce[0] == 2**22 and reduce[-1] == 40 * 2**20 and list(reduce) == sorted(reduce)
    huge = ModelProfile(tuple(LayerProfile("l", 1.0, 1.0, 2**30, 2**34) for _ in range(2)), 1)
    assert max(max(s) for s in message_sizes(huge, 1024)) == 2**26  # timed up to 64 MiB, the fit carries on
    bare = ModelProfile(tuple(LayerProfile("l", 1.0, 1.0, 0, 0) for _ in range(2)), 1)
    assert message_sizes(bare, 8) == (MESSAGE_SIZES, MESSAGE_SIZES)
    # a sharded layer is timed from the smallest layer's parameters (4 MiB) to the largest's (16 MiB)
    assert shard_sizes(profile) == (2**22, 2**23, 2**24)
    assert shard_sizes(bare) == MESSAGE_SIZES
    one_size = ModelProfile(tuple(LayerProfile("l", 1.0, 1.0, 0, 2**20) for _ in range(3)), 1)
    assert shard_sizes(one_size) == (2**16, 2**18, 2**20)  # two sizes apart at least, for the fit


def _sent_sizes(rank: int, world: int, sizes) -> tuple[dict, list[int], list[int]]:
    sent: list[int] = []
    reduced: list[int] = []
    send, all_reduce = dist.send, dist.all_reduce

    def spy_send(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return send(tensor, *args, **kwargs)

    def spy_all_reduce(tensor, *args, **kwargs):
        reduced.append(tensor.numel() * tensor.element_size())
        return all_reduce(tensor, *args, **kwargs)

    dist.send, dist.all_reduce = spy_send, spy_all_reduce
    try:
        cluster = measure_cluster(torch.device("cpu"), repeats=3, sizes=sizes)
    finally:
        dist.send, dist.all_reduce = send, all_reduce
    return vars(cluster), sent, reduced


def test_links_are_timed_at_the_sizes_given():
    sizes = ((2**12, 2**16, 2**20), (2**14, 2**18))
    results = run_ranks(_sent_sizes, 2, sizes)
    cluster = Cluster(**results[0][0])
    _, sent, reduced = results[0]
    assert sorted(set(sent)) == list(sizes[0]), "point-to-point at each size (rank 0 sends, then receives)"
    assert set(sizes[1]) <= set(reduced), "the all-reduce at each size"
    assert cluster.latency_s >= 0 and cluster.intra_p2p_bw > 0 and cluster.intra_allreduce_bw > 0


def _shard_measured(rank: int, world: int) -> tuple[list[list[float]], list[int], list[list[int]]]:
    """The shard costs as numbers, their replica counts, and the groups this rank created."""
    created: list[list[int]] = []
    new_group = dist.new_group

    def spy_new_group(ranks=None, *args, **kwargs):
        created.append(list(ranks))
        return new_group(ranks, *args, **kwargs)

    dist.new_group = spy_new_group
    try:
        cluster = measure_cluster(torch.device("cpu"), repeats=2, shard_replicas=(2, 3), shard_at=(2**12, 2**16))
    finally:
        dist.new_group = new_group
    return [c.as_numbers() for c in cluster.shard_costs], [c.replicas for c in cluster.shard_costs], created


def test_sharded_layers_are_timed_on_a_group_of_each_replica_count_and_every_rank_plans_from_rank_0s():
    results = run_ranks(_shard_measured, 3)
    numbers, replicas, _ = results[0]
    assert replicas == [2, 3]
    assert all(r[0] == numbers and r[1] == replicas for r in results), "every rank plans from rank 0's figures"
    assert all(created == [[0, 1], [0, 1, 2]] for _, _, created in results), "every rank creates every group"
    costs = [ShardCosts.from_numbers(r, n) for r, n in zip(replicas, numbers)]
    # a backward that gathers and reduce-scatters does more than the same layer's unsharded backward
    assert all(c.gather_scatter.at(2**16) > 0 for c in costs)


def _shard_measure_fails_on_its_members(rank: int, world: int) -> str:
    import dapple_lightning.planner._links as links

    def broken(*args, **kwargs):
        raise ValueError(f"no FSDP2 here (rank {rank})")

    links.measure_shard_costs = broken
    try:
        measure_cluster(torch.device("cpu"), repeats=1, shard_replicas=(2,), shard_at=(2**12,))
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_shard_measurement_that_fails_on_its_members_fails_every_rank_at_once():
    # Before the ranks agreed on failures, rank 2 (not a member) waited in the broadcast of rank 0's
    # figures until the members' processes ended (gloo's "Connection closed by peer") or, while they
    # lived on, until the process group's timeout.
    results = run_ranks(_shard_measure_fails_on_its_members, 3, timeout=50)
    assert results[:2] == ["ValueError: no FSDP2 here (rank 0)", "ValueError: no FSDP2 here (rank 1)"]
    assert results[2].startswith("RuntimeError: timing sharded layers on 2 replicas failed on 2 of ranks [0, 1]")


def test_shard_costs_are_measured_only_for_replica_counts_a_node_holds():
    with pytest.raises(ValueError, match="shard_replicas must be replica counts from 2 to the 1 ranks of a node"):
        measure_cluster(torch.device("cpu"), shard_replicas=(2,))
