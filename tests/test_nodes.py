"""Two nodes as users start them: two torchrun agents (one per node) joined by a c10d rendezvous,
2 processes each, on this host.

Lightning reads the node's rank and size from torchrun's environment (``TorchElasticEnvironment``);
ranks are node-major, so a plan whose stages have 2 replicas each keeps every stage within a node.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dapple_lightning import Plan

import models
from distributed import free_port
from harness import assert_same, fit, read_metrics

SCRIPT = Path(__file__).parent / "scripts" / "fit_nodes.py"
STEPS = 3  # as tests/scripts/fit_nodes.py trains


def _two_nodes(out: Path, spec: str, timeout: float = 400) -> None:
    """Both agents on 127.0.0.1, node 0's hosting the rendezvous store."""
    port = free_port()
    agents = []
    for node in range(2):
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2"),
            *("--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"),
            *("--rdzv-id", f"dapple-nodes-{port}", "--rdzv-conf", f"is_host={int(node == 0)}"),
            *("--local-addr", "127.0.0.1", "--max-restarts", "0"),
            *(str(SCRIPT), str(out), spec),
        ]
        agents.append(subprocess.Popen(cmd, cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
    for node, (agent, text) in enumerate(zip(agents, outputs)):
        assert agent.returncode == 0, f"node {node}'s agent exited with {agent.returncode}:\n{text[-6000:]}"


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return fit(models.MLP, tmp_path_factory.mktemp("ref"), max_steps=STEPS)


def _trained(out: Path):
    return read_metrics(out / "run" / "version_0" / "metrics.csv"), torch.load(out / "final.pt")


def test_stages_within_nodes_match_single_device(tmp_path, single_device):
    plan = tmp_path / "plan.yaml"
    stages = [{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 2}]
    plan.write_text(Plan(stages=stages, micro_batches=3, schedule="dapple").to_yaml())
    _two_nodes(tmp_path, str(plan))
    assert_same(_trained(tmp_path), single_device)


def test_auto_plan_measures_links_within_and_across_nodes(tmp_path, single_device):
    _two_nodes(tmp_path, "auto")
    assert_same(_trained(tmp_path), single_device)
    found = json.loads((tmp_path / "cluster.json").read_text())
    cluster = found["cluster"]
    assert (cluster["nodes"], cluster["devices_per_node"]) == (2, 2)
    for key in ("intra_p2p_bw", "inter_p2p_bw", "intra_allreduce_bw", "inter_allreduce_bw"):
        assert cluster[key] > 0
    # measured separately: two figures from different links never come out bit-identical
    assert cluster["intra_p2p_bw"] != cluster["inter_p2p_bw"]
    assert cluster["intra_allreduce_bw"] != cluster["inter_allreduce_bw"]
