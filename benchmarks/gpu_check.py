"""The one-GPU check: what a single GPU can show about dapple's CUDA/NCCL path, in one short run.

Writes a JSON (every section with ``status``: pass, fail or skipped, its ``reasons`` and its
numbers) and the same as a markdown table, and prints the table. Sections, in order:

    versions              torch, Lightning, CUDA, NCCL, the device's name
    free_memory           torch.cuda.mem_get_info before anything runs
    one_stage_m4          one NCCL rank, a 1-stage plan with M = 4, against one device (losses)
    bf16_mixed            the same under precision="bf16-mixed", against one device in bf16-mixed
    recompute_dropout     a recomputed stage with dropout against the same plan without recompute
    auto_plan             plan="auto" on one rank against one device (losses)
    auto_peak_memory      auto's predicted peak memory against torch.cuda.max_memory_allocated
    trace_fill            the compute spans of the M = 4 run's trace cover the step
    host_sync             torch.cuda.set_sync_debug_mode: no host sync inside the schedule but
                          the one read per step
    zero_bubble_gradients one stage's zero-bubble B then W, on recorded inputs and output
                          gradients, against plain autograd
    zero_bubble_transient W's transient memory against the planner's figure for it
    gloo_two_ranks        two ranks on cuda:0 under gloo, a data-parallel plan with sync batch
                          norm and clipping, against one device (losses and buffers)
    refusals              two NCCL ranks on one GPU, a 2-stage gloo plan on CUDA, offload on CUDA:
                          each refused at setup with its own message
    event_timing          CUDA-event timing against synchronize + wall clock, within 10%
    batch_bytes           the bytes of the batch each stage copies to its device per step: only
                          the tensors its step reads (a third tensor no step reads never moves)

    python benchmarks/gpu_check.py                       # one GPU, NCCL (under 5 minutes)
    python benchmarks/gpu_check.py --dry                 # CPU processes and gloo, no CUDA call

``--dry`` runs every section's code on the CPU except the CUDA calls; the sections that need
CUDA report ``skipped: needs CUDA``, never pass. ``tests/test_gpu_check.py`` runs it, so the
check cannot rot while no GPU is there. ``--out PATH`` names the JSON (the table goes next to
it, ``.md``); by default ``gpu_check.json`` in the working directory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import lightning  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from dapple_lightning import DappleStrategy, Plan  # noqa: E402

NEEDS_CUDA = "skipped: needs CUDA"
SIZES = {"dry": (32, 3, 16), "cuda": (4096, 8, 1024)}
"""Width, blocks and batch rows: wide enough on a GPU that kernels, not launches, fill the step."""
STEPS = {"dry": 3, "cuda": 6}
TOLERANCE = {"dry": 1e-5, "cuda": 1e-4}
"""Relative tolerance on fp32 losses: GPU kernels sum in an order that depends on the rows' split."""
BF16_TOLERANCE = 2e-2
FILL = 0.9
"""The share of the step the compute spans of a one-stage plan must cover."""
TIMING_AGREEMENT = 0.10
TRANSIENT_SLACK = 1.25
"""How far W's measured transient may exceed the planner's figure: the allocator's rounding."""


class Blocks(LightningModule):
    """Linear blocks (optionally with batch norm and dropout) trained with SGD on an MSE loss."""

    def __init__(self, width: int, blocks: int, *, norm: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(blocks):
            layers.append(nn.Linear(width, width))
            if norm:
                layers.append(nn.BatchNorm1d(width))
            layers.append(nn.Tanh())
            if dropout:
                layers.append(nn.Dropout(dropout))
        self.layers = nn.Sequential(*layers)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layers(x).float(), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(width: int, rows: int, steps: int) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(rows * steps, width, generator=g), torch.randn(rows * steps, width, generator=g))
    return DataLoader(data, batch_size=rows, shuffle=False)


