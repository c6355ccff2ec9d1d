"""The machines a plan runs on: nodes of devices, their links, their memory.

Devices are numbered node-major: device ``d`` sits on node ``d // devices_per_node``, and a
plan's rank ``d`` runs on device ``d``. Bandwidths are in bytes per second.

The V100 constants (``Cluster.parse`` and the paper presets) are those of DAPPLE's planner:
all-reduce inside a server about 25 GB/s per GPU pair over NVLink, across servers about 3 GB/s,
point-to-point across servers about 1 GB/s, 16 GB of device memory. The paper gives no
intra-server point-to-point figure; we take 25 GB/s, one NVLink 2.0 link in one direction
(V100 SXM2 has six such links; a single copy between two GPUs of a p3.16xlarge uses one or
two of them).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from dapple_lightning.plan import number, whole
from dapple_lightning.planner._shard_costs import ShardCosts

__all__ = ["GB", "Cluster"]

GB = 1e9
"""Bytes in a gigabyte as network and memory figures use it (decimal)."""

_V100 = {
    "intra_p2p_bw": 25 * GB,
    "inter_p2p_bw": 1 * GB,
    "intra_allreduce_bw": 25 * GB,
    "inter_allreduce_bw": 3 * GB,
    "latency_s": 10e-6,
    "memory_bytes": 16 * GB,
}


@dataclass(frozen=True)
class Cluster:
    """``nodes`` servers of ``devices_per_node`` devices each, and how fast they talk."""

    nodes: int
    """Number of servers."""
    devices_per_node: int
    """Devices (GPUs) per server."""
    intra_p2p_bw: float
    """Point-to-point bandwidth between two devices of one server, bytes/s."""
    inter_p2p_bw: float
    """Point-to-point bandwidth between devices of different servers, bytes/s (one NIC per server)."""
    intra_allreduce_bw: float
    """Per-link bandwidth of a ring all-reduce inside one server, bytes/s."""
    inter_allreduce_bw: float
    """Per-link bandwidth of a ring all-reduce that spans servers, bytes/s."""
    latency_s: float = 10e-6
    """Fixed cost of one message, seconds."""
    memory_bytes: float = 16 * GB
    """Memory of one device, bytes."""
    compute_units: int | None = None
    """How many of a server's devices can compute at once; ``None``: every device computes on its
    own (GPUs). CPU processes that share a machine's cores have ``cores // threads per process``
    of them, and a plan that keeps more processes busy than that waits for the cores: the cost
    model then bounds a step below by the busiest server's work over its units."""
    shard_costs: tuple[ShardCosts, ...] = ()
    """What FSDP2 adds to a sharded layer's passes on a group of each measured replica count within a
    server (``_links.measure_shard_costs``); none measured: sharding is priced from the all-reduce
    links alone (see ``_sharding.shard_price``)."""

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            whole(getattr(self, name), f"cluster {name}")
        for name in (
            "intra_p2p_bw",
            "inter_p2p_bw",
            "intra_allreduce_bw",
            "inter_allreduce_bw",
            "memory_bytes",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"cluster {name} must be a number, got {value!r}")
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"cluster {name} must be a finite number > 0 (bytes or bytes/s), got {value!r}")
            object.__setattr__(self, name, float(value))
        object.__setattr__(self, "latency_s", number(self.latency_s, "cluster latency_s"))
        if self.compute_units is not None:
            whole(self.compute_units, "cluster compute_units (None: independent devices)")
        costs = tuple(ShardCosts.coerce(c) for c in self.shard_costs)
        if len({c.replicas for c in costs}) != len(costs):
            raise ValueError(f"cluster shard_costs name a replica count twice: {[c.replicas for c in costs]}")
        object.__setattr__(self, "shard_costs", costs)

    # ------------------------------------------------------------------------ factories

    @classmethod
    def v100(cls, nodes: int, devices_per_node: int, **overrides: float) -> Cluster:
        """``nodes`` servers of ``devices_per_node`` V100s with the paper's constants (see module doc)."""
        return cls(nodes=nodes, devices_per_node=devices_per_node, **{**_V100, **overrides})

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """``"2x8"``: 2 servers of 8 V100s each, with the paper's constants."""
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
        if match is None:
            raise ValueError(f"cluster {text!r} is not NODESxDEVICES, e.g. '2x8' for 2 servers of 8 GPUs")
        return cls.v100(int(match.group(1)), int(match.group(2)))

    @classmethod
    def paper_2x8(cls) -> Cluster:
        """The paper's 2 servers x 8 V100 (NVLink inside a server, 25 Gbps Ethernet across)."""
        return cls.v100(2, 8)

    @classmethod
    def paper_16x1(cls) -> Cluster:
        """The paper's 16 servers x 1 V100, joined by Ethernet of up to 10 Gbps.

        10 Gbps is 1.25 GB/s, below the 3 GB/s the planner assumes for 25 Gbps across servers,
        so the all-reduce bandwidth is capped at 1.25 GB/s here; point to point keeps 1 GB/s.
        """
        return cls.v100(16, 1, inter_allreduce_bw=1.25 * GB)

    # ----------------------------------------------------------------------------- queries

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def name(self) -> str:
        return f"{self.nodes}x{self.devices_per_node}"

    def node_of(self, device: int) -> int:
        if not 0 <= device < self.world_size:
            raise ValueError(f"device {device} is outside the cluster's {self.world_size} devices")
        return device // self.devices_per_node

    def span(self, devices: Sequence[int]) -> int:
        """Number of distinct servers ``devices`` sit on."""
        return len({self.node_of(d) for d in devices})

    def allreduce_time(self, nbytes: float, replicas: int, nodes_spanned: int = 1) -> float:
        """Ring all-reduce of ``nbytes`` over ``replicas`` devices on ``nodes_spanned`` servers.

        ``2 (r - 1) / r * bytes / bw + 2 (r - 1) * latency``: a ring moves each byte ``2 (r-1)/r``
        times over its slowest link, which is the server network as soon as the ring leaves a
        server.
        """
        if replicas <= 1 or nbytes <= 0:
            return 0.0
        per_byte, fixed = self.allreduce_coefficients(replicas, nodes_spanned)
        return nbytes * per_byte + fixed

    def allreduce_coefficients(self, replicas: int, nodes_spanned: int = 1) -> tuple[float, float]:
        """``(seconds per byte, fixed seconds)`` of a ring all-reduce (for callers in a hot loop)."""
        bw = self.intra_allreduce_bw if nodes_spanned <= 1 else self.inter_allreduce_bw
        return 2.0 * (replicas - 1) / (replicas * bw), 2.0 * (replicas - 1) * self.latency_s

    def shard_costs_for(self, replicas: int) -> ShardCosts | None:
        """The measured costs of a sharded layer's passes on ``replicas`` ranks, ``None`` if not measured."""
        return next((c for c in self.shard_costs if c.replicas == replicas), None)

    def transfer_coefficient(self, sender: Sequence[int], receiver: Sequence[int]) -> float:
        """Seconds per byte to move a micro-batch's tensors between two replica groups.

        ``sender`` and ``receiver`` give each group's devices per server. Each group splits the
        micro-batch's rows evenly over its devices, so server ``n`` holds ``a_n / r_s`` of the
        rows and needs ``b_n / r_t``. Rows found on the server they are needed on move over
        NVLink, ``min(a_n, b_n)`` copies in parallel; the rest leave or enter the server through
        its network interface (one per server, full duplex). All servers work at once; the
        slowest sets the time.
        """
        r_s, r_t = sum(sender), sum(receiver)
        if r_s < 1 or r_t < 1 or len(sender) != self.nodes or len(receiver) != self.nodes:
            raise ValueError(
                f"sender {list(sender)} and receiver {list(receiver)} must give devices per server "
                f"for all {self.nodes} servers, at least one device each"
            )
        worst = 0.0
        for a, b in zip(sender, receiver):
            have, need = a / r_s, b / r_t
            stay = min(have, need)
            if stay > 0:
                worst = max(worst, stay / (min(a, b) * self.intra_p2p_bw))
            worst = max(worst, max(have - stay, need - stay) / self.inter_p2p_bw)
        return worst

    def transfer_time(self, nbytes: float, sender: Sequence[int], receiver: Sequence[int]) -> float:
        """One message latency plus ``nbytes`` at :meth:`transfer_coefficient`."""
        if nbytes <= 0:
            return 0.0
        return self.message_time(nbytes, self.transfer_coefficient(sender, receiver))

    def message_time(self, nbytes: float, per_byte: float) -> float:
        """One message latency plus ``nbytes`` at ``per_byte`` seconds (a
        :meth:`transfer_coefficient`, for callers in a hot loop); no time for no bytes."""
        return self.latency_s + nbytes * per_byte if nbytes > 0 else 0.0

    def devices_per_server(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """How many of ``ranks`` sit on each server."""
        counts = [0] * self.nodes
        for r in ranks:
            counts[self.node_of(r)] += 1
        return tuple(counts)

    @property
    def shares_compute(self) -> bool:
        """Whether a server's devices compete for fewer compute units than there are devices."""
        return self.compute_units is not None and self.compute_units < self.devices_per_node

    def describe(self) -> str:
        shared = f"; {self.compute_units} compute units per node" if self.shares_compute else ""
        return (
            f"{self.name} ({self.world_size} devices, {self.memory_bytes / GB:g} GB each; p2p "
            f"{self.intra_p2p_bw / GB:g}/{self.inter_p2p_bw / GB:g} GB/s, all-reduce "
            f"{self.intra_allreduce_bw / GB:g}/{self.inter_allreduce_bw / GB:g} GB/s intra/inter-node{shared})"
        )
