"""What the timing benchmarks share: starting rank processes, recording steps, reading them back.

A benchmark script re-runs itself with ``--worker ...`` in fresh processes (one per rank) with
the variables ``torchrun`` would set, and without its agent process polling on the shared
cores; Lightning sees them as an externally launched cluster. Each rank records every optimizer
step with :class:`StepRecorder` and writes the record with :func:`write_record`;
:func:`launch` collects the records (or raises with the ranks' logs).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (all processes, all cores)."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class StepRecorder:
    """What rank code records at the start and end of every optimizer step.

    ``ends``/``starts``: wall clock; ``cpu``: this process's CPU seconds (all its threads);
    ``busy``: the whole machine's busy CPU seconds (to tell how much other processes used);
    ``faults``: page faults; ``switches``: voluntary context switches (sleeps in blocking calls).
    """

    def __init__(self) -> None:
        self.data: dict[str, list[float]] = {k: [] for k in ("starts", "ends", "cpu", "busy", "faults", "switches")}

    def start(self) -> None:
        self.data["starts"].append(time.perf_counter())

    def end(self) -> None:
        import resource

        self.data["ends"].append(time.perf_counter())
        self.data["cpu"].append(time.process_time())
        self.data["busy"].append(busy_seconds())
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.data["faults"].append(usage.ru_minflt + usage.ru_majflt)
        self.data["switches"].append(usage.ru_nvcsw)


def lightning_timer():
    """A Lightning callback holding a :class:`StepRecorder` of the training batches (as ``.rec``)."""
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.rec = StepRecorder()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.rec.start()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.rec.end()

    return StepTimer()


def bare_trainer(strategy: Any, devices: int, max_steps: int, callbacks: list[Any]):
    """A bare Lightning ``Trainer``: no logger, progress bar, checkpoints or validation."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def timed_trainer(strategy: Any, devices: int, max_steps: int):
    """:func:`bare_trainer` recording every training step; returns it and the timer callback
    (``timer.rec.data``)."""
    timer = lightning_timer()
    return bare_trainer(strategy, devices, max_steps, [timer]), timer


def write_record(rank: int, record: dict[str, Any]) -> None:
    """Hand this rank's record to :func:`launch` (through the directory it named)."""
    import torch

    record.setdefault("threads", torch.get_num_threads())
    record["rank"] = rank
    (Path(os.environ["BENCH_OUT"]) / f"rank{rank}.json").write_text(json.dumps(record))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(script: str | Path, args: Sequence[str], nprocs: int, *, timeout: float, what: str) -> list[dict[str, Any]]:
    """Run ``python script *args`` as ``nprocs`` fresh rank processes, one thread each; their records by rank."""
    with tempfile.TemporaryDirectory(prefix="dapple-bench-") as out:
        cmd = [sys.executable, str(Path(script).resolve()), *args]
        port = free_port()
        procs = []
        logs = []
        for rank in range(nprocs):
            env = dict(os.environ, BENCH_OUT=out, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
            if nprocs > 1:
                env.update(
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    WORLD_SIZE=str(nprocs),
                    LOCAL_WORLD_SIZE=str(nprocs),
                    NODE_RANK="0",
                )
            log = open(Path(out, f"log{rank}.txt"), "w+")  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            pass
        failed = False
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
                failed = True
            elif p.returncode != 0:
                failed = True
        records = []
        for rank in range(nprocs):
            path = Path(out, f"rank{rank}.json")
            if path.exists():
                records.append(json.loads(path.read_text()))
            else:
                failed = True
        tail = ""
        for rank, log in enumerate(logs):
            log.seek(0)
            tail += f"--- rank {rank} ---\n" + log.read()[-3000:]
            log.close()
        if failed:
            raise RuntimeError(f"{what} failed:\n{tail}")
        return sorted(records, key=lambda r: r["rank"])


def step_times(record: dict[str, Any], warmup: int) -> tuple[list[float], list[float]]:
    """Steps after warm-up: (period between ends of consecutive steps, time inside the step)."""
    starts, ends = record["starts"], record["ends"]
    first = max(warmup, 1)
    periods = [ends[i] - ends[i - 1] for i in range(first, len(ends))]
    inside = [ends[i] - starts[i] for i in range(first, len(ends))]
    return periods, inside


def counter_per_step(records: list[dict[str, Any]], key: str, warmup: int) -> float:
    """Increase of a per-step counter after warm-up, summed over ranks (median step of each rank).

    For ``"cpu"`` this counts work (compute, copies, framework code), not waiting: a rank blocked
    in a gloo receive sleeps (about 1% CPU measured). It is far less sensitive than wall time to
    other load on the machine.
    """
    first = max(warmup, 1)
    return sum(median([r[key][i] - r[key][i - 1] for i in range(first, len(r[key]))]) for r in records)


def other_load(records: list[dict[str, Any]], warmup: int) -> float:
    """Cores' worth of CPU that processes other than the benchmark's used during the timed steps."""
    first = max(warmup, 1) - 1
    r0 = records[0]
    wall = r0["ends"][-1] - r0["ends"][first]
    machine = r0["busy"][-1] - r0["busy"][first]
    ours = sum(r["cpu"][-1] - r["cpu"][first] for r in records)
    return max(machine - ours, 0.0) / wall if wall > 0 else float("nan")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")
