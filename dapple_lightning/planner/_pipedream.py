"""PipeDream graph profiles (the DAPPLE authors' published ones, shipped in :data:`REFERENCE_PROFILES`),
and :func:`load_profile`, which reads either that format or our JSON (``_profile``).

A PipeDream graph lists nodes with times in milliseconds and sizes in bytes, then edges.
"""

from __future__ import annotations

import dataclasses
import heapq
import os
import re
from pathlib import Path

from dapple_lightning.planner._profile import LayerProfile, ModelProfile

__all__ = ["REFERENCE_PROFILES", "load_profile", "read_pipedream"]

REFERENCE_PROFILES = Path(__file__).resolve().parent / "profiles"
"""The DAPPLE authors' published profiles of the paper's models, in PipeDream graph format
(see its ``README.md`` for where they come from); read one with :func:`read_pipedream`."""


_PBS = re.compile(r"pbs-(\d+)")
_NODE_ID = re.compile(r"^node(\d+)$")
_METRICS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


def _node_key(node: str) -> tuple[int, int | str]:
    # Stable order among ready nodes: by the number in "node12", names without one after.
    match = _NODE_ID.match(node)
    return (0, int(match.group(1))) if match else (1, node)


def _size(text: str, where: str) -> int:
    # Several outputs are written "[4816896; 32032]": the node's output is all of them.
    text = text.strip()
    listed = text.startswith("[") and text.endswith("]")
    parts = [p for p in text[1:-1].split(";") if p.strip()] if listed else [text]
    try:
        return sum(round(float(p)) for p in parts)
    except ValueError:
        raise ValueError(f"{where}: size {text!r} is not a number or a list [a; b]") from None


def read_pipedream(
    source: str | os.PathLike[str],
    profile_batch_size: int | None = None,
    *,
    device: str = "V100",
) -> ModelProfile:
    """Read a profile in the PipeDream graph format used by DAPPLE's published profiles.

    Node lines look like ``node3 -- Conv2d_1_2 -- forward_compute_time=7.2,
    backward_compute_time=14.4, activation_size=384000000.0, parameter_size=140869.0``
    (milliseconds and bytes at the profile batch; a size may be a list ``[a; b]`` for a node with
    several outputs, which counts as their sum). Edge lines, indented, look like
    ``node2 -- node3``: node 3 consumes node 2's output.

    The nodes are put in topological order, ties broken by node number, and become the layers.
    ``cut_bytes[i]`` sums the outputs of every node before position ``i`` that has an edge to a
    node at position ``i`` or later, so a residual connection that jumps over a cut is counted.

    Args:
        source: Path of the file, or its text.
        profile_batch_size: Samples per profiled batch; parsed from ``pbs-N`` in the file name
            when omitted.
        device: Recorded in the profile (the published files were measured on V100).

    Raises:
        ValueError: On malformed lines, unknown nodes in edges, a cycle, or a missing batch size.
    """
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source):
        path = Path(source)
        return _parse_pipedream(path.read_text(), path.name, profile_batch_size, device)
    return _parse_pipedream(source, None, profile_batch_size, device)


def _parse_pipedream(text: str, name: str | None, profile_batch_size: int | None, device: str) -> ModelProfile:
    if profile_batch_size is None:
        match = _PBS.search(name or "")
        if match is None:
            raise ValueError(
                f"cannot tell the profile batch size of {name or 'this profile'!r}: pass profile_batch_size "
                "(--profile-batch on the command line), or name the file like 'vgg-19-pbs-32.txt'"
            )
        profile_batch_size = int(match.group(1))
    where = name or "<text>"
    nodes, edges = _read_graph(text, where)
    order, successors = _chain_order(nodes, edges, where)
    layers = tuple(nodes[n] for n in order)
    cuts = _cut_bytes(order, nodes, successors)
    return ModelProfile(layers, profile_batch_size=profile_batch_size, device=device, cut_bytes=cuts)


