"""Device placement policies: which servers a stage's replicas land on.

DAPPLE's paper tries three policies when it gives devices to a stage:

- ``"append"`` (append first): continue on the server already in use, then the next one.
  Stages get consecutive ranks; a stage straddles a server boundary when it must.
- ``"fresh"`` (fresh first): take whole unused servers first, so that a stage's all-reduce stays
  on NVLink; a remainder smaller than a server also opens a fresh server when one is left
  (fragmenting it), else it goes to the partly used servers with the most free devices.
- ``"scatter"`` (scatter first): spread the replicas evenly over every server with free
  devices, one device per server in turn, so that consecutive scattered stages exchange
  activations inside each server rather than across (good for stages with small weights and
  large activations).

The planner builds a pipeline from its last stage backwards, so the policies hand out devices
in that order. ``"append"`` goes from the top: server ``N - 1`` first and, within a server, its
highest local device first, which gives exactly the consecutive ranks of a plan without
explicit ``ranks`` (stage 0 on ranks ``0 .. r_0 - 1``). ``"fresh"`` and ``"scatter"`` choose
servers by their free devices, ties going to the server holding more devices of the stage
placed just before (the next stage of the pipeline: data then stays local), then to the
higher server number. They never look at a server's number otherwise, so servers that agree
on both counts are interchangeable, which lets the planner treat such placements as one.
"""

from __future__ import annotations

from collections.abc import Sequence

from dapple_lightning.planner._cluster import Cluster

__all__ = ["PLACEMENTS", "allocate", "materialize", "place"]

PLACEMENTS = ("append", "fresh", "scatter")


def allocate(
    free: Sequence[int],
    replicas: int,
    policy: str,
    devices_per_node: int,
    next_take: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Give ``replicas`` devices from ``free`` (free devices per server) under ``policy``.

    ``next_take`` gives the devices per server of the stage placed just before (the next stage
    of the pipeline), for the tie-breaks. Returns the free counts after the allocation and the
    devices taken from each server.
    """
    if replicas > sum(free):
        raise ValueError(f"cannot place {replicas} replicas on {sum(free)} free devices")
    nodes = len(free)
    near = tuple(next_take) if next_take is not None else (0,) * nodes
    take = [0] * nodes
    left = list(free)
    need = replicas

    def grab(n: int, count: int) -> None:
        nonlocal need
        take[n] += count
        left[n] -= count
        need -= count

    if policy == "append":
        for n in range(nodes - 1, -1, -1):
            if need:
                grab(n, min(left[n], need))
    elif policy == "fresh":
        for n in range(nodes - 1, -1, -1):
            if need and left[n] == devices_per_node:
                grab(n, min(left[n], need))
        while need:
            # Partly used servers, fullest first: the fewest servers for what remains.
            n = max(range(nodes), key=lambda k: (left[k], near[k], k))
            grab(n, min(left[n], need))
    elif policy == "scatter":
        while need:
            order = sorted((k for k in range(nodes) if left[k]), key=lambda k: (left[k], near[k], k), reverse=True)
            for n in order:
                if need:
                    grab(n, 1)
    else:
        raise ValueError(f"unknown placement policy {policy!r}; choose one of {list(PLACEMENTS)}")
    return tuple(left), tuple(take)


def materialize(cluster: Cluster, takes: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Concrete ranks for stages given, in pipeline order, the devices each takes per server.

    Stages are served from the last to the first, highest free local device first (the order
    the planner allocated them in); each stage's ranks come out sorted.
    """
    g = cluster.devices_per_node
    next_free = [g - 1] * cluster.nodes
    out: list[tuple[int, ...]] = []
    for take in reversed(takes):
        ranks: list[int] = []
        for node, count in enumerate(take):
            for _ in range(count):
                if next_free[node] < 0:
                    raise ValueError(f"server {node} has no free device left")
                ranks.append(node * g + next_free[node])
                next_free[node] -= 1
        out.append(tuple(sorted(ranks)))
    return tuple(reversed(out))


def place(cluster: Cluster, policy: str, replicas: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Ranks of each stage when stages of ``replicas`` devices are placed under ``policy``.

    Example: on ``2x8``, ``"append"`` places ``[2, 8, 6]`` on ranks ``0-1``, ``2-9``, ``10-15``
    (the middle stage straddles both servers) and ``"fresh"`` on ``8-9``, ``0-7``, ``10-15``
    (the middle stage gets a server of its own).
    """
    free: tuple[int, ...] = (cluster.devices_per_node,) * cluster.nodes
    takes: list[tuple[int, ...]] = []
    for r in reversed(replicas):
        free, take = allocate(free, r, policy, cluster.devices_per_node, takes[-1] if takes else None)
        takes.append(take)
    return materialize(cluster, takes[::-1])