class Peaks(Callback):
    """Each rank writes its training peak (``-1`` off CUDA) and its buffers; rank 0 auto's choice."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, pl_module) -> None:
        if trainer.strategy.root_device.type == "cuda":  # training's peak, not auto's profiling and trials
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_end(self, trainer, pl_module) -> None:
        device, rank = trainer.strategy.root_device, trainer.global_rank
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
        (self.out / f"peak{rank}.txt").write_text(str(peak))
        torch.save({k: v.detach().cpu() for k, v in pl_module.named_buffers()}, self.out / f"buffers{rank}.pt")
        chosen = getattr(trainer.strategy, "auto_plan", None)
        if rank == 0 and chosen is not None:
            torch.save(chosen, self.out / "auto.pt")


class Check:
    """What the sections share: the mode, sizes and a scratch folder."""

    def __init__(self, dry: bool, tmp: Path) -> None:
        self.dry, self.tmp = dry, tmp
        self.kind = "dry" if dry else "cuda"
        self.width, self.blocks, self.rows = SIZES[self.kind]
        self.steps = STEPS[self.kind]
        self.accelerator = "cpu" if dry else "gpu"
        self.device = torch.device("cpu") if dry else torch.device("cuda", 0)
        self._runs: dict[str, dict] = {}

    def fit(
        self,
        name: str,
        plan: Plan | str | None,
        *,
        model: Callable[[], LightningModule] | None = None,
        width: int | None = None,
        devices: int = 1,
        trace: str | None = None,
        strategy_kwargs: dict | None = None,
        callbacks: tuple | list = (),
        data: Callable[[], DataLoader] | None = None,
        **trainer_kwargs: Any,
    ) -> dict:
        """Train under dapple with ``plan`` (``None``: Lightning on one device); what the ranks left."""
        if name in self._runs:
            return self._runs[name]
        width = width or self.width
        out = self.tmp / name
        out.mkdir(parents=True)
        placement: dict[str, Any] = {"devices": devices}
        if plan is not None:
            kwargs = {"start_method": "forkserver", "trace": trace, **(strategy_kwargs or {})}
            placement = {"strategy": DappleStrategy(plan, **kwargs)}
            if "parallel_devices" not in kwargs:
                placement["devices"] = devices
        trainer = Trainer(
            accelerator=self.accelerator,
            max_steps=self.steps,
            logger=CSVLogger(out, name="run", version=0),
            log_every_n_steps=1,
            enable_progress_bar=False,
            enable_checkpointing=False,
            enable_model_summary=False,
            callbacks=[Peaks(out), *callbacks],
            **placement,
            **trainer_kwargs,
        )
        module = model() if model is not None else Blocks(width, self.blocks)
        trainer.fit(module, data() if data is not None else loader(width, self.rows, self.steps))
        lines = (out / "run" / "version_0" / "metrics.csv").read_text().splitlines()
        column = lines[0].split(",").index("train_loss")
        losses = [float(row.split(",")[column]) for row in lines[1:] if row.split(",")[column]]
        ranks = len(list(out.glob("peak*.txt")))
        run = {
            "losses": losses,
            "peaks": [int((out / f"peak{r}.txt").read_text()) for r in range(ranks)],
            "buffers": [torch.load(out / f"buffers{r}.pt") for r in range(ranks)],
            "auto": torch.load(out / "auto.pt", weights_only=False) if (out / "auto.pt").exists() else None,
        }
        self._runs[name] = run
        return run


def _result(status: str, *reasons: str, **numbers: Any) -> dict:
    return {"status": status, "reasons": list(reasons), **numbers}


def _size(count: float) -> str:
    return f"{count / 2**20:.1f} MiB" if count >= 2**20 else f"{count / 2**10:.1f} KiB"


def _compare(got: list[float], want: list[float], rtol: float, what: str) -> dict:
    worst = max((abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want)), default=float("inf"))
    ok = len(got) == len(want) > 0 and worst <= rtol
    reason = f"{what}: {len(got)} losses against {len(want)}, worst relative difference {worst:.1e} (limit {rtol:.0e})"
    return _result("pass" if ok else "fail", reason, worst_relative_difference=worst)


# ----------------------------------------------------------------------------------------- sections


def versions(check: Check) -> dict:
    numbers = {"torch": torch.__version__, "lightning": lightning.__version__, "python": sys.version.split()[0]}
    if check.dry:
        return _result("pass", "versions read; no CUDA in the dry mode", **numbers)
    numbers.update(
        cuda=torch.version.cuda,
        nccl=".".join(map(str, nccl)) if isinstance(nccl := torch.cuda.nccl.version(), tuple) else str(nccl),
        device=torch.cuda.get_device_name(0),
        device_count=torch.cuda.device_count(),
    )
    return _result("pass", f"{numbers['device']}, CUDA {numbers['cuda']}, NCCL {numbers['nccl']}", **numbers)


def free_memory(check: Check) -> dict:
    if check.dry:
        return _result("skipped", NEEDS_CUDA)
    free, total = torch.cuda.mem_get_info(0)
    return _result(
        "pass" if free > 0 else "fail",
        f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB before the check",
        free_bytes=free,
        total_bytes=total,
    )


def _layers(check: Check) -> int:
    return 2 * check.blocks


def one_stage_m4(check: Check) -> dict:
    reference = check.fit("single", None)
    plan = Plan.data_parallel(_layers(check), 1, micro_batches=4)
    got = check.fit("m4", plan, trace=str(check.tmp / "m4-trace.json"))
    return _compare(got["losses"], reference["losses"], TOLERANCE[check.kind], "1 rank, 1 stage, M=4 vs one device")


def bf16_mixed(check: Check) -> dict:
    reference = check.fit("single-bf16", None, precision="bf16-mixed")
    plan = Plan.data_parallel(_layers(check), 1, micro_batches=4)
    got = check.fit("m4-bf16", plan, precision="bf16-mixed")
    return _compare(got["losses"], reference["losses"], BF16_TOLERANCE, "bf16-mixed, M=4 vs one device in bf16-mixed")


def recompute_dropout(check: Check) -> dict:
    def dropped() -> LightningModule:
        return Blocks(check.width, check.blocks, dropout=0.1)

    layers = 3 * check.blocks
    stages = {"micro_batches": 4, "stages": [{"layers": [0, layers]}]}
    kept = check.fit("dropout", Plan.coerce(stages), model=dropped)
    recomputed = Plan.coerce({**stages, "stages": [{"layers": [0, layers], "recompute": True}]})
    got = check.fit("dropout-recompute", recomputed, model=dropped)
    return _compare(
        got["losses"], kept["losses"], TOLERANCE[check.kind], "recompute with dropout vs the same plan kept"
    )


def auto_plan(check: Check) -> dict:
    reference = check.fit("single", None)
    got = check.fit("auto", "auto")
    result = _compare(got["losses"], reference["losses"], TOLERANCE[check.kind], "plan='auto' vs one device")
    chosen = got["auto"]
    if chosen is not None:
        result["reasons"].append(f"chose {chosen.plan.describe()}, profiled on {chosen.profile.device}")
    return result


def auto_peak_memory(check: Check) -> dict:
    from dapple_lightning.planner import estimate

    run = check.fit("auto", "auto")
    chosen = run["auto"]
    predicted = estimate(chosen.plan, chosen.profile, chosen.cluster, check.rows, optimizer_factor=1.0).memory_bytes
    numbers = {"predicted_bytes": list(predicted), "chosen": chosen.plan.describe()}
    if check.dry:
        return _result("skipped", f"{NEEDS_CUDA} (no allocator counter on the CPU)", **numbers)
    reasons, ok = [], True
    for stage, bytes_ in enumerate(predicted):
        measured = max(run["peaks"][r] for r in chosen.plan.stage_ranks(stage))
        ratio = measured / bytes_
        ok &= 0.5 <= ratio <= 1.5
        reasons.append(f"stage {stage}: predicted {bytes_ / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB")
    numbers["measured_bytes"] = run["peaks"]
    reasons.append("pass: measured within 0.5x-1.5x of predicted")
    return _result("pass" if ok else "fail", *reasons, **numbers)


def trace_fill(check: Check) -> dict:
    from benchmarks.runtime import load_trace
    from dapple_lightning.runtime import bubble_fractions

    one_stage_m4(check)  # its run wrote the trace
    events = [e for e in load_trace(check.tmp / "m4-trace.json") if e.step >= 1]
    if not events:
        return _result("fail", "the trace holds no compute spans after the first step")
    fill = 1.0 - bubble_fractions(events)[0]
    if check.dry:  # the question is the GPU's: do its kernels, timed by CUDA events, fill the step
        return _result("skipped", f"{NEEDS_CUDA} (the trace ran; CPU wall clock spans cover {fill:.1%})", fill=fill)
    return _result(
        "pass" if fill >= FILL else "fail",
        f"compute spans (CUDA events) cover {fill:.1%} of the step (limit {FILL:.0%})",
        fill=fill,
    )


class SyncCounter(Callback):
    """Counts the synchronizing CUDA calls (``torch.cuda.set_sync_debug_mode("warn")``) from a batch's
    start to the end of its backward: the schedule's forwards, backwards and sends, not the optimizer."""

    def __init__(self, out: Path) -> None:
        self.out, self.counts, self._caught = out, [], None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._caught = warnings.catch_warnings(record=True)
        self._seen = self._caught.__enter__()
        warnings.simplefilter("always")
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        if self._caught is not None:
            self._caught.__exit__(None, None, None)
            self.counts.append(sum("synchroniz" in str(w.message) for w in self._seen))
            self._caught = None

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            self.out.write_text(json.dumps(self.counts))


