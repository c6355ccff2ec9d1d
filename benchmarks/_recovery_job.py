"""The training job that ``benchmarks/recovery.py`` runs under torchrun (3 ranks, plan 2:1).

Usage: torchrun --standalone --nproc_per_node 3 --max-restarts 1 _recovery_job.py OUT MODE STEPS KILL_AT [ROUNDS]

With ``DAPPLE_BENCH_PLAN=replicas`` (``--nproc_per_node 2``), the plan is one stage of every layer on 2 ranks;
with ``stages``, 1:1 with the same cut (no stage has a replica: for the overhead alone).

MODE:
    overhead    ROUNDS rounds of two fits of STEPS steps each in the same processes, no failure:
                ``DappleStrategy(recovery=False)`` and ``recovery=True``, the order turned every round
    alternate   one fit of STEPS steps with ``recovery=True`` whose per-step work (the snapshot at the
                safe point, the vote) is switched on and off step by step, in pairs whose order
                turns every pair (on off, off on, on off, ...), so the steps compared are neighbours;
                with ``DAPPLE_BENCH_ON=log``, the log's copies too, and a checkpoint every SAVE_EVERY steps
    recover     ``recovery=True``; rank 1 (a stage-0 replica) SIGKILLs itself in its forward of
                step KILL_AT on the first attempt, and the restarted job recovers without a checkpoint
    checkpoint  ``recovery=False`` and a ``ModelCheckpoint`` every 5 steps; the same kill; the
                restarted attempt passes the newest checkpoint to ``fit`` as ``ckpt_path``

Every rank appends ``event seconds`` lines (``time.time()``) to ``OUT/events-<attempt>-<rank>``:
``spawned`` (the process's creation, from ``/proc``), ``imported`` (torch, Lightning, dapple),
``built`` (model and trainer), ``setup`` (a callback's ``setup``: after the process group's
rendezvous), ``restored`` (``on_fit_start``: after the strategy's setup, where recovery hands the
kept state across, and Lightning's restore), ``done`` and, on rank 0, ``step <label> <i>`` at the
end of every training step ``i``. The victim writes ``OUT/killed-at`` just before its SIGKILL; in
a restarted job's ``setup``, rank 0 records ``kept <rank>`` at the modification time of every state
file the survivors wrote; a checkpoint save records ``saving`` and ``saved``.

In ``overhead`` mode every rank also writes ``OUT/timing-<rank>.json``: per fit, the seconds of
each step's ``strategy.batch_to_device`` (where recovery takes its snapshot) and of the precision
plugin's ``_after_closure`` (where recovery votes), and the process's CPU seconds at the end of
each step, so the vote's and the snapshot's own costs can be told from the step time's noise.
"""

import time

STARTED = time.time()

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dapple_lightning import DappleStrategy  # noqa: E402

OUT, MODE, STEPS, KILL_AT = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ROUNDS = int(sys.argv[5]) if MODE == "overhead" else 1
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
RANK = int(os.environ["RANK"])
VICTIM = 1  # a replica of stage 0
WIDTH, LAYERS = 1024, 6  # Linear(1024, 1024) + Tanh, six times: 6.3M parameters
BATCH = int(os.environ.get("DAPPLE_BENCH_BATCH", 64))
CHECKPOINT_EVERY = 5
SAVE_EVERY = 50  # alternate mode with recovery="log": a checkpoint every this many steps (the log's retention)
CUT = 2 * LAYERS - 4  # stage 0: four Linear layers on two replicas; stage 1: two on one rank
PLAN = {
    "micro_batches": 2,
    "stages": [{"layers": [0, CUT], "replicas": 2}, {"layers": [CUT, 2 * LAYERS], "replicas": 1}],
}
if os.environ.get("DAPPLE_BENCH_PLAN") == "replicas":  # one stage of every layer on 2 ranks (no pipeline)
    PLAN = {"micro_batches": 2, "stages": [{"layers": [0, 2 * LAYERS], "replicas": 2}]}
if os.environ.get("DAPPLE_BENCH_PLAN") == "stages":  # 1:1, the same cut (no replica: overhead only)
    PLAN = {
        "micro_batches": 2,
        "stages": [{"layers": [0, CUT], "replicas": 1}, {"layers": [CUT, 2 * LAYERS], "replicas": 1}],
    }
RANKS = sum(stage["replicas"] for stage in PLAN["stages"])
step = 0  # the global step being trained
label = MODE  # the fit being run
timing: dict[str, dict[str, list[float]]] = {}


def event(name: str, at: float | None = None) -> None:
    with open(OUT / f"events-{ATTEMPT}-{RANK}", "a") as f:
        f.write(f"{name} {time.time() if at is None else at:.6f}\n")


