"""Look at the model once, in a child process: its layers, its fingerprint, optionally a profile.

The search needs a few facts about the model before its first trial: how many layers the
pipelined ``nn.Sequential`` has (the search space), a fingerprint (to refuse resuming a study
made for another model) and, to seed the study with the planner's picks, a per-layer profile.
Building the model means running the user's factory, which may import anything and allocate
anything, so it happens in a child process like the trials, under a time limit.

The profile: the Sequential's input is captured by running ``training_step`` on the first batch up
to the Sequential (``surgery.capture_input``), then each layer is run alone, forward and backward,
on ``global_batch // world_size`` rows (a replica's share of a one-stage plan), keeping medians:
the planner's ``profile_layers`` times them, and the result is the JSON of
:class:`dapple_lightning.planner.ModelProfile`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from dapple_lightning.trials._child import start_parent_watchdog
from dapple_lightning.trials._fingerprint import Fingerprint
from dapple_lightning.trials._launch import _tail, launch
from dapple_lightning.trials._trial import TrialConfig, _read

__all__ = ["ModelInfo", "probe_model"]


@dataclass(frozen=True)
class ModelInfo:
    """What the probe learned about the model."""

    fingerprint: Fingerprint
    profile: dict[str, Any] | None = None
    """A ``ModelProfile`` as a dict (see ``dapple_lightning.planner``), when asked for and measurable."""
    profile_error: str | None = None
    """Why there is no profile, when one was asked for."""

    @property
    def num_layers(self) -> int:
        return self.fingerprint.num_layers


def probe_model(config: TrialConfig, *, profile: bool = False) -> ModelInfo:
    """Build the model of ``config`` in a child process and describe it, within ``config.timeout_s``.

    Raises:
        RuntimeError: When the factory fails or the child exceeds the time limit (the message
            holds the child's last stderr lines).
    """
    with tempfile.TemporaryDirectory(prefix="dapple-probe-", dir=config.workdir) as tmp:
        out = Path(tmp)
        spec = {
            "model": config.model,
            "model_kwargs": dict(config.model_kwargs),
            "global_batch": config.global_batch,
            "world_size": config.world_size,
            "sequential": config.sequential,
            "accelerator": config.accelerator,
            "threads": config.threads,
            "seed": config.seed,
            "profile": profile,
            "out": str(out / "probe.json"),
        }
        spec_path = out / "spec.json"
        spec_path.write_text(json.dumps(spec))
        deadline = time.monotonic() + config.timeout_s
        handle = launch("probe", spec_path, launcher=config.launcher, python=config.python)
        try:
            while handle.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # polling the child with a deadline
        finally:
            timed_out = handle.poll() is None
            handle.close()
        stderr = _read(out / "supervisor.err")
        result_path = out / "probe.json"
        if handle.returncode != 0 or not result_path.exists():
            what = f"timed out after {config.timeout_s:g} s" if timed_out else f"failed (exit code {handle.returncode})"
            raise RuntimeError(f"building the model {config.model!r} in a child process {what}:\n{_tail(stderr)}")
        data = json.loads(result_path.read_text())
    return ModelInfo(
        fingerprint=Fingerprint.from_dict(data["fingerprint"]),
        profile=data.get("profile"),
        profile_error=data.get("profile_error"),
    )


# ================================================================================ child side


def _architecture(module: Any, seq: Any) -> str:
    desc = {
        "module": type(module).__qualname__,
        "layers": [f"{type(layer).__module__}.{type(layer).__qualname__}" for layer in seq],
        "params": [(n, list(p.shape), str(p.dtype)) for n, p in module.named_parameters()],
        "buffers": [(n, list(b.shape), str(b.dtype)) for n, b in module.named_buffers()],
    }
    return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]


def _device(accelerator: str) -> str:
    import torch

    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return f"cuda:{torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cuda"
    return accelerator if accelerator != "auto" else "cpu"


def _profile(seq: Any, first_input: Any, rows: int, device: str, reps: int = 3) -> dict[str, Any]:
    from dapple_lightning.microbatch import map_tensors
    from dapple_lightning.planner import profile_layers

    sample = map_tensors(first_input, lambda t: t[:rows])
    data = profile_layers(list(seq), sample, repeats=reps, warmup=1).to_dict()
    data["device"] = device
    return data


def main(spec_path: str) -> int:
    start_parent_watchdog()
    spec = json.loads(Path(spec_path).read_text())
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from lightning.pytorch import seed_everything

    from dapple_lightning.microbatch import batch_size_of
    from dapple_lightning.surgery import capture_input, find_sequential, set_submodule
    from dapple_lightning.trials._factory import call_factory

    torch.set_num_threads(int(spec["threads"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(spec["threads"]))
    seed_everything(int(spec["seed"]), verbose=False)
    module, loader = call_factory(spec["model"], int(spec["global_batch"]), dict(spec["model_kwargs"]))
    path, seq = find_sequential(module, spec["sequential"])
    device = _device(spec["accelerator"])
    fingerprint = Fingerprint(
        num_layers=len(seq),
        architecture=_architecture(module, seq),
        world_size=int(spec["world_size"]),
        device=device,
        global_batch=int(spec["global_batch"]),
    )
    result: dict[str, Any] = {"fingerprint": fingerprint.to_dict()}
    if spec["profile"]:
        try:
            batch = next(iter(loader))
            rows = max(1, min(batch_size_of(batch), int(spec["global_batch"]) // int(spec["world_size"])))
            module.train()
            put = partial(set_submodule, module, path)
            first = capture_input(module, put, seq, lambda: module.training_step(batch, 0))
            result["profile"] = _profile(seq, first, rows, device)
        except Exception as e:  # the profile is optional: say why there is none
            result["profile_error"] = f"{type(e).__name__}: {e}"
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
