"""Microbenchmark: what the zero-bubble split backward costs over a plain backward, one process.

One stage of the runtime benchmark's reference transformer (``benchmarks/runtime.py``: stage 0 =
embedding + 4 blocks, stage 1 = 4 blocks + head and the loss; 8-row micro-batches of 64
tokens, one thread) runs M micro-batches per step, three ways, interleaved step by step:

    plain (dapple)  dapple's 1F1B list for the stage, plain ``torch.autograd.backward`` per B
    split (zb-h1)   zb-h1's list: ``backward_input`` per B, ``backward_weight`` per W (stage 0
                    runs each W right after its B, stage 1 one micro-batch later), the generic
                    split of the graph for every weight
    store (zb-h1)   stage 1 only, as the runtime runs it there: the same, with the linear layers
                    through the weight-gradient store (``runtime._linear_split``); absent when
                    ``--code`` names a checkout without it

Every step then clears the gradients. Reported per step, medians over the steps after warm-up:
CPU time of each way (the process' user + system time; one thread) and its overhead over plain,
the time in F, B and W, the minor page faults and system time per step (memory the allocator
returned to the OS and faults in again), the autograd engine calls per micro-batch, and the
process' peak RSS. ``--code PATH`` imports ``dapple_lightning`` from another checkout (a
worktree of an earlier commit) to measure the split as it was there. ``--profile`` adds
a cProfile of three zb-h1 steps (top functions by own time), to see where the extra time goes.

    python benchmarks/split_backward.py                      # both stages, M = 8, ~1 min
    python benchmarks/split_backward.py --stage 1 --profile  # and where the split's time goes
    # the split before issue 20's second pass (commit 2d647e0, which did not export the two
    # functions from dapple_lightning.runtime yet):
    mkdir /tmp/split-before && git archive 2d647e0 dapple_lightning | tar -x -C /tmp/split-before
    echo "from dapple_lightning.runtime._split_backward import backward_input, backward_weight" \
        >> /tmp/split-before/dapple_lightning/runtime/__init__.py
    python benchmarks/split_backward.py --code /tmp/split-before
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

if "--code" in sys.argv:  # before dapple_lightning is imported: its split is what gets measured
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--code") + 1]).resolve()))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.runtime import BATCH, SEQ, SPLIT, STAGES, build_layers, make_data  # noqa: E402
from dapple_lightning.runtime import backward_input, backward_weight  # noqa: E402

try:  # absent in checkouts before the store (--code)
    from dapple_lightning.runtime import LinearStore, StoredGrads, WeightWork, backward_stored, storable_linears
except ImportError:
    LinearStore = None
from dapple_lightning.schedule import schedule  # noqa: E402


def stage_module(stage: int) -> torch.nn.Sequential:
    layers = build_layers()
    return layers[:SPLIT] if stage == 0 else layers[SPLIT:]


def micro_inputs(stage: int, micro_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input, target)`` per micro-batch: tokens for stage 0, a random activation for stage 1."""
    tokens, targets = make_data(1)
    rows = BATCH // micro_batches
    out = []
    gen = torch.Generator().manual_seed(0)
    for m in range(micro_batches):
        x = tokens[m * rows : (m + 1) * rows]
        if stage == 1:
            x = torch.randn(rows, SEQ, 256, generator=gen)
        out.append((x, targets[m * rows : (m + 1) * rows]))
    return out


def forward(stage: int, module, x: torch.Tensor, y: torch.Tensor):
    """The stage's forward as the executor sees it: (tensors backward starts from, their grads, input)."""
    if stage == 1:
        x = x.detach().requires_grad_(True)
        loss = F.cross_entropy(module(x).flatten(0, 1), y.flatten())
        return [loss], [None], [x]
    out = module(x)
    # Stage 0's output gradient comes from stage 1; any fixed tensor of its shape stands in.
    return [out], [torch.ones_like(out) * 1e-3], []