def host_sync(check: Check) -> dict:
    # A run of its own: the trace's CUDA events are read once per step too, which is not the schedule's.
    out = check.tmp / "syncs.json"
    check.fit("syncs", Plan.data_parallel(_layers(check), 1, micro_batches=4), callbacks=[SyncCounter(out)])
    counts = json.loads(out.read_text())
    if len(counts) != check.steps:
        return _result("fail", f"the counter saw {len(counts)} of {check.steps} steps' schedules")
    if check.dry:
        return _result("skipped", f"{NEEDS_CUDA} (the steps ran on the CPU; sync debug mode is CUDA's)")
    ok = all(c <= 1 for c in counts[1:])
    return _result(
        "pass" if ok else "fail",
        f"synchronizing CUDA calls from each batch's start to its optimizer step: {counts}; at most 1 (the "
        "step's one read of the loss and logged values) allowed after the first step",
        syncs_per_step=counts,
    )


def _zero_bubble_stage(check: Check):
    """A stage of Linear+Tanh blocks, M micro-batches of recorded inputs and output gradients."""
    width, rows, m = check.width, check.rows // 4, 4
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(rows, width, generator=g).to(check.device) for _ in range(m)]
    grads = [torch.randn(rows, width, generator=g).to(check.device) for _ in range(m)]
    torch.manual_seed(0)
    stage = nn.Sequential(*(mod for _ in range(check.blocks) for mod in (nn.Linear(width, width), nn.Tanh())))
    return stage.to(check.device), inputs, grads


