"""One measurement: train a candidate plan for a few steps in fresh processes, and say how it went.

The search process never runs a candidate itself. :func:`run_trial` starts the trial's leader in
a new session (its own process group, no terminal signals), which hands the ranks to PyTorch's
elastic agent (``_leader``, ``_worker``; how they start, ``fork`` from a template or ``exec``, is
``_launch``'s and ``_zygote``'s business). Whatever happens to the
trial, a crash, a hang, an out-of-memory kill, a plan that does not fit, ends that process group
and comes back as a :class:`TrialResult`; only the search process's own interruption
(``KeyboardInterrupt``, ``SystemExit``) propagates, after the trial's processes are killed.

Why not ``Trainer(strategy=DappleStrategy(start_method="spawn"))`` in one child: the spawning
parent imports torch and Lightning too, and Lightning's spawn launcher pickles the model and the
results back through queues, seconds per trial; the ranks here read the launcher's variables and
start nothing of their own. What each way of starting a trial costs is measured in
docs/benchmarks.md ("Search: trial launchers").

Measurements (rank 0 unless said otherwise):

- ``step_times``: wall time between the ends of consecutive optimizer steps (the first from its
  start); the first ``warmup`` are not timed;
- ``samples_per_s``: rows per step over the median timed step;
- ``peak_bytes``: per rank, parameters + gradients + optimizer state + the peak of activation bytes
  autograd kept alive in the last step (``DappleStrategy(track_memory=True)``);
- ``max_rss_bytes``: per rank, the process's peak resident memory (``getrusage``), which also
  counts the Python interpreter and libraries.

A trial on GPUs first leases ``world_size`` of the host's devices (``_devices``: exclusive among
every search worker of the host, waited for when too few are free, the wait not counted in
``timeout_s``); its processes see only those (``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import median
from typing import Any, Literal

from dapple_lightning.plan import Plan, whole
from dapple_lightning.trials._child import INFEASIBLE, parse_event
from dapple_lightning.trials._devices import host_devices, lease_devices
from dapple_lightning.trials._factory import check_factory_spec
from dapple_lightning.trials._launch import Handle, _tail, default_launcher, launch

__all__ = ["FailKind", "TrialConfig", "TrialResult", "classify_failure", "run_trial"]

_OOM_MARKERS = (
    "MemoryError",
    "out of memory",
    "can't allocate memory",
    "Cannot allocate memory",
    "std::bad_alloc",
)

FailKind = Literal["crash", "timeout", "oom"]
Status = Literal["complete", "failed", "infeasible", "pruned"]


@dataclass(frozen=True)
class TrialConfig:
    """How to measure a plan: the model, the ranks, the batch, the steps and the limits."""

    model: str
    """Model factory ``"module:function"``: called as ``function(batch_size=B, **model_kwargs)``, it
    returns ``(LightningModule, train DataLoader)`` (see :mod:`dapple_lightning.search.testing`)."""
    world_size: int
    """Ranks (processes) every plan runs on."""
    global_batch: int
    """Samples per optimizer step, passed to the factory as ``batch_size``."""
    warmup: int = 1
    """Steps run before timing starts (allocation, first-call overheads)."""
    steps: int = 3
    """Timed steps; the trial's step time is their median."""
    timeout_s: float = 300.0
    """Wall-clock limit of one trial, start-up included; past it the trial is killed ("timeout")."""
    stall_timeout_s: float | None = None
    """Optional: kill the trial ("timeout") when no step ended for this long since the last one. It
    starts counting at the end of the first step, whose one-time costs (connections, allocations)
    only ``timeout_s`` bounds."""
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of the factory (JSON values)."""
    sequential: str | None = None
    """``DappleStrategy(sequential=...)``: the Sequential to pipeline when the module has several."""
    accelerator: str = "cpu"
    """Lightning accelerator of the ranks."""
    threads_per_rank: int | None = None
    """Intra-op threads per rank; ``None``: the machine's cores divided by ``world_size`` (at least 1)."""
    track_memory: bool = True
    """Measure activation bytes (``DappleStrategy(track_memory=True)``), a hook call per saved tensor."""
    seed: int = 1234
    """``seed_everything`` in every rank before the factory is called."""
    pg_timeout_s: float = 60.0
    """``DappleStrategy(timeout=...)``: how long a rank waits on a dead peer."""
    workdir: str | None = None
    """Where trial directories are made; ``None``: the system's temporary directory."""
    keep_logs: bool = False
    """Keep each trial's directory (spec, per-rank logs and records) instead of deleting it."""
    python: str = sys.executable
    """Interpreter of the trial's processes."""
    launcher: Literal["fork", "exec"] | None = None
    """How trial processes start: ``fork`` them from a template process that imported torch and
    Lightning once (seconds faster per trial; Linux), or ``exec`` a fresh interpreter per rank
    (nothing shared at all). ``None``: ``fork`` on Linux, ``exec`` elsewhere. See ``_zygote``."""
    device_lease: bool | None = None
    """Lease ``world_size`` of the host's GPUs for the trial and show its processes only those
    (``CUDA_VISIBLE_DEVICES``), so that concurrent trials on one host never share one (``_devices``).
    ``None``: when the ranks run on GPUs (``accelerator`` ``cuda`` or ``gpu``, or ``auto`` on a host
    with GPUs); ``False``: never (devices are partitioned by someone else, e.g. a scheduler);
    ``True``: always, also on CPU, where the variable is set and nothing uses it (how the tests
    check leases without GPUs, naming fake ones in ``DAPPLE_HOST_GPUS``)."""

    def __post_init__(self) -> None:
        check_factory_spec(self.model)
        for name in ("world_size", "global_batch", "steps"):
            whole(getattr(self, name), name)
        whole(self.warmup, "warmup", 0)
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0 seconds or None, got {self.stall_timeout_s!r}")
        if self.threads_per_rank is not None:
            whole(self.threads_per_rank, "threads_per_rank (or None)")
        if not isinstance(self.model_kwargs, Mapping):
            raise TypeError(f"model_kwargs must be a mapping, got {type(self.model_kwargs).__name__}")
        try:
            json.dumps(dict(self.model_kwargs))
        except TypeError as e:
            raise TypeError(f"model_kwargs must hold JSON values (they cross a process boundary): {e}") from e
        object.__setattr__(self, "model_kwargs", dict(self.model_kwargs))
        if self.launcher is None:
            object.__setattr__(self, "launcher", default_launcher())
        if self.launcher not in ("fork", "exec"):
            raise ValueError(f"launcher must be 'fork', 'exec' or None, got {self.launcher!r}")
        if self.device_lease not in (None, True, False):
            raise TypeError(f"device_lease must be True, False or None, got {self.device_lease!r}")

    @property
    def threads(self) -> int:
        if self.threads_per_rank is not None:
            return self.threads_per_rank
        return max(1, (os.cpu_count() or 1) // self.world_size)

    @property
    def leases_devices(self) -> bool:
        """Whether a trial leases GPUs of the host first (see ``device_lease``)."""
        if self.device_lease is not None:
            return self.device_lease
        if self.accelerator in ("cuda", "gpu"):
            return True
        return self.accelerator == "auto" and bool(host_devices())


@dataclass(frozen=True)
class TrialResult:
    """How one trial ended, and what it measured if it trained."""

    status: Status
    """``complete`` (measured), ``failed`` (see ``fail_kind``), ``infeasible`` (the plan does not fit the
    model or its batches) or ``pruned`` (stopped because ``on_step`` asked to)."""
    reason: str | None = None
    """Why it did not complete: ``"timeout"``, ``"oom"``, the last lines of the failing rank's stderr,
    the infeasibility message, or the step at which it was pruned."""
    fail_kind: FailKind | None = None
    detail: str | None = None
    """More about a failure (the stderr tail behind an ``"oom"``, which limit a ``"timeout"`` hit)."""
    samples_per_s: float | None = None
    median_step_s: float | None = None
    step_times: tuple[float, ...] = ()
    """Every step's time on rank 0, warm-up included."""
    peak_bytes: tuple[int, ...] = ()
    """Per rank: parameters + gradients + optimizer state + peak live activation bytes."""
    activation_bytes: tuple[int, ...] = ()
    max_rss_bytes: tuple[int, ...] = ()
    wall_s: float = 0.0
    """Seconds the trial took, start-up included."""
    workdir: str | None = None
    """The trial's directory when kept (``TrialConfig.keep_logs``)."""
    pgid: int | None = None
    """The trial's process group (killed, and gone, when :func:`run_trial` returns)."""

    @property
    def peak_memory_bytes(self) -> int | None:
        """The largest ``peak_bytes`` of any rank (what has to fit on one device)."""
        return max(self.peak_bytes) if self.peak_bytes else None


def classify_failure(returncodes: list[int | None], killed: list[int], stderr: str) -> tuple[FailKind, str]:
    """Name a failed trial: ``("oom", detail)`` or ``("crash", stderr tail)``.

    A rank ended by SIGKILL that the launcher did not send was killed from outside, on Linux
    almost always by the kernel's OOM killer; an allocator error in the stderr is an
    out-of-memory too. Everything else is a crash.
    """
    tail = _tail(stderr)
    external_kill = [r for r, c in enumerate(returncodes) if c == -signal.SIGKILL and r not in killed]
    if any(marker in stderr for marker in _OOM_MARKERS):
        return "oom", tail
    if external_kill:
        ranks = ", ".join(map(str, external_kill))
        return "oom", f"rank(s) {ranks} killed by SIGKILL (the kernel's OOM killer?)" + (f"\n{tail}" if tail else "")
    return "crash", tail or f"ranks exited with codes {returncodes} and wrote no error"


def _spec(plan: Plan, config: TrialConfig, out: Path, visible: tuple[str, ...] | None) -> dict[str, Any]:
    return {
        "plan": plan.to_dict(),
        "model": config.model,
        "model_kwargs": dict(config.model_kwargs),
        "world_size": config.world_size,
        "global_batch": config.global_batch,
        "warmup": config.warmup,
        "steps": config.steps,
        "accelerator": config.accelerator,
        "sequential": config.sequential,
        "track_memory": config.track_memory,
        "threads": config.threads,
        "seed": config.seed,
        "pg_timeout_s": config.pg_timeout_s,
        "python": config.python,
        "out_dir": str(out),
        "visible_devices": None if visible is None else ",".join(visible),
    }


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _lease(plan: Plan, config: TrialConfig, on_wait: Callable[[str], None] | None) -> Any:
    """The context that holds the trial's devices (yielding their ids), or ``None`` on CPU."""
    if not config.leases_devices:
        return contextlib.nullcontext(None)
    note = f"(a trial of {plan.notation}, {config.model})"
    return lease_devices(config.world_size, note=note, on_wait=on_wait or _say)


def run_trial(
    plan: Plan | Mapping[str, Any] | str,
    config: TrialConfig,
    on_step: Callable[[int, float], bool] | None = None,
    on_start: Callable[[int], None] | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> TrialResult:
    """Train ``plan`` for ``config.warmup + config.steps`` steps in fresh processes; the result.

    Args:
        plan: the candidate plan (anything :meth:`Plan.coerce` takes).
        config: the model, ranks, steps and limits.
        on_step: called on every timed step with ``(step, samples_per_s of that step)``; returning
            ``True`` stops the trial (status ``pruned``).
        on_start: called with the trial's process group id once its processes started.
        on_wait: called with a message while a GPU trial waits for free devices of the host
            (``None``: printed to stderr).

    Only interruptions of the calling process propagate (``KeyboardInterrupt``, ``SystemExit``);
    the trial's processes are killed first.
    """
    plan = Plan.coerce(plan)
    if plan.world_size != config.world_size:
        return TrialResult(
            "infeasible",
            reason=f"the plan needs {plan.world_size} ranks (replicas {plan.notation}), the trial runs {config.world_size}",
        )
    out = Path(tempfile.mkdtemp(prefix="dapple-trial-", dir=config.workdir))
    try:
        with contextlib.ExitStack() as lease:
            try:
                visible = lease.enter_context(_lease(plan, config, on_wait))
            except ValueError as e:  # the host has too few GPUs
                return TrialResult("failed", reason=str(e), fail_kind="crash")
            return _launched(plan, config, out, visible, on_step, on_start)
    finally:
        # After the processes are gone (`_launched`), so none writes into it again; also on Ctrl-C.
        if not config.keep_logs:
            shutil.rmtree(out, ignore_errors=True)


def _launched(
    plan: Plan,
    config: TrialConfig,
    out: Path,
    visible: tuple[str, ...] | None,
    on_step: Callable[[int, float], bool] | None,
    on_start: Callable[[int], None] | None,
) -> TrialResult:
    """Start the trial's processes, follow them to their end, and read what they measured."""
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(_spec(plan, config, out, visible)))
    started = time.monotonic()
    handle = launch("trial", spec_path, launcher=config.launcher, python=config.python)
    try:
        if on_start is not None:
            on_start(handle.pgid)
        result = _watch(handle, config, on_step, started)
    finally:
        # Whatever ended the trial (success, limit, pruning, our own interruption), nothing of it
        # may outlive this call: ranks can linger after the leader (a stuck peer, a DataLoader
        # worker).
        handle.close()
    if result is None:
        code = handle.returncode
        result = _collect(code if code is not None else -signal.SIGKILL, config, out)
    workdir = str(out) if config.keep_logs else None
    return replace(result, wall_s=time.monotonic() - started, workdir=workdir, pgid=handle.pgid)


def _watch(
    handle: Handle,
    config: TrialConfig,
    on_step: Callable[[int, float], bool] | None,
    started: float,
) -> TrialResult | None:
    """Follow the trial's events until it exits (``None``) or must be stopped (the result)."""
    fd = handle.events_fd
    selector = selectors.DefaultSelector()
    if fd is not None:
        selector.register(fd, selectors.EVENT_READ)
    buffer = b""
    stepping = False  # a step has ended, so the stall limit applies
    last_progress = started
    try:
        while True:
            now = time.monotonic()
            stall = config.stall_timeout_s
            limit = None
            if now - started > config.timeout_s:
                limit = f"wall-clock limit of {config.timeout_s:g} s"
            elif stall is not None and stepping and now - last_progress > stall:
                limit = f"no step ended for {stall:g} s after the last"
            if limit is not None:
                return TrialResult("failed", reason="timeout", fail_kind="timeout", detail=limit)
            if handle.poll() is not None:
                return None
            if fd is None or not selector.select(timeout=0.1):
                if fd is None:
                    time.sleep(0.1)  # the channel closed; wait for the leader's exit
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            if not chunk:  # EOF: the leader and rank 0 are gone or going
                selector.unregister(fd)
                fd = None
                continue
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for raw in lines:
                event = parse_event(raw.decode(errors="replace"))
                if event is None:
                    continue
                last_progress = time.monotonic()
                if event.get("event") == "step":
                    stepping = True
                    step, seconds = int(event["step"]), float(event["seconds"])
                    if on_step is not None and step >= config.warmup and seconds > 0:
                        rows = int(event.get("rows") or config.global_batch)
                        if on_step(step, rows / seconds):
                            return TrialResult("pruned", reason=f"pruned at step {step}")
    finally:
        selector.close()


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _collect(returncode: int, config: TrialConfig, out: Path) -> TrialResult:
    """Read what the ranks wrote and name the outcome."""
    if returncode == INFEASIBLE:
        info = _read_json(out / "infeasible.json") or {}
        return TrialResult("infeasible", reason=str(info.get("reason", "the plan does not fit the model")))
    records = [_read_json(out / f"rank{r}.json") for r in range(config.world_size)]
    if returncode == 0 and all(isinstance(r, dict) for r in records):
        return _measured(records, config)
    sup = _read_json(out / "supervisor.json") or {}
    codes = sup.get("returncodes") or [None] * config.world_size
    killed = sup.get("killed_after_failure") or []
    first = sup.get("first_failure")
    order = ([first] if first is not None else []) + [r for r in range(config.world_size) if r != first]
    errors = [(rank, text) for rank in order if (text := _read(out / f"rank{rank}.err")).strip()]
    # A rank that lost its peer reports that, not the cause: prefer a rank with an error of its own.
    primary = [(r, t) for r, t in errors if not _secondary(t)]
    if not primary:
        codes, killed = _vanished_as_killed(codes, killed, sup.get("vanished") or [])
    primary = primary or errors
    stderr = primary[0][1] if primary else _read(out / "supervisor.err")
    if returncode < 0 and not sup:
        # The leader itself was killed from outside.
        codes = [returncode]
    kind, tail = classify_failure(codes, killed, stderr)
    if kind == "oom":
        return TrialResult("failed", reason="oom", fail_kind="oom", detail=tail)
    return TrialResult("failed", reason=tail, fail_kind="crash", detail=f"exit codes {codes}")


_SECONDARY = ("lost a peer", "Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _vanished_as_killed(codes: list, killed: list[int], vanished: list[int]) -> tuple[list, list[int]]:
    """When no rank has an error of its own, the ranks that vanished (no Python ran at their end)
    and that no recorded exit code explains were killed from outside, not by the agent: the agent
    records only the first rank it sees fail, which may be a peer that lost them."""
    if any(isinstance(c, int) and c < 0 for c in codes):
        return codes, killed  # a signal death is on record already
    codes = [-signal.SIGKILL if r in vanished and c is None else c for r, c in enumerate(codes)]
    return codes, [r for r in killed if r not in vanished]


def _secondary(stderr: str) -> bool:
    """Whether a rank's error is only the echo of another rank's failure."""
    return any(marker in line for line in _tail(stderr, 3).splitlines() for marker in _SECONDARY)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _measured(records: list[dict[str, Any]], config: TrialConfig) -> TrialResult:
    times = [float(t) for t in records[0]["step_times"]]
    rows = [int(r) for r in records[0]["rows"]]
    timed, timed_rows = times[config.warmup :], rows[config.warmup :]
    if not timed:
        return TrialResult(
            "failed",
            reason=f"the loader ended after {len(times)} steps, before any timed step; give it more batches",
            fail_kind="crash",
        )
    step = median(timed)
    samples = median(timed_rows) / step if step > 0 else float("inf")
    activations = tuple(int(r["peak_live_bytes"]) for r in records)
    return TrialResult(
        "complete",
        samples_per_s=samples,
        median_step_s=step,
        step_times=tuple(times),
        peak_bytes=tuple(int(r["state_bytes"]) + a for r, a in zip(records, activations)),
        activation_bytes=activations,
        max_rss_bytes=tuple(int(r["max_rss_bytes"]) for r in records),
    )
