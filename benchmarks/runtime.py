"""Runtime benchmark: a 2-stage pipeline on 2 CPU processes, dapple against its peers.

Six systems train the reference transformer of the runtime issue (embedding 512x256, 8
``TransformerEncoderLayer(256, 4, 1024)``, head to 512; batch 64, sequence 64) side by side:

    single        one process, one thread, M micro-batches of gradient accumulation (T1)
    ddp           Lightning ``strategy="ddp"``, 2 processes, 32 rows each, no micro-batching
    torch-gpipe   ``torch.distributed.pipelining.ScheduleGPipe``, 2 stages, M micro-batches
    torch-1f1b    ``torch.distributed.pipelining.Schedule1F1B``, same
    torch-zb      ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble``, same stages
                  (one per rank: its zero-bubble schedule on the same split, W split from B)
    dapple-gpipe  ``Trainer(strategy=DappleStrategy(plan))``, schedule ``gpipe``
    dapple        same, schedule ``dapple`` (early backward)
    dapple-zb     same, schedule ``zb-h1`` (zero bubble: B and W apart, W deferred)
    dapple-zb2    same, schedule ``zb-h2`` (zero bubble holding up to 2S - 1 micro-batches per stage)
    dapple-zbt    same, schedule ``zb-tail`` (whole backwards but for the W's that fill the cooldown)

and, on a split into four chunks ``[0, 3) | [3, 5) | [5, 7) | [7, 10)``, two per rank:

    torch-int     ``torch.distributed.pipelining.ScheduleInterleaved1F1B``, rank r holds chunks r, r + 2
    torch-zbv     ``torch.distributed.pipelining.ScheduleZBVZeroBubble``, rank r holds chunks r, 3 - r
    dapple-int    ``DappleStrategy``, ``chunks: 2``, looped layout, schedule ``interleaved``
    dapple-zbv    same, V layout, schedule ``zb-v``
    dapple-vh     same, V layout, schedule ``v-half``

The model is one ``nn.Sequential`` of 10 layers; both pipelines split it ``[0, 5) | [5, 10)``.
Every process runs one thread (``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``); SGD
(lr 1e-3) everywhere. Rounds alternate: each round starts every system once (a fresh set of
processes, in an order rotated per round) for ``warmup + steps`` optimizer steps. Rank 0 times
each step as the wall time between the ends of consecutive optimizer steps (so whatever a
framework does between steps counts), with no barrier in any system. A system's time is the
median over rounds of its per-round median over the steps after warm-up.

Multi-process systems are started as plain subprocesses of this script with the usual
``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` variables (what ``torchrun``
would set, without its agent process polling on the shared cores); Lightning sees them as an
externally launched cluster.

After the rounds, the script measures peak live activation bytes per stage of dapple's GPipe,
DAPPLE and zb-h1 schedules at M = 8 and 16 (and zb-h2's or zb-tail's when ``dapple-zb2`` or
``dapple-zbt`` is among the systems; ``DappleStrategy(track_memory=True)``) and writes a Chrome
trace of one dapple run (``--trace-system dapple-zb``: of zb-h1, ``dapple-zb2``: of zb-h2,
``dapple-zbt``: of zb-tail; ``DappleStrategy(trace=...)``), from which it reports the bubble
fraction per stage beside the schedule's ideal (its lists replayed with the traced passes and
free transfers) and where each stage's step time goes.

    python benchmarks/runtime.py                 # defaults: about 6 min on 2 idle cores
    python benchmarks/runtime.py --quick         # smoke run, about 1 minute
    python benchmarks/runtime.py --rounds 3 --steps 4 --warmup 2 --systems single,dapple
    python benchmarks/runtime.py --recv-latency  # adds a ~20 s probe of late-posted receives
    python benchmarks/runtime.py --systems torch-1f1b,dapple,dapple-zb,torch-zb --trace-system dapple-zb
    python benchmarks/runtime.py --systems torch-1f1b,dapple,dapple-zb,torch-zb,dapple-zb2 --trace-system dapple-zb2
    python benchmarks/runtime.py --systems torch-1f1b,dapple,torch-zb,dapple-zb2,dapple-zbt --trace-system dapple-zbt
    python benchmarks/runtime.py --systems torch-1f1b,dapple,dapple-zb2,torch-int,dapple-int,torch-zbv,dapple-zbv,dapple-vh \
        --trace-steps 0

Besides wall time, every launch reports CPU seconds per step summed over ranks (work, not
waiting: a rank blocked in a gloo receive sleeps) and how many cores' worth of CPU other
processes used meanwhile (from /proc/stat): on a shared machine the wall times measure that
load as much as the runtime, and the CPU column is the steadier comparison.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Set before torch is imported so every worker's intra-op pool has one thread.
if "--worker" in sys.argv:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _harness  # noqa: E402
from benchmarks._harness import (  # noqa: E402
    StepRecorder,
    counter_per_step,
    median,
    other_load,
    step_times,
    timed_trainer,
    write_record,
)

D_MODEL, BLOCKS = 256, 8  # the reference model of benchmarks/search_models.py: vocab 512, 4 heads, FFN 1024
BATCH, SEQ = 64, 64
SPLIT = 5  # stage 0: layers [0, 5) = embedding + 4 blocks; stage 1: [5, 10) = 4 blocks + head
STAGES = 2
SYSTEMS = (
    "single",
    "ddp",
    "torch-gpipe",
    "torch-1f1b",
    "torch-zb",
    "dapple-gpipe",
    "dapple",
    "dapple-zb",
    "dapple-zb2",
    "dapple-zbt",
    "torch-int",
    "torch-zbv",
    "dapple-int",
    "dapple-zbv",
    "dapple-vh",
)
PIPELINES = ("torch-gpipe", "torch-1f1b", "torch-zb", "dapple-gpipe", "dapple", "dapple-zb", "dapple-zb2", "dapple-zbt")
PIPELINES += ("torch-int", "torch-zbv", "dapple-int", "dapple-zbv", "dapple-vh")
SCHEDULE_OF = {
    "dapple-gpipe": "gpipe",
    "dapple": "dapple",
    "dapple-zb": "zb-h1",
    "dapple-zb2": "zb-h2",
    "dapple-zbt": "zb-tail",
    "dapple-int": "interleaved",
    "dapple-zbv": "zb-v",
    "dapple-vh": "v-half",
}
"""dapple's systems and the schedule each runs."""
TORCH_PIPELINES = ("torch-gpipe", "torch-1f1b", "torch-zb", "torch-int", "torch-zbv")
CHUNK_CUTS = (0, 3, 5, 7, BLOCKS + 2)
"""The four chunks of the chunked systems: embedding + 2 blocks, 2 blocks, 2 blocks, 2 blocks + head."""
LAYOUT_OF = {"dapple-int": "looped", "dapple-zbv": "v", "dapple-vh": "v", "torch-int": "looped", "torch-zbv": "v"}
"""The chunked systems and their layout: looped (rank r holds chunks r, r + 2) or V (r, 3 - r)."""
LR = 1e-3
CHUNKED_DAPPLE = ("dapple-int", "dapple-zbv", "dapple-vh")