def _read_graph(text: str, where: str) -> tuple[dict[str, LayerProfile], list[tuple[str, str]]]:
    """The node lines (as layers, by node id) and the edges of a PipeDream graph."""
    nodes: dict[str, LayerProfile] = {}
    edges: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.strip().split(" -- ")]
        if len(parts) == 2:
            edges.append((parts[0], parts[1]))
            continue
        if len(parts) < 3:
            raise ValueError(f"{where}:{number}: expected 'nodeN -- name -- metrics' or 'nodeA -- nodeB'")
        layer = _read_node(parts, f"{where}:{number}")
        if parts[0] in nodes:
            raise ValueError(f"{where}:{number}: node {parts[0]} is defined twice")
        nodes[parts[0]] = layer
    if not nodes:
        raise ValueError(f"{where}: no node lines found")
    return nodes, edges


def _read_node(parts: list[str], where: str) -> LayerProfile:
    """One node line, split at ``' -- '``, as a layer."""
    # The name may itself contain ' -- '; the id is the first field, metrics the last.
    node, label, metrics = parts[0], " -- ".join(parts[1:-1]), parts[-1]
    values: dict[str, str] = {}
    for item in re.split(r",\s*(?=\w+=)", metrics):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{where}: metric {item!r} is not key=value")
        values[key.strip()] = value.strip()
    missing = [k for k in _METRICS if k not in values]
    if missing:
        raise ValueError(f"{where}: node {node} lacks {missing}")
    try:
        forward_ms = float(values["forward_compute_time"])
        backward_ms = float(values["backward_compute_time"])
    except ValueError:
        raise ValueError(f"{where}: compute times of {node} are not numbers") from None
    return LayerProfile(
        name=label,
        forward_s=forward_ms / 1e3,
        backward_s=backward_ms / 1e3,
        activation_bytes=_size(values["activation_size"], where),
        param_bytes=_size(values["parameter_size"], where),
    )


def _chain_order(
    nodes: dict[str, LayerProfile], edges: list[tuple[str, str]], where: str
) -> tuple[list[str], dict[str, list[str]]]:
    """The nodes in an order every edge follows (stable by node number), and each one's consumers."""
    successors: dict[str, list[str]] = {n: [] for n in nodes}
    indegree = dict.fromkeys(nodes, 0)
    for a, b in edges:
        for n in (a, b):
            if n not in nodes:
                raise ValueError(f"{where}: edge {a} -- {b} names {n}, which has no node line")
        successors[a].append(b)
        indegree[b] += 1

    # Kahn's algorithm with a heap: the order is a valid chain and stable by node number.
    ready = [(_node_key(n), n) for n, d in indegree.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for nxt in successors[node]:
            indegree[nxt] -= 1
            if indegree[nxt] == 0:
                heapq.heappush(ready, (_node_key(nxt), nxt))
    if len(order) != len(nodes):
        stuck = sorted((n for n in nodes if n not in set(order)), key=_node_key)
        raise ValueError(f"{where}: the graph has a cycle through {stuck[:5]}")
    return order, successors


def _cut_bytes(order: list[str], nodes: dict[str, LayerProfile], successors: dict[str, list[str]]) -> tuple[int, ...]:
    """Bytes crossing each cut of the chain ``order``: every output still to be consumed past it."""
    position = {n: i for i, n in enumerate(order)}
    # A node at position p whose last consumer sits at q crosses the cuts p+1 .. q.
    delta = [0] * (len(order) + 2)
    for node in order:
        if successors[node]:
            p = position[node]
            q = max(position[s] for s in successors[node])
            delta[p + 1] += nodes[node].activation_bytes
            delta[q + 1] -= nodes[node].activation_bytes
    cuts = [0] * (len(order) + 1)
    running = 0
    for i in range(1, len(order)):
        running += delta[i]
        cuts[i] = running
    return tuple(cuts)


def load_profile(path: str | os.PathLike[str], profile_batch_size: int | None = None) -> ModelProfile:
    """Read our JSON profile or a PipeDream-format text profile, whichever ``path`` holds.

    ``profile_batch_size`` overrides (JSON) or supplies (PipeDream) the profile batch size.
    """
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        profile = ModelProfile.load(path)
        if profile_batch_size is not None and profile_batch_size != profile.profile_batch_size:
            profile = dataclasses.replace(profile, profile_batch_size=profile_batch_size)
        return profile
    return _parse_pipedream(text, Path(path).name, profile_batch_size, "V100")
