"""The planner's speed at two commits, side by side: each case runs alternately under both.

    git archive <commit> | tar -x -C /tmp/before
    python benchmarks/planner_before_after.py --before /tmp/before [--reps 3] [--cases ...]

Each run is a fresh process (``PYTHONPATH`` set to the checkout) that plans one case with
``plan_dapple`` and reports its wall and CPU seconds; the two checkouts alternate, so that a
shared machine's load falls on both alike. Prints the medians, the CPU seconds' range over the
runs (min-max) and the ratio of CPU medians.
Cases: the paper's five models on ``Cluster.paper_2x8()`` (``planner_paper.py``'s batches) and
``planner_speed.py``'s 16 x 50 and 64 x 200 (seed 0), for ``top`` 1 and 5 (the CLI's default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = [
    f"{m} {t}" for m in ("VGG-19", "GNMT-16", "BERT-48", "XLNet-36", "AmoebaNet-36", "16x50", "64x200") for t in (1, 5)
]

ONE = """
import json, sys, time
sys.path.insert(0, {here!r})
from dapple_lightning.planner import REFERENCE_PROFILES, Cluster, plan_dapple, read_pipedream
from planner_paper import MODELS
from planner_speed import global_batch, synthetic
name, top = {name!r}, {top}
models = {{m[0]: m for m in MODELS}}
if name in models:
    _, file, pbs, batch = models[name]
    profile, cluster = read_pipedream(REFERENCE_PROFILES / file, pbs), Cluster.paper_2x8()
else:
    world, layers = (int(x) for x in name.split("x"))
    profile, cluster, batch = synthetic(layers, 0), Cluster.parse(f"{{world // 8}}x8"), global_batch(world)
wall, cpu = time.perf_counter(), time.process_time()
best = plan_dapple(profile, cluster, batch, top=top)[0]
import dapple_lightning
assert dapple_lightning.__file__.startswith({root!r}), dapple_lightning.__file__
print(json.dumps([time.perf_counter() - wall, time.process_time() - cpu, best.notation, repr(best.predicted_step_s)]))
"""


def run(root: Path, case: str) -> tuple[float, float, str]:
    name, top = case.split()
    code = ONE.format(here=str(HERE), name=name, top=int(top), root=str(root.resolve()))
    # In the checkout's root: ``python -c`` puts the working directory ahead of PYTHONPATH, so
    # from anywhere else it would import the package found there, not the checkout's.
    out = subprocess.run(
        [sys.executable, "-c", code], env={"PYTHONPATH": str(root)}, cwd=root, capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(f"{case} under {root} failed:\n{out.stderr[-2000:]}")
    wall, cpu, notation, step = json.loads(out.stdout.strip().splitlines()[-1])
    return wall, cpu, f"{notation} {step}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier commit")
    parser.add_argument("--after", type=Path, default=HERE.parent, help="checkout to compare (default: this one)")
    parser.add_argument("--reps", type=int, default=3, help="runs per case and checkout")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated 'NAME TOP' (default: all)")
    args = parser.parse_args()
    print(
        "| case | top | before wall s | before CPU s (range) | after wall s | after CPU s (range) "
        "| CPU before / after | same plan |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case in args.cases.split(","):
        times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        plans: dict[str, str] = {}
        for _ in range(args.reps):
            for label, root in (("before", args.before), ("after", args.after)):
                wall, cpu, plans[label] = run(root, case)
                times[label].append((wall, cpu))
        med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in times.items()}
        spread = {k: f"{min(c for _, c in v):.2f}-{max(c for _, c in v):.2f}" for k, v in times.items()}
        name, top = case.split()
        print(
            f"| {name} | {top} | {med['before'][0]:.2f} | {med['before'][1]:.2f} ({spread['before']}) "
            f"| {med['after'][0]:.2f} | {med['after'][1]:.2f} ({spread['after']}) "
            f"| {med['before'][1] / med['after'][1]:.2f}x | {'yes' if plans['before'] == plans['after'] else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
