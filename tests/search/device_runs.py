"""Processes of tests/search/test_devices.py: a lease holder and a trial runner, each its own process.

``python device_runs.py hold COUNT IDS_FILE RELEASE_FILE``: lease COUNT devices, write their ids to
IDS_FILE, hold them until RELEASE_FILE exists.

``python device_runs.py trial DEVICES_FILE HOLD_FILE RESULT_FILE``: run one trial of the test MLP on
2 ranks (on CPU) with a device lease; the model writes the ``CUDA_VISIBLE_DEVICES`` it sees to
DEVICES_FILE and holds its first step until HOLD_FILE exists (``-``: no hold); the result's status
and reason go to RESULT_FILE.

Both read the host's devices from ``DAPPLE_HOST_GPUS`` and the lock directory from
``DAPPLE_DEVICE_LOCK_DIR``, which the test sets.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def hold(count: int, ids_file: Path, release: Path) -> None:
    from dapple_lightning.trials._devices import lease_devices

    with lease_devices(count, note="(device_runs.py hold)") as ids:
        part = ids_file.with_suffix(".part")
        part.write_text(",".join(ids))
        part.rename(ids_file)
        while not release.exists():  # the test says when the lease may end
            time.sleep(0.05)


def trial(devices_file: str, hold_file: str, result_file: Path) -> None:
    from dapple_lightning.plan import Plan
    from dapple_lightning.trials import TrialConfig, run_trial

    kwargs = {"devices_file": devices_file} | ({} if hold_file == "-" else {"hold_until": hold_file})
    config = TrialConfig(
        "dapple_lightning.search.testing:mlp",
        world_size=2,
        global_batch=8,
        warmup=0,
        steps=1,
        threads_per_rank=1,
        timeout_s=300,
        model_kwargs=kwargs,
        device_lease=True,  # on CPU: the lease sets CUDA_VISIBLE_DEVICES, nothing uses it
    )
    result = run_trial(Plan.straight(6, 2, micro_batches=2), config)
    result_file.write_text(json.dumps({"status": result.status, "reason": result.reason}))


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "hold":
        hold(int(args[0]), Path(args[1]), Path(args[2]))
    else:
        trial(args[0], args[1], Path(args[2]))