def spawned() -> float:
    """The process's creation time: its start in clock ticks since boot (``/proc``), moved onto ``time.time()``
    through the boot-time clock (``btime`` in ``/proc/stat`` is whole seconds, too coarse here)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - since_boot + ticks / os.sysconf("SC_CLK_TCK")


event("spawned", spawned())
event("started", STARTED)
event("imported")


class Trap(nn.Module):
    """Identity; in the victim's forward of step KILL_AT on the first attempt, a SIGKILL."""

    def forward(self, x):
        if MODE != "overhead" and ATTEMPT == 0 and RANK == VICTIM and step == KILL_AT:
            (OUT / "killed-at").write_text(f"{time.time():.6f}")
            os.kill(os.getpid(), signal.SIGKILL)
        return x


class Wide(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
        layers[1] = nn.Sequential(nn.Tanh(), Trap())  # in stage 0, so the victim runs it
        self.layers = nn.Sequential(*layers)

    def training_step(self, batch, batch_idx):
        global step
        step = self.trainer.global_step
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def timed(fn: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return out

    return run


class Events(Callback):
    def setup(self, trainer, pl_module, stage):
        event("setup")
        if ATTEMPT > 0 and RANK == 0 and MODE == "recover":
            for kept in Path(os.environ["DAPPLE_RECOVERY_DIR"]).glob("dapple-recovery/*/rank*.pt"):
                event(f"kept {kept.stem[4:]}", kept.stat().st_mtime)

    def on_fit_start(self, trainer, pl_module):
        event("restored")

    def on_train_start(self, trainer, pl_module):
        if MODE == "overhead":  # after the strategy's setup, which put the vote in _after_closure
            mine = timing.setdefault(label, {"batch_to_device": [], "after_closure": [], "cpu": []})
            strategy, precision = trainer.strategy, trainer.strategy.precision_plugin
            strategy.batch_to_device = timed(strategy.batch_to_device, mine["batch_to_device"])
            precision._after_closure = timed(precision._after_closure, mine["after_closure"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if RANK == 0:
            event(f"step {label} {trainer.global_step - 1}")
        if MODE == "overhead":
            timing[label]["cpu"].append(time.process_time())


def alternate_on(step: int) -> bool:
    """Whether recovery's per-step work runs in ``step`` (``alternate`` mode): pairs on-off, off-on, ..."""
    return (step % 2 == 0) == ((step // 2) % 2 == 0)


class Alternate(Callback):
    """Switches recovery's per-step work for the next step, the same on every rank (by its number).
    At the end of a step every bit of its bookkeeping is done and the next safe point is ahead."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        recovery, on = trainer.strategy._recovery, alternate_on(trainer.global_step)
        recovery.active = on
        if recovery.logbook is not None:  # recovery="log": the copies of what is sent too
            trainer.strategy._pipeline.record_sends(recovery.logbook.record if on else None)


class TimedCheckpoint(ModelCheckpoint):
    def _save_checkpoint(self, trainer, filepath):
        event("saving")
        super()._save_checkpoint(trainer, filepath)
        event("saved")


def newest_checkpoint() -> str | None:
    saved = sorted((OUT / "ckpt").glob("step=*.ckpt"), key=lambda p: int(p.stem.split("=")[1]))
    return str(saved[-1]) if saved else None


def fit(recovery: bool, steps: int) -> None:
    """One ``fit`` of a fresh model and trainer."""
    callbacks: list[Callback] = [Events()]
    if MODE == "alternate":
        callbacks.append(Alternate())
    if MODE == "alternate" and ON == "log":  # the log keeps the steps since a checkpoint: save some
        callbacks.append(ModelCheckpoint(OUT / "ckpt", "{step}", every_n_train_steps=SAVE_EVERY, save_top_k=1))
    if MODE == "checkpoint":
        callbacks.append(TimedCheckpoint(OUT / "ckpt", "{step}", every_n_train_steps=CHECKPOINT_EVERY, save_top_k=-1))
    trainer = Trainer(
        accelerator="cpu",
        devices=RANKS,
        # The "on" arm: recovery=True, or with DAPPLE_BENCH_ON=log, recovery="log" (rank 2's stage has no
        # replica, so ranks 0 and 1 log what they send it, and rank 0 the batch).
        strategy=DappleStrategy(PLAN, recovery=(ON if recovery else False)),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=MODE == "checkpoint" or (MODE == "alternate" and ON == "log"),
        enable_model_summary=False,
        callbacks=callbacks,
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH * steps, WIDTH, generator=g), torch.randn(BATCH * steps, WIDTH, generator=g)
    model = Wide()
    event("built")
    resume = newest_checkpoint() if MODE == "checkpoint" and ATTEMPT > 0 else None
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(x, y), batch_size=BATCH), ckpt_path=resume)
    event("done")


ON = "log" if os.environ.get("DAPPLE_BENCH_ON") == "log" else True

if MODE == "overhead":
    for r in range(ROUNDS):
        for recovery in (False, True) if r % 2 == 0 else (True, False):
            label = f"{'on' if recovery else 'off'}-{r}"
            fit(recovery, STEPS)
    (OUT / f"timing-{RANK}.json").write_text(json.dumps(timing))
elif MODE == "alternate":
    fit(True, STEPS)
else:
    fit(MODE == "recover", STEPS)