def _split(check: Check):
    """B for every micro-batch, then each W; the gradients, and W's largest transient in bytes."""
    from dapple_lightning.runtime import (
        LinearStore,
        StoredGrads,
        WeightWork,
        backward_stored,
        backward_weight,
        storable_linears,
    )

    stage, inputs, grads = _zero_bubble_stage(check)
    layers = LinearStore(storable_linears(stage))
    stores, input_grads = [], []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_()
        store = StoredGrads()
        with layers.storing(store):
            out = stage(x)
        with layers.storing(store):
            input_grads.append(backward_stored([out], [g], [x], list(stage.parameters()), store)[0])
        stores.append(store)
    for p in stage.parameters():  # W adds into .grad, as on every step after the first
        p.grad = torch.zeros_like(p)
    transient = 0
    for store in stores:
        with _peak_above_now(check) as peak:
            backward_weight(WeightWork([]), store.take())
        transient = max(transient, peak())
    return {n: p.grad for n, p in stage.named_parameters()}, input_grads, transient, stage


@contextmanager
def _peak_above_now(check: Check) -> Iterator[Callable[[], int]]:
    """The most bytes allocated inside the block beyond what was allocated on entry: CUDA's
    allocator counters, or on the CPU the planner's live-bytes tracker (the tensors ops return)."""
    if check.dry:
        from dapple_lightning.planner import live_bytes

        with live_bytes() as tracked:
            yield lambda: tracked.peak
        return
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    yield lambda: torch.cuda.max_memory_allocated() - before
    torch.cuda.synchronize()


