"""What ``torch.compile`` does under the runtime: graphs, graph breaks and recompiles per rank.

A 2-stage plan runs on 2 CPU processes (gloo) for a few training steps of a ``nn.Sequential``
of residual MLP blocks, with the blocks compiled (``block.compile()``: what docs/models.md
recommends) or the whole stage compiled (``stage.compile()``: the container itself), under the
``dapple`` schedule and the zero-bubble ``zb-h1`` (whose linear layers route their weight work
through a store during split steps). Dynamo's counters are read on each rank after the first
step (its compiles are expected) and after the last: frames compiled after the first step are
recompiles. Every run's losses are checked against the same run without compiling.

    python benchmarks/compile_check.py              # about 2 minutes on 2 idle cores
    python benchmarks/compile_check.py --steps 4    # fewer steps
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch._dynamo.utils import counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dapple_lightning.plan import Plan
from dapple_lightning.runtime import Pipeline, p2p_groups
from dapple_lightning.surgery import partition

BATCH, WIDTH = 16, 32
SCHEDULES = ("dapple", "zb-h1")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, WIDTH), Block(), Block(), Block(), Block(), nn.Linear(WIDTH, 4))


class Step:
    """The user's step of the runtime's contract: the stage on the micro-batch's rows, then the loss."""

    def __init__(self, stage: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        self.stage, self.x, self.y = stage, x, y

    def run(self, m: int, rows) -> torch.Tensor:
        out = self.stage(self.x[rows.start : rows.stop])
        return nn.functional.mse_loss(out, self.y[rows.start : rows.stop]) * (len(rows) / BATCH)

    def context(self):
        return nullcontext()

    def replica_share(self) -> torch.Tensor:
        return torch.zeros(1, dtype=torch.float64)


def counts() -> dict[str, int]:
    return {
        "frames": int(counters["frames"]["total"]),
        "graphs": int(counters["stats"]["unique_graphs"]),
        "breaks": int(sum(counters["graph_break"].values())),
    }


def run_rank(rank: int, port: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    groups = p2p_groups(timeout=timedelta(seconds=60))
    results = {}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)
    # The whole stage compiled comes last: where it fails in a step, the peer's receive fails after the timeout.
    runs = [(schedule, mode) for schedule in SCHEDULES for mode in ("eager", "blocks")] + [("dapple", "stage")]
    for schedule, mode in runs:
        plan = Plan(stages=[{"layers": [0, 3]}, {"layers": [3, 6]}], micro_batches=4, schedule=schedule)
        torch._dynamo.reset()
        counters.clear()
        stage = partition(model(), plan, rank)
        losses: list[float] = []
        after_first: dict[str, int] = {}
        try:
            if mode == "blocks":
                for layer in stage:
                    layer.compile()
            elif mode == "stage":
                stage.compile()  # refused, before any message: no peer waits
            pipe = Pipeline(plan, rank, stage, device=torch.device("cpu"), p2p_groups=groups)
            optimizer = torch.optim.SGD(stage.parameters(), lr=0.01)
            for step in range(steps):
                stats = pipe.run(BATCH, Step(stage, x, y))
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(sum(loss.item() for loss in stats.losses)))
                if step == 0:
                    after_first = counts()
        except Exception as error:  # recorded: what a user who compiles this way meets
            results[f"{schedule}/{mode}"] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"}
            break
        last = counts()
        results[f"{schedule}/{mode}"] = {
            "first_step": after_first,
            "recompiles_after_first_step": last["frames"] - after_first["frames"],
            "graph_breaks_after_first_step": last["breaks"] - after_first["breaks"],
            "losses": losses,
        }
        pipe.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="compile_check")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(run_rank, args=(port, args.steps, args.out), nprocs=2, start_method="spawn")
    ranks = [json.loads(Path(args.out, f"rank{r}.json").read_text()) for r in range(2)]
    print(f"torch {torch.__version__}, {args.steps} steps, 2 ranks (gloo, CPU)")
    print(
        f"{'schedule/mode':<16} {'rank':>4} {'frames 1st':>10} {'graphs 1st':>10} {'breaks 1st':>10} "
        f"{'recompiles':>10} {'breaks':>7}  losses match eager"
    )
    for key in dict.fromkeys([*ranks[0], *ranks[1]]):
        schedule = key.split("/")[0]
        eager = ranks[1][f"{schedule}/eager"]["losses"]
        for rank, result in enumerate(ranks):
            if key not in result or "error" in result[key]:
                print(
                    f"{key:<16} {rank:>4}  failed: {result.get(key, {}).get('error', 'stopped after the peer failed')}"
                )
                continue
            first = result[key]["first_step"]
            same = (
                ""
                if rank == 0
                else str(
                    all(
                        abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(result[key]["losses"], eager, strict=True)
                    )
                )
            )
            print(
                f"{key:<16} {rank:>4} {first['frames']:>10} {first['graphs']:>10} {first['breaks']:>10} "
                f"{result[key]['recompiles_after_first_step']:>10} {result[key]['graph_breaks_after_first_step']:>7}"
                f"  {same}"
            )
    Path(args.out, "summary.json").write_text(json.dumps(ranks, indent=1))


if __name__ == "__main__":
    main()