# ============================================================================ workers


def reference(num_batches: int):
    """The reference LightningModule (``benchmarks/search_models.py``: the model, seeded weights
    and SGD every system uses) and its data: seeded random tokens, the target of position t the
    token at t + 1, as ``(inputs, targets)`` of ``num_batches`` global batches."""
    from benchmarks.search_models import transformer

    module, loader = transformer(BATCH, seq=SEQ, batches=num_batches, blocks=BLOCKS)
    return module, loader.dataset.tensors


def build_layers():
    return reference(0)[0].layers


def make_data(num_batches: int):
    return reference(num_batches)[1]


def worker_single(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    model = build_layers()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_data(args.total_steps)
    m = args.micro_batches
    rec = StepRecorder()
    for step in range(args.total_steps):
        xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        rec.start()
        for xm, ym in zip(xb.chunk(m), yb.chunk(m)):
            loss = F.cross_entropy(model(xm).flatten(0, 1), ym.flatten()) / m
            loss.backward()
        opt.step()
        opt.zero_grad()
        rec.end()
    write_record(0, rec.data)


def worker_torch_pipeline(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layers = build_layers()

    def loss_fn(output, target):
        return F.cross_entropy(output.flatten(0, 1), target.flatten())

    if args.worker in LAYOUT_OF:  # two chunks per rank, looped or in a V
        held = chunks_of(rank, LAYOUT_OF[args.worker])
        parts = [layers[CHUNK_CUTS[c] : CHUNK_CUTS[c + 1]] for c in held]
        local = torch.nn.ModuleList(parts)
        stages = [PipelineStage(part, c, 4, torch.device("cpu")) for part, c in zip(parts, held)]
        cls = ScheduleInterleaved1F1B if args.worker == "torch-int" else ScheduleZBVZeroBubble
        sched: Any = cls(stages, n_microbatches=args.micro_batches, loss_fn=loss_fn)
        first, last = 0 in held, 3 in held
    else:
        local = layers[:SPLIT] if rank == 0 else layers[SPLIT:]
        stage = PipelineStage(local, rank, STAGES, torch.device("cpu"))
        first, last = rank == 0, rank == 1
        if args.worker == "torch-zb":
            # One stage per rank, as the other systems: torch's zero-bubble schedule on the same split
            # (ScheduleZBVZeroBubble needs two chunks per rank in a V: torch-zbv, on the four-chunk split).
            sched = ScheduleInterleavedZeroBubble([stage], n_microbatches=args.micro_batches, loss_fn=loss_fn)
        else:
            cls = ScheduleGPipe if args.worker == "torch-gpipe" else Schedule1F1B
            sched = cls(stage, n_microbatches=args.micro_batches, loss_fn=loss_fn)
    opt = torch.optim.SGD(local.parameters(), lr=LR)
    x, y = make_data(args.total_steps)
    rec = StepRecorder()
    for step in range(args.total_steps):
        xb, yb = x[step * BATCH : (step + 1) * BATCH], y[step * BATCH : (step + 1) * BATCH]
        rec.start()
        if first and last:
            sched.step(xb, target=yb)
        elif first:
            sched.step(xb)
        else:
            sched.step(target=yb)
        opt.step()
        opt.zero_grad()
        rec.end()
    write_record(rank, rec.data)
    dist.barrier()
    dist.destroy_process_group()


def chunks_of(rank: int, layout: str) -> tuple[int, int]:
    """The two of the four chunks ``rank`` holds."""
    return (rank, rank + 2) if layout == "looped" else (rank, 3 - rank)


def worker_lightning(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    module, (x, y) = reference(args.total_steps)
    if args.worker == "ddp":
        strategy: Any = "ddp"
        batch_size = BATCH // 2  # the injected DistributedSampler gives each rank half the rows
    else:
        from dapple_lightning import DappleStrategy

        plan: dict[str, Any] = {
            "micro_batches": args.micro_batches,
            "schedule": SCHEDULE_OF[args.worker],
            "stages": [{"layers": [0, SPLIT]}, {"layers": [SPLIT, BLOCKS + 2]}],
        }
        if args.worker in LAYOUT_OF:
            cuts = list(itertools.pairwise(CHUNK_CUTS))
            plan.update(chunks=2, layout=LAYOUT_OF[args.worker], stages=[{"layers": list(c)} for c in cuts])
        strategy = DappleStrategy(plan, start_method="popen", trace=args.trace, track_memory=args.track_memory)
        batch_size = BATCH  # the plan acts as one device: every rank sees the global batch
    trainer, timer = timed_trainer(strategy, 2, args.total_steps)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    rank = trainer.global_rank
    record: dict[str, Any] = dict(timer.rec.data)
    if args.worker != "ddp":
        stats = trainer.strategy.step_stats
        record.update(
            stage=trainer.strategy.plan.group_of(rank),  # the rank group: its stage without chunks
            peak_live_bytes=stats.peak_live_bytes,
            peak_live_microbatches=stats.peak_live_microbatches,
        )
    write_record(rank, record)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


RECV_MODES = (
    "dapple comm.Link (header and payload) posted before the compute",
    "one message, recv posted when needed",
    "one message, irecv posted before the compute",
)


def worker_recv_latency(args: argparse.Namespace) -> None:
    """How long a receive waits for data its peer sent ~60 ms earlier, while the peer computes.

    Rank 0 sends one micro-batch's activation (8 x 64 x 256 fp32) and computes 60 ms; rank 1
    computes 60 ms, then receives it. Gloo moves an unbound buffer only once the receive is
    posted and the sender's gloo thread answers, so a receive posted late waits for a busy peer.
    """
    import torch
    import torch.distributed as dist

    from dapple_lightning import runtime as comm

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    a, x = torch.randn(128, 128), torch.randn(8, BATCH, D_MODEL)
    buf = torch.empty_like(x)

    def compute(ms: float) -> None:
        t = time.perf_counter()
        while (time.perf_counter() - t) * 1e3 < ms:
            a @ a

    link = comm.Link(torch.device("cpu"))
    waits: dict[str, list[float]] = {m: [] for m in RECV_MODES}
    for mode in RECV_MODES * 2:  # twice, interleaved
        dist.barrier()
        pending = comm.Pending()
        for _ in range(args.total_steps):
            if rank == 0:
                if mode == RECV_MODES[0]:
                    link.send([x], 1, len(x), pending, as_tuple=False)
                else:
                    pending.works.append(dist.isend(x, 1))
                compute(60)
            else:
                early = dist.irecv(buf, 0) if mode == RECV_MODES[2] else None
                incoming = link.post(0, len(x)) if mode == RECV_MODES[0] else None
                compute(60)
                t = time.perf_counter()
                if incoming is not None:
                    incoming.wait()
                elif early is not None:
                    early.wait()
                else:
                    dist.recv(buf, 0)
                waits[mode].append((time.perf_counter() - t) * 1e3)
        pending.wait()
    write_record(rank, {"waits_ms": waits})
    dist.barrier()
    dist.destroy_process_group()


def run_worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    if args.worker == "single":
        worker_single(args)
    elif args.worker == "recv-latency":
        worker_recv_latency(args)
    elif args.worker in TORCH_PIPELINES:
        worker_torch_pipeline(args)
    else:
        worker_lightning(args)


# ======================================================================= orchestration


def launch(
    system: str,
    total_steps: int,
    micro_batches: int,
    *,
    timeout: float,
    track_memory: bool = False,
    trace: str | None = None,
) -> list[dict[str, Any]]:
    """Run ``system`` on fresh processes; every rank's record, by rank."""
    args = ["--worker", system, "--total-steps", str(total_steps), "--micro-batches", str(micro_batches)]
    if track_memory:
        args.append("--track-memory")
    if trace:
        args += ["--trace", trace]
    return _harness.launch(__file__, args, 1 if system == "single" else 2, timeout=timeout, what=system)


def load_trace(path: str | Path):
    """The Chrome trace written by ``DappleStrategy(trace=...)`` as ``timeline.Event`` objects."""
    from dapple_lightning.runtime import Event

    data = json.loads(Path(path).read_text())
    stage_of_rank: dict[int, int] = {}
    events = []
    for e in data["traceEvents"]:
        if e.get("ph") != "X":
            continue
        a = e["args"]
        stage_of_rank[e["pid"]] = a["stage"]
        start = e["ts"] / 1e6
        events.append(Event(e["cat"], e["pid"], a["stage"], a["micro_batch"], start, start + e["dur"] / 1e6, a["step"]))
    return events


def trace_breakdown(events, warmup: int) -> dict[int, dict[str, float]]:
    """Per stage, mean seconds per step after warm-up: spent in each kind of span, and outside them.

    ``step`` is the wall time between the first events of consecutive steps on that rank, so
    ``outside`` (step minus all spans) is what happens between the schedule's actions: the
    optimizer step, Lightning's loop, the loss broadcast, Python between spans.
    """
    out: dict[int, dict[str, float]] = {}
    for rank in sorted({e.rank for e in events}):
        mine = [e for e in events if e.rank == rank]
        steps = sorted({e.step for e in mine})
        firsts = {s: min(e.start for e in mine if e.step == s) for s in steps}
        kept = [s for s in steps if s >= warmup and s + 1 in firsts]
        if not kept:
            continue
        row: dict[str, float] = {}
        for s in kept:
            in_step = [e for e in mine if e.step == s]
            for e in in_step:
                row[e.name] = row.get(e.name, 0.0) + (e.end - e.start) / len(kept)
            row["step"] = row.get("step", 0.0) + (firsts[s + 1] - firsts[s]) / len(kept)
            last = max(e.end for e in in_step)
            row["after last span"] = row.get("after last span", 0.0) + (firsts[s + 1] - last) / len(kept)
        row["outside spans"] = row["step"] - sum(v for k, v in row.items() if k not in ("step", "after last span"))
        out[mine[0].stage] = row
    return out


def print_zero_bubble_memory(memory: dict[str, Any], micro_batches: list[int], system: str = "dapple-zb") -> None:
    """Peak live activations of dapple's zb-h1 (or zb-h2: ``system``) against its 1F1B schedule, per stage."""
    name = SCHEDULE_OF[system]
    rows = [(mb, memory.get(f"dapple M={mb}"), memory.get(f"{system} M={mb}")) for mb in micro_batches]
    rows = [(mb, d, z) for mb, d, z in rows if d and z]
    if not rows:
        return
    print()
    print(
        f"| M | stage | 1F1B (dapple) peak live MiB (micro-batches) | {name} peak live MiB (micro-batches) | zb/1F1B |"
    )
    print("|---|---|---|---|---|")
    for mb, d, z in rows:
        for stage in sorted(d):
            (db, dm), (zb, zm) = d[stage], z[stage]
            print(f"| {mb} | {stage} | {db / 2**20:.1f} ({dm}) | {zb / 2**20:.1f} ({zm}) | {zb / db:.3f} |")


def ideal_bubble(system: str, breakdown: dict[int, dict[str, float]], micro_batches: int) -> str:
    """The schedule's bubble fraction with free transfers and nothing between actions, as text: its
    lists replayed (``schedule.simulate``) with each stage's traced mean F, B and W per micro-batch,
    per stage; beside the textbook value at equal stages (1F1B ``(S-1)/(M+S-1)``; ZB-H1 and, in a
    step that ends in the update, ZB-H2 and at S = 2 zb-tail, at F = B = W ``(S-1)/(3M+S-1)``)."""
    from dapple_lightning.schedule import schedule, simulate, split_backwards

    s, m = STAGES, micro_batches
    name = SCHEDULE_OF[system]
    lists = schedule(name, s, m)
    # Per action: a micro-batch with a W splits its backward (traced as backward-input and
    # backward-weight), the others run it whole (traced as backward); zb-tail has both kinds.
    split = [split_backwards(acts) for acts in lists]
    cost = {
        stage: {
            "F": row.get("forward", 0.0) / m,
            "whole": row.get("backward", 0.0) / max(m - len(split[stage]), 1),
            "B": row.get("backward-input", 0.0) / max(len(split[stage]), 1),
            "W": row.get("backward-weight", 0.0) / max(len(split[stage]), 1),
        }
        for stage, row in breakdown.items()
    }
    textbook = (s - 1) / (3 * m + s - 1) if name.startswith("zb-") else (s - 1) / (m + s - 1)
    if sorted(cost) != list(range(s)):
        return f"{textbook:.1%} (equal stages)"

    def duration(stage: int, action) -> float:
        whole = action.kind == "B" and action.micro_batch not in split[stage]
        return cost[stage]["whole" if whole else action.kind]

    timed = simulate(lists, duration)
    step = max(t.end for t in timed)
    idle = [1 - sum(t.end - t.start for t in timed if t.stage == k) / step for k in range(s)]
    per_stage = ", ".join(f"stage {k}: {v:.1%}" for k, v in enumerate(idle))
    return f"{per_stage} (its lists replayed with the traced passes); {textbook:.1%} at equal stages"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system per round (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, at least 1 (default 2)")
    parser.add_argument("--micro-batches", type=int, default=8, help="M (default 8)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of " + ",".join(SYSTEMS))
    parser.add_argument("--memory-micro-batches", default="8,16", help="M values for the memory runs ('' skips)")
    parser.add_argument("--trace-path", default=None, help="where the dapple Chrome trace goes (default: a temp dir)")
    parser.add_argument("--trace-steps", type=int, default=6, help="steps of the traced dapple run ('0' skips)")
    parser.add_argument(
        "--trace-system",
        default="dapple",
        choices=("dapple", "dapple-zb", "dapple-zb2", "dapple-zbt"),
        help="system traced",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds before one launch is killed")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 timed steps, 1 warm-up, short trace")
    parser.add_argument(
        "--quiet-load",
        type=float,
        default=0.25,
        help="also summarise the launches during which other processes used at most this many cores (0.25)",
    )
    parser.add_argument(
        "--recv-latency",
        action="store_true",
        help="also probe how long a receive posted late waits for a busy sender (about 20 s)",
    )
    parser.add_argument("--json", default=None, help="also write all measurements to this JSON file")
    # Worker-side options (the script re-runs itself with --worker).
    parser.add_argument("--worker", choices=(*SYSTEMS, "recv-latency"), help=argparse.SUPPRESS)
    parser.add_argument("--total-steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--track-memory", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--trace", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return

    if args.quick:
        args.rounds, args.steps, args.warmup, args.trace_steps = 1, 2, 1, 3
    args.warmup = max(args.warmup, 1)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    M, total = args.micro_batches, args.warmup + args.steps
    t_start = time.monotonic()
    print(
        f"# runtime benchmark: {os.cpu_count()} CPUs, torch threads 1/process, batch {BATCH}x{SEQ}, M={M}, "
        f"{args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up)",
        flush=True,
    )

    # metric -> system -> one value per round (None where the launch failed)
    metric_names = ("wall", "inside", "cpu", "other", "faults", "switches")
    rounds: dict[str, dict[str, list[float | None]]] = {k: {s: [] for s in systems} for k in metric_names}
    threads: dict[str, int] = {}
    for r in range(args.rounds):
        order = systems[r % len(systems) :] + systems[: r % len(systems)]
        for system in order:
            load = os.getloadavg()[0]
            try:
                records = launch(system, total, M, timeout=args.timeout)
            except RuntimeError as e:
                print(f"round {r}: {e}", file=sys.stderr, flush=True)
                for k in metric_names:
                    rounds[k][system].append(None)
                continue
            periods, inside = step_times(records[0], args.warmup)
            values = {
                "wall": median(periods),
                "inside": median(inside),
                "cpu": counter_per_step(records, "cpu", args.warmup),
                "other": other_load(records, args.warmup),
                "faults": counter_per_step(records, "faults", args.warmup),
                "switches": counter_per_step(records, "switches", args.warmup),
            }
            for k, v in values.items():
                rounds[k][system].append(v)
            threads[system] = max(rec["threads"] for rec in records)
            print(
                f"round {r}  {system:<13} median {values['wall']:.3f} s/step  "
                f"steps {' '.join(f'{p:.3f}' for p in periods)}  cpu {values['cpu']:.3f} s/step  "
                f"other load {values['other']:.2f} cores (loadavg {load:.1f})",
                flush=True,
            )
    per_round, per_round_cpu = rounds["wall"], rounds["cpu"]

    def ok(values: list[float | None]) -> list[float]:
        return [v for v in values if v is not None]

    def paired(metric: dict[str, list[float | None]], a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(metric[a], metric[b]) if x is not None and y is not None]

    results = {s: median(ok(v)) for s, v in per_round.items()}
    cpu = {s: median(ok(v)) for s, v in per_round_cpu.items()}
    t1 = results.get("single", float("nan"))
    bound = (t1 / STAGES) * (1 + (STAGES - 1) / M)
    names = {
        "single": "single process, 1 thread, grad. accumulation (T1)",
        "ddp": "Lightning DDP, 2 processes x 32 rows",
        "torch-gpipe": "torch.distributed.pipelining ScheduleGPipe",
        "torch-1f1b": "torch.distributed.pipelining Schedule1F1B",
        "torch-zb": "torch.distributed.pipelining ScheduleInterleavedZeroBubble (1 stage/rank)",
        "dapple-gpipe": "dapple, schedule gpipe",
        "dapple": "dapple, schedule dapple",
        "dapple-zb": "dapple, schedule zb-h1",
        "dapple-zb2": "dapple, schedule zb-h2",
        "dapple-zbt": "dapple, schedule zb-tail",
        "torch-int": "torch.distributed.pipelining ScheduleInterleaved1F1B (2 chunks/rank)",
        "torch-zbv": "torch.distributed.pipelining ScheduleZBVZeroBubble (2 chunks/rank, V)",
        "dapple-int": "dapple, chunks 2 looped, schedule interleaved",
        "dapple-zbv": "dapple, chunks 2 V, schedule zb-v",
        "dapple-vh": "dapple, chunks 2 V, schedule v-half",
    }
    print()
    print(f"bubble bound (T1/S)(1+(S-1)/M) = ({t1:.3f}/{STAGES})(1+{STAGES - 1}/{M}) = {bound:.3f} s/step")
    print(
        "| system | s/step (median) | min-max over rounds | samples/s | efficiency vs bound | CPU s/step, all ranks |"
    )
    print("|---|---|---|---|---|---|")
    for s in systems:
        v = ok(per_round[s])
        if not v:
            print(f"| {names[s]} | failed | | | | |")
            continue
        eff = f"{bound / results[s]:.1%}" if s in PIPELINES else ""
        print(
            f"| {names[s]} | {results[s]:.3f} | {min(v):.3f}-{max(v):.3f} | {BATCH / results[s]:.1f} | {eff} "
            f"| {cpu[s]:.3f} |"
        )
    print()
    ratios = {}
    pairs = (("dapple", "torch-1f1b"), ("dapple-gpipe", "torch-gpipe"), ("dapple-zb", "torch-1f1b"))
    pairs += (("dapple-zb", "torch-zb"), ("dapple-zb", "dapple"), ("dapple-zb2", "torch-1f1b"))
    pairs += (("dapple-zb2", "torch-zb"), ("dapple-zb2", "dapple"), ("dapple-zb2", "dapple-zb"))
    pairs += (("dapple-zbt", "torch-1f1b"), ("dapple-zbt", "torch-zb"), ("dapple-zbt", "dapple"))
    pairs += (("dapple-zbt", "dapple-zb2"),)
    pairs += (("dapple-zbv", "dapple-zb2"), ("dapple-zbv", "torch-zbv"), ("dapple-zbv", "torch-1f1b"))
    pairs += (("dapple-int", "torch-int"), ("dapple-int", "dapple"), ("dapple-vh", "dapple"))
    pairs += (("torch-zbv", "torch-1f1b"), ("torch-int", "torch-1f1b"))
    for ours, theirs in pairs:
        if ok(per_round.get(ours, [])) and ok(per_round.get(theirs, [])):
            ratios[f"{ours} / {theirs}"] = results[ours] / results[theirs]
            # Paired per round (adjacent launches): less exposed to slow drifts of the load.
            wall, work = paired(per_round, ours, theirs), paired(per_round_cpu, ours, theirs)
            print(
                f"{ours} / {theirs}: step time {results[ours] / results[theirs]:.3f} "
                f"(per-round paired {' '.join(f'{p:.2f}' for p in wall)}; median {median(wall):.3f}), "
                f"CPU per step paired median {median(work):.3f}"
            )
    print()
    print(
        "| system | in-step s (rank 0) | page faults/step | sleeps/step (voluntary context switches) | other load, cores |"
    )
    print("|---|---|---|---|---|")
    for s in systems:
        if ok(per_round[s]):
            print(
                f"| {s} | {median(ok(rounds['inside'][s])):.3f} | {median(ok(rounds['faults'][s])):.0f} "
                f"| {median(ok(rounds['switches'][s])):.0f} | {median(ok(rounds['other'][s])):.2f} |"
            )
    print(f"threads per process seen by the workers: {threads}")

    # The same summary over the launches during which other processes used little CPU.
    clean = {
        s: [t for t, o in zip(per_round[s], rounds["other"][s]) if t is not None and o <= args.quiet_load]
        for s in systems
    }
    if any(clean.values()):
        t1q = median(clean.get("single", []))
        bound_q = (t1q / STAGES) * (1 + (STAGES - 1) / M)
        print(f"\nquiet launches only (other load <= {args.quiet_load} cores): bound {bound_q:.3f} s/step")
        print("| system | quiet launches | s/step (median) | samples/s | efficiency vs bound |")
        print("|---|---|---|---|---|")
        for s in systems:
            if clean[s]:
                t = median(clean[s])
                eff = f"{bound_q / t:.1%}" if s in PIPELINES and clean.get("single") else ""
                print(f"| {names[s]} | {len(clean[s])} | {t:.3f} | {BATCH / t:.1f} | {eff} |")
            else:
                print(f"| {names[s]} | 0 | | | |")

    memory: dict[str, Any] = {}
    for mb in [int(v) for v in args.memory_micro_batches.split(",") if v.strip()]:
        for system in ("dapple-gpipe", "dapple", "dapple-zb", "dapple-zb2", "dapple-zbt", *CHUNKED_DAPPLE):
            if system in ("dapple-zb2", "dapple-zbt", *CHUNKED_DAPPLE) and system not in systems:
                continue  # these schedules' memory only where they are benchmarked: runs cost minutes
            try:
                records = launch(system, 1 if args.quick else 2, mb, timeout=args.timeout, track_memory=True)
            except RuntimeError as e:
                print(e, file=sys.stderr, flush=True)
                continue
            memory[f"{system} M={mb}"] = {
                rec["stage"]: (rec["peak_live_bytes"], rec["peak_live_microbatches"]) for rec in records
            }
    if memory:
        print()
        print(
            "| M | stage | GPipe peak live MiB (micro-batches) | DAPPLE peak live MiB (micro-batches) "
            "| DAPPLE/GPipe | K_s/M | S/M | <= 1.15 S/M |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for mb in [int(v) for v in args.memory_micro_batches.split(",") if v.strip()]:
            g, d = memory.get(f"dapple-gpipe M={mb}"), memory.get(f"dapple M={mb}")
            if not g or not d:
                continue
            for stage in sorted(g):
                (gb, gm), (db, dm) = g[stage], d[stage]
                k = min(STAGES - stage, mb)
                ok = "yes" if db / gb <= 1.15 * STAGES / mb else "NO"
                print(
                    f"| {mb} | {stage} | {gb / 2**20:.1f} ({gm}) | {db / 2**20:.1f} ({dm}) | "
                    f"{db / gb:.3f} | {k / mb:.3f} | {STAGES / mb:.3f} | {ok} |"
                )
        for system in ("dapple-zb", "dapple-zb2", "dapple-zbt", *CHUNKED_DAPPLE):
            print_zero_bubble_memory(
                memory, [int(v) for v in args.memory_micro_batches.split(",") if v.strip()], system
            )

    bubbles: dict[int, float] = {}
    breakdown: dict[int, dict[str, float]] = {}
    if args.trace_steps > 0:
        from dapple_lightning.runtime import bubble_fractions

        trace_dir = None
        if args.trace_path is None:
            trace_dir = tempfile.mkdtemp(prefix="dapple-trace-")
            args.trace_path = str(Path(trace_dir, "dapple-trace.json"))
        trace_warmup = min(args.warmup, args.trace_steps - 1)
        try:
            launch(args.trace_system, trace_warmup + args.trace_steps, M, timeout=args.timeout, trace=args.trace_path)
            events = load_trace(args.trace_path)
            timed = [e for e in events if e.step >= trace_warmup]
            bubbles = bubble_fractions(timed)
            breakdown = trace_breakdown(events, trace_warmup)
        except (RuntimeError, FileNotFoundError) as e:
            print(e, file=sys.stderr, flush=True)
        if bubbles:
            ideal = ideal_bubble(args.trace_system, breakdown, M)
            print()
            print(f"Chrome trace of a {args.trace_system} run (M={M}): {args.trace_path}")
            print(
                f"bubble fraction per stage (timeline.bubble_fractions, steps >= {trace_warmup}): "
                + ", ".join(f"stage {s}: {b:.1%}" for s, b in bubbles.items())
                + f"; ideal {ideal}"
            )
            kinds = ["forward", "backward", "backward-input", "backward-weight", "recv", "send"]
            kinds += ["outside spans", "after last span", "step"]
            print("| stage | " + " | ".join(kinds) + " |")
            print("|---|" + "---|" * len(kinds))
            for stage, row in breakdown.items():
                print(f"| {stage} | " + " | ".join(f"{row.get(k, 0.0):.3f}" for k in kinds) + " |")
            print("(seconds per step, mean over traced steps after warm-up; 'recv' includes waiting for the peer)")

    latency: dict[str, list[float]] = {}
    if args.recv_latency:
        try:
            latency = launch("recv-latency", 30, M, timeout=args.timeout)[1]["waits_ms"]
        except RuntimeError as e:
            print(e, file=sys.stderr, flush=True)
        if latency:
            print()
            print("receive of a 512 KiB activation sent ~60 ms earlier, sender busy computing (30 x 2 transfers):")
            print("| receive | wait ms, median | mean | max |")
            print("|---|---|---|---|")
            for mode, waits in latency.items():
                print(f"| {mode} | {median(waits):.2f} | {statistics.mean(waits):.2f} | {max(waits):.2f} |")

    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "per_round": rounds,
                    "results": results,
                    "bound": bound,
                    "ratios": ratios,
                    "memory": memory,
                    "bubbles": bubbles,
                    "breakdown": breakdown,
                    "recv_latency_ms": latency,
                },
                indent=1,
            )
        )
    print(f"\ntotal wall time {time.monotonic() - t_start:.0f} s")


if __name__ == "__main__":
    main()