def _plain(check: Check):
    stage, inputs, grads = _zero_bubble_stage(check)
    input_grads = []
    for x, g in zip(inputs, grads):
        x = x.clone().requires_grad_()
        torch.autograd.backward([stage(x)], [g])
        input_grads.append(x.grad)
    return {n: p.grad for n, p in stage.named_parameters()}, input_grads


def zero_bubble_gradients(check: Check) -> dict:
    want, want_inputs = _plain(check)
    got, got_inputs, _, _ = _split(check)
    worst = max(float((got[n] - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12)) for n in want)
    worst = max(worst, *(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got_inputs, want_inputs)))
    limit = TOLERANCE[check.kind]
    return _result(
        "pass" if worst <= limit else "fail",
        f"B then W on {len(want_inputs)} recorded micro-batches vs plain autograd: worst relative difference "
        f"{worst:.1e} (limit {limit:.0e}) over {len(want)} weight and {len(got_inputs)} input gradients",
        worst_relative_difference=worst,
    )


def zero_bubble_transient(check: Check) -> dict:
    _, _, transient, stage = _split(check)
    layers = [m for m in stage if any(True for _ in m.parameters())]
    layer_bytes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in layers]
    # The planner's figure for W's transient: its largest layer's parameter bytes (planner/_zero_bubble.py)
    priced = max(layer_bytes)
    counter = "the planner's live-bytes tracker (dry mode)" if check.dry else "CUDA's allocator counters"
    return _result(
        "pass" if transient <= TRANSIENT_SLACK * priced else "fail",
        f"W's transient {_size(transient)} ({counter}) against the planner's {_size(priced)} (the largest "
        f"layer's parameters; limit {TRANSIENT_SLACK}x); the stage's parameters {_size(sum(layer_bytes))}",
        transient_bytes=transient,
        priced_bytes=priced,
        stage_bytes=sum(layer_bytes),
    )


def gloo_two_ranks(check: Check) -> dict:
    width = 64 if check.dry else 1024

    def normed() -> LightningModule:
        return Blocks(width, check.blocks, norm=True)

    layers = 3 * check.blocks
    reference = check.fit("single-norm", None, model=normed, width=width, gradient_clip_val=0.5)
    devices = [check.device, check.device]
    plan = Plan.data_parallel(layers, 2, micro_batches=1)
    got = check.fit(
        "gloo-two",
        plan,
        model=normed,
        width=width,
        strategy_kwargs={"parallel_devices": devices, "process_group_backend": "gloo"},
        gradient_clip_val=0.5,
        sync_batchnorm=True,
    )
    where = "two CPU processes" if check.dry else "two ranks on cuda:0"
    result = _compare(got["losses"], reference["losses"], TOLERANCE[check.kind], f"{where}, gloo, data parallel")
    worst = max(
        float((mine[k].double() - reference["buffers"][0][k].double()).abs().max())
        for mine in got["buffers"]
        for k in mine
    )
    ok = worst <= 1e-4
    result["reasons"].append(f"buffers (running statistics) on both ranks vs one device: worst difference {worst:.1e}")
    if not ok:
        result["status"] = "fail"
    return result