def run(stage: int, module, batches, order, way: str) -> dict[str, float]:
    """One step: ``order``'s actions (a schedule's list for this stage) on ``batches``; the
    backward is plain, split or split with the store (``way``). Returns seconds per phase and in all."""
    weights = [p for p in module.parameters() if p.requires_grad]
    times = {"F": 0.0, "B": 0.0, "W": 0.0}
    live: dict[int, tuple] = {}
    layers = LinearStore(storable_linears(module) if way == "store" else []) if LinearStore else None
    stores = {m: StoredGrads() if way == "store" else None for m in range(len(batches))}
    usage = resource.getrusage(resource.RUSAGE_SELF)
    for action in order:
        m, start = action.micro_batch, time.thread_time()
        if action.kind == "F":
            with layers.storing(stores[m]) if layers else contextlib.nullcontext():
                live[m] = forward(stage, module, *batches[m])
        elif action.kind == "B" and way == "plain":
            outs, grads, _ = live.pop(m)
            torch.autograd.backward(outs, grads)
        elif action.kind == "B" and way == "store":
            outs, grads, inputs = live[m]
            with layers.storing(stores[m]):
                backward_stored(outs, grads, inputs, weights, stores[m])
            live[m] = (outs, grads, inputs, WeightWork([]))
        elif action.kind == "B":
            outs, grads, inputs = live[m]
            _, work = backward_input(outs, grads, inputs, weights)
            live[m] = (outs, grads, inputs, work)
        elif stores[m] is not None:
            backward_weight(live.pop(m)[3], stores[m].take())
        else:
            backward_weight(live.pop(m)[3])
        times[action.kind] += time.thread_time() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    times["total"] = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
    times["sys"] = after.ru_stime - usage.ru_stime
    times["faults"] = (after.ru_minflt - usage.ru_minflt) / 1e3  # reported x 1e3 like the times
    return times


def orders(stage: int, micro_batches: int) -> dict[str, tuple[list, str]]:
    """The ways compared: each a stage's action list and how its backward runs."""
    dapple = schedule("dapple", STAGES, micro_batches)[stage]
    zb = schedule("zb-h1", STAGES, micro_batches)[stage]
    ways = {"plain (dapple)": (dapple, "plain"), "split (zb-h1)": (zb, "split")}
    if stage == 1 and LinearStore is not None:
        ways["store (zb-h1)"] = (zb, "store")
    return ways


def engine_calls(stage: int, module, batches) -> dict[str, float]:
    """Autograd engine calls per micro-batch of each way."""
    engine = torch.autograd.variable.Variable._execution_engine
    original = engine.run_backward
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    counts = {}
    torch.autograd.variable.Variable._execution_engine = _Proxy(engine, counted)
    try:
        for name, (order, way) in orders(stage, len(batches)).items():
            calls[0] = 0
            run(stage, module, batches, order, way)
            counts[name] = calls[0] / len(batches)
    finally:
        torch.autograd.variable.Variable._execution_engine = engine
    module.zero_grad(set_to_none=True)
    return counts


class _Proxy:
    def __init__(self, engine, run_backward) -> None:
        self._engine, self.run_backward = engine, run_backward

    def __getattr__(self, name):
        return getattr(self._engine, name)


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024
    return 0.0


def bench(stage: int, micro_batches: int, steps: int, warmup: int, profile: bool) -> None:
    torch.set_num_threads(1)
    module = stage_module(stage)
    batches = micro_inputs(stage, micro_batches)
    calls = engine_calls(stage, module, batches)
    ways = orders(stage, micro_batches)
    names = list(ways)
    results: dict[str, list[dict[str, float]]] = {k: [] for k in ways}
    for step in range(warmup + steps):
        turn = step % len(names)
        for name in names[turn:] + names[:turn]:  # rotated: no way always runs first
            r = run(stage, module, batches, *ways[name])
            module.zero_grad(set_to_none=True)
            if step >= warmup:
                results[name].append(r)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name]) * 1e3

    plain = names[0]
    print(f"\nstage {stage}, M = {micro_batches}, {steps} steps after {warmup} warm-up (CPU ms per step, medians)")
    print(
        f"  {'way':16s} {'CPU':>8s} {'vs plain':>9s} {'F':>7s} {'B':>7s} {'W':>7s} {'B+W':>7s} "
        f"{'sys':>6s} {'faults':>7s} {'engine calls/mb':>16s}"
    )
    for name in names:
        total, backward = med(name, "total"), med(name, "B") + med(name, "W")
        print(
            f"  {name:16s} {total:8.1f} {total / med(plain, 'total') - 1:+9.1%} {med(name, 'F'):7.1f} "
            f"{med(name, 'B'):7.1f} {med(name, 'W'):7.1f} {backward:7.1f} {med(name, 'sys'):6.1f} "
            f"{med(name, 'faults'):7.0f} {calls[name]:16.0f}"
        )
    print(f"  peak RSS of the process: {peak_rss_mib():.0f} MiB")
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            run(stage, module, batches, *ways[names[-1]])
            module.zero_grad(set_to_none=True)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        print(f"  cProfile of 3 steps of {names[-1]} (own time):")
        print("\n".join("    " + line for line in text.getvalue().splitlines()[:40] if line.strip()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, choices=(0, 1), action="append", help="default: both")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--code", help="a checkout whose dapple_lightning is measured (default: this one)")
    args = parser.parse_args()
    for stage in args.stage or (0, 1):
        bench(stage, args.micro_batches, args.steps, args.warmup, args.profile)


if __name__ == "__main__":
    main()
