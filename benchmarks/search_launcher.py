"""Launcher benchmark: the search's own trial launcher against PyTorch's elastic launcher, same trial.

A trial is the search's smallest unit of work: the tiny MLP of ``dapple_lightning.search.testing``
on 2 ranks, 1 warm-up and 2 timed steps, trained by the search's own rank program (``python -m
dapple_lightning.trials._worker SPEC``, which reads the variables every launcher sets). Four ways
to start its ranks, run interleaved (the order rotates every repeat), medians reported:

- ``search fork``: the search's default on Linux (``TrialConfig(launcher="fork")``): a template
  process that imported torch and Lightning once forks the trial's leader (warmed by one untimed
  trial, as a search's first trial warms it); up to c8ba39f the leader was the search's own
  supervisor, since then PyTorch's elastic agent forks the ranks (``_leader``);
- ``search exec``: the same leader started as a fresh interpreter, and fresh interpreters for the
  ranks (``launcher="exec"``);
- ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 0
  --monitor-interval 0.1 -m dapple_lightning.trials._worker SPEC`` in a new session;
- ``elastic fork``: ``torch.distributed.launcher.api.elastic_launch`` with ``start_method="fork"``,
  called in a child forked from a process that imported torch and Lightning (the template's trick,
  with PyTorch's agent in place of the search's leader).

Two figures per launcher: the wall time of a clean trial (start to return), and the time from a
rank's SIGKILL (the last rank kills itself at its first step, as the kernel's OOM killer would:
``mlp(oom_on=..., failure_stamp=...)``) to the moment the launcher has returned.

    python benchmarks/search_launcher.py                 # 5 repeats, a few minutes
    python benchmarks/search_launcher.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from dapple_lightning.plan import Plan
from dapple_lightning.trials import TrialConfig, run_trial

WORKER = "dapple_lightning.trials._worker"
LAUNCHERS = ("search fork", "search exec", "torchrun", "elastic fork")


def trial_config(launcher: str, stamp: str | None) -> TrialConfig:
    # The plan has 2 micro-batches: oom_on=[2] SIGKILLs the last rank at its first step.
    kwargs = {} if stamp is None else {"oom_on": [2], "failure_stamp": stamp}
    return TrialConfig(
        "dapple_lightning.search.testing:mlp",
        world_size=2,
        global_batch=8,
        warmup=1,
        steps=2,
        model_kwargs=kwargs,
        launcher=launcher,
        timeout_s=120,
    )


PLAN = Plan.straight(6, 2, micro_batches=2)


def _spec(template: dict[str, Any], out: Path, stamp: str | None) -> Path:
    config = trial_config("exec", stamp)
    spec = {**template, "out_dir": str(out), "model_kwargs": dict(config.model_kwargs)}
    path = out / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _torchrun(spec: Path) -> bool:
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("--max-restarts", "0", "--monitor-interval", "0.1", "--log-dir", str(spec.parent / "elastic")),
        *("-m", WORKER, str(spec)),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(spec.parent / "launcher.out", "wb") as out, open(spec.parent / "launcher.err", "wb") as err:
        code = subprocess.run(command, stdout=out, stderr=err, env=env, start_new_session=True).returncode
    return code == 0


def _worker_entry(spec: str) -> None:
    sys.argv = [WORKER, spec]
    try:
        runpy.run_module(WORKER, run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise


def _elastic_fork(spec: Path) -> bool:
    """``elastic_launch`` with forked ranks, in a child forked from this (torch-importing) process."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
            from torch.distributed.launcher.api import LaunchConfig, elastic_launch

            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=2,
                run_id=uuid.uuid4().hex,
                rdzv_backend="c10d",
                rdzv_endpoint="localhost:0",
                max_restarts=0,
                monitor_interval=0.1,
                start_method="fork",
                logs_specs=DefaultLogsSpecs(log_dir=str(spec.parent / "elastic")),
            )
            with open(spec.parent / "launcher.err", "wb") as err:
                os.dup2(err.fileno(), 2)
                os.dup2(err.fileno(), 1)
                os.environ["OMP_NUM_THREADS"] = "1"
                elastic_launch(config, _worker_entry)(str(spec))
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def one(launcher: str, template: dict[str, Any], killed: bool) -> float:
    """Seconds of one trial (clean), or from the rank's SIGKILL to the launcher's return (killed)."""
    with tempfile.TemporaryDirectory(prefix="dapple-launch-") as tmp:
        out = Path(tmp)
        stamp = str(out / "killed_at") if killed else None
        start = time.time()
        if launcher.startswith("search"):
            result = run_trial(PLAN, trial_config(launcher.split()[1], stamp))
            ok = result.status == "complete"
        else:
            spec = _spec(template, out, stamp)
            ok = (_torchrun if launcher == "torchrun" else _elastic_fork)(spec)
            ok = ok and (out / "rank0.json").exists()
        end = time.time()
        if killed:
            if ok:
                raise RuntimeError(f"{launcher}: the killed trial reported success")
            return end - float(Path(stamp).read_text())
        if not ok:
            raise RuntimeError(f"{launcher}: the clean trial failed (see {out})")
        return end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import lightning.pytorch  # noqa: F401  (what the elastic-fork child inherits, as the template does)

    # Warm the fork template and take the worker's spec from a kept trial.
    warm = run_trial(PLAN, replace(trial_config("fork", None), keep_logs=True))
    template = json.loads((Path(warm.workdir) / "spec.json").read_text())
    times: dict[tuple[str, bool], list[float]] = {(name, k): [] for name in LAUNCHERS for k in (False, True)}
    for r in range(args.repeats):
        order = LAUNCHERS[r % len(LAUNCHERS) :] + LAUNCHERS[: r % len(LAUNCHERS)]
        for killed in (False, True):
            for name in order:
                seconds = one(name, template, killed)
                times[(name, killed)].append(seconds)
                print(f"repeat {r + 1}: {name:<12} {'killed' if killed else 'clean':<6} {seconds:6.2f} s", flush=True)
    print("\n| launcher | clean trial, median s (all) | rank SIGKILL to return, median s (all) |")
    print("|---|---|---|")
    for name in LAUNCHERS:
        cells = []
        for killed in (False, True):
            values = times[(name, killed)]
            cells.append(f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})")
        print(f"| {name} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