def refusals(check: Check) -> dict:
    from dapple_lightning.strategy import check_before_start

    cuda = torch.device("cuda", 0)  # a device object only, in the dry mode
    layers = 2 * check.blocks
    module = Blocks(check.width, check.blocks)

    def setup(plan: Plan, backend: str, node_devices: tuple = ()) -> Callable[[], Any]:
        return lambda: check_before_start(
            module, "32-true", None, plan, 2, backend=backend, device=cuda, node_devices=node_devices
        )

    offloaded = {"micro_batches": 2, "stages": [{"layers": [0, 2], "offload": 1}, {"layers": [2, layers]}]}
    cases = [
        ("two NCCL ranks on one GPU", "Duplicate GPU", setup(Plan.data_parallel(layers, 2), "nccl", (cuda, cuda))),
        (
            "2-stage plan under gloo on CUDA",
            "gloo has no send or receive for CUDA tensors",
            setup(Plan.straight(layers, 2, micro_batches=2), "gloo"),
        ),
        ("offload on CUDA", "has no pinned-memory tier for GPUs", setup(Plan.coerce(offloaded), "nccl")),
    ]
    if not check.dry:  # the first through Lightning on the real GPU too: refused before NCCL sees it
        cases.append(("two NCCL ranks on cuda:0 through Trainer.fit", "Duplicate GPU", lambda: _two_nccl_ranks(check)))
    reasons, ok = [], True
    for name, expected, attempt in cases:
        try:
            attempt()
            reasons.append(f"{name}: NOT refused")
            ok = False
        except Exception as error:  # the refusal is the expected outcome
            good = expected in str(error)
            ok &= good
            reasons.append(f"{name}: {'refused' if good else 'failed otherwise'}: {str(error)[:160]}")
    return _result("pass" if ok else "fail", *reasons)


def _two_nccl_ranks(check: Check) -> None:
    plan = Plan.data_parallel(2 * check.blocks, 2)
    devices = [check.device, check.device]
    check.fit("nccl-two", plan, strategy_kwargs={"parallel_devices": devices, "process_group_backend": "nccl"})


def event_timing(check: Check) -> dict:
    if check.dry:
        return _result("skipped", NEEDS_CUDA)
    from dapple_lightning.planner import Stopwatch

    a = torch.randn(4096, 4096, device=check.device)
    events, wall = Stopwatch(check.device), Stopwatch(check.device)
    wall.clock = None  # synchronize + host clock per span
    for _ in range(2):  # warm-up: kernels loaded, clocks up
        a @ a
    for _ in range(10):
        with events.span():
            for _ in range(20):
                a = torch.tanh(a @ a)
        with wall.span():
            for _ in range(20):
                a = torch.tanh(a @ a)
    torch.cuda.synchronize(check.device)
    by_events, by_wall = sum(events.seconds()), sum(wall.seconds())
    gap = abs(by_events - by_wall) / by_wall
    return _result(
        "pass" if gap <= TIMING_AGREEMENT else "fail",
        f"CUDA events {by_events * 1e3:.1f} ms, synchronize + wall clock {by_wall * 1e3:.1f} ms: {gap:.1%} apart "
        f"(limit {TIMING_AGREEMENT:.0%})",
        events_s=by_events,
        wall_s=by_wall,
    )


class Unread(Blocks):
    """Blocks whose batch holds a third tensor that the step never reads."""

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return super().training_step((x, y), batch_idx)


class MovedBytes(Callback):
    """Each rank writes the bytes of the batch its step copied to its device, per step."""

    def __init__(self, out: Path) -> None:
        self.out, self.moved = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.moved.append(trainer.strategy.step_stats.batch_bytes_moved)

    def on_train_end(self, trainer, pl_module) -> None:
        (self.out / f"moved{trainer.global_rank}.json").write_text(json.dumps(self.moved))


def batch_bytes(check: Check) -> dict:
    width, rows = check.width, check.rows

    def three_fields() -> DataLoader:
        g = torch.Generator().manual_seed(1)
        x, y, unread = (torch.randn(rows * check.steps, width, generator=g) for _ in range(3))
        return DataLoader(TensorDataset(x, y, unread), batch_size=rows, shuffle=False)

    def model() -> LightningModule:
        return Unread(width, check.blocks)

    reference = check.fit("single-unread", None, model=model, data=three_fields)
    # One GPU holds one NCCL rank, so one stage there; three stages on CPU processes in the dry mode.
    stages = 3 if check.dry else 1
    if stages > 1:
        plan = Plan.straight(_layers(check), stages, micro_batches=4)
    else:
        plan = Plan.data_parallel(_layers(check), 1, micro_batches=4)
    out = check.tmp / "moved"
    out.mkdir()
    # In the dry mode the moves run on the CPU as on CUDA (nothing is copied there; the bytes are counted).
    lazy = {"lazy_batch": True} if check.dry else None
    got = check.fit(
        "unread",
        plan,
        model=model,
        data=three_fields,
        callbacks=[MovedBytes(out)],
        devices=stages,
        strategy_kwargs=lazy,
    )
    what = f"{stages} stages, M=4 vs one device" if stages > 1 else "1 stage, M=4 vs one device"
    result = _compare(got["losses"], reference["losses"], TOLERANCE[check.kind], what)
    tensor = rows * width * 4
    expected = [tensor, 0, tensor] if stages == 3 else [2 * tensor]  # x on the first, y on the last
    moved = [json.loads((out / f"moved{r}.json").read_text()) for r in range(stages)]
    for stage, (per_step, want) in enumerate(zip(moved, expected)):
        ok = len(per_step) == check.steps and all(b == want for b in per_step)
        result["reasons"].append(
            f"stage {stage}: {_size(per_step[0]) if per_step else '-'} moved per step "
            f"({'as' if ok else 'NOT as'} expected: {_size(want)}; the batch is {_size(3 * tensor)})"
        )
        if not ok:
            result["status"] = "fail"
    if check.dry:
        result["reasons"].append("dry: lazy_batch=True on CPU processes, where the bytes are counted, not copied")
    result["moved_bytes_per_stage"] = moved
    return result


SECTIONS: dict[str, Callable[[Check], dict]] = {
    "versions": versions,
    "free_memory": free_memory,
    "one_stage_m4": one_stage_m4,
    "bf16_mixed": bf16_mixed,
    "recompute_dropout": recompute_dropout,
    "auto_plan": auto_plan,
    "auto_peak_memory": auto_peak_memory,
    "trace_fill": trace_fill,
    "host_sync": host_sync,
    "zero_bubble_gradients": zero_bubble_gradients,
    "zero_bubble_transient": zero_bubble_transient,
    "gloo_two_ranks": gloo_two_ranks,
    "refusals": refusals,
    "event_timing": event_timing,
    "batch_bytes": batch_bytes,
}


def table(report: dict) -> str:
    lines = [
        f"GPU check ({report['mode']}), {report['seconds']:.0f} s: `{report['command']}`",
        "",
        "| section | status | reasons |",
        "|---|---|---|",
    ]
    for name, section in report["sections"].items():
        reasons = "; ".join(section["reasons"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {section['status']} | {reasons} |")
    return "\n".join(lines) + "\n"


def run(dry: bool, only: list[str] | None = None) -> dict:
    started = time.perf_counter()
    sections: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dapple-gpu-check-") as tmp:
        check = Check(dry, Path(tmp))
        for name, section in SECTIONS.items():
            if only and name not in only:
                continue
            try:
                sections[name] = section(check)
            except Exception as error:  # a section's failure is reported, the others still run
                last = traceback.format_exception_only(type(error), error)[-1].strip()
                sections[name] = _result("fail", f"raised {last[:400]}")
    mode = "dry: CPU processes, gloo, no CUDA call" if dry else "one GPU, NCCL"
    command = "python benchmarks/gpu_check.py" + (" --dry" if dry else "")
    return {"mode": mode, "command": command, "seconds": time.perf_counter() - started, "sections": sections}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="run on CPU processes under gloo, skipping CUDA calls")
    parser.add_argument("--out", default="gpu_check.json", help="the JSON report; the table goes next to it (.md)")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="run these sections only")
    args = parser.parse_args()
    if not args.dry and not torch.cuda.is_available():
        parser.error("no CUDA device here; --dry runs the same sections on CPU processes, skipping CUDA's")
    report = run(args.dry, args.only)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    out.with_suffix(".md").write_text(table(report))
    print(table(report))
    print(f"written: {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
