"""Device leases: concurrent trials on one host see disjoint ``CUDA_VISIBLE_DEVICES``, a trial that
finds too few free waits, a killed holder's devices are free again.

No GPU is needed: ``DAPPLE_HOST_GPUS`` names four the host does not have, the trials run on CPU
with ``TrialConfig(device_lease=True)`` (the lease only sets the variable), and the model writes
the value it sees to a file. Every process here is a real one (``device_runs.py``); the test
synchronises on the files they write, never on time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from search_runs import HERE, env, poll

from dapple_lightning.plan import Plan
from dapple_lightning.trials import TrialConfig, run_trial
from dapple_lightning.trials._devices import host_devices, lease_devices

MLP = "dapple_lightning.search.testing:mlp"


@pytest.fixture
def host(tmp_path, monkeypatch) -> dict[str, str]:
    """A host of four fake GPUs with a lock directory of its own; the environment of its processes."""
    extra = {"DAPPLE_HOST_GPUS": "0,1,2,3", "DAPPLE_DEVICE_LOCK_DIR": str(tmp_path / "locks")}
    for name, value in extra.items():
        monkeypatch.setenv(name, value)
    return env(**extra)


def _start(host_env: dict[str, str], tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    err = open(tmp_path / f"{name}.err", "w")  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(
        [sys.executable, str(HERE / "device_runs.py"), *args],
        cwd=tmp_path,
        env=host_env,
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )


def _ids(path: Path) -> set[str]:
    return set(path.read_text().split(","))


def test_host_devices_come_from_dapple_host_gpus_then_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aa, GPU-bb")
    monkeypatch.setenv("DAPPLE_HOST_GPUS", "0,1,2,3")
    assert host_devices() == ("0", "1", "2", "3")
    monkeypatch.delenv("DAPPLE_HOST_GPUS")
    assert host_devices() == ("GPU-aa", "GPU-bb")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert host_devices() == ()


def test_only_trials_on_gpus_lease_devices(host, monkeypatch):
    def leases(**kw) -> bool:
        return TrialConfig(MLP, world_size=2, global_batch=8, **kw).leases_devices

    assert not leases() and not leases(accelerator="cpu") and not leases(accelerator="cuda", device_lease=False)
    assert leases(accelerator="cuda") and leases(accelerator="gpu") and leases(device_lease=True)
    assert leases(accelerator="auto")  # the host has (fake) GPUs
    monkeypatch.setenv("DAPPLE_HOST_GPUS", "")
    assert not leases(accelerator="auto")


def test_a_trial_needing_more_gpus_than_the_host_has_fails_and_says_so(host, monkeypatch):
    monkeypatch.setenv("DAPPLE_HOST_GPUS", "0")
    config = TrialConfig(MLP, world_size=2, global_batch=8, device_lease=True)
    result = run_trial(Plan.straight(6, 2, micro_batches=2), config)
    assert result.status == "failed" and result.fail_kind == "crash" and result.pgid is None
    assert "the trial needs 2 GPUs, this host has 1 (0)" in result.reason
    assert "DAPPLE_HOST_GPUS" in result.reason


def test_a_killed_holders_devices_are_leased_again(host, tmp_path):
    ids, release = tmp_path / "held", tmp_path / "release"
    holder = _start(host, tmp_path, "holder", "hold", "3", str(ids), str(release))
    try:
        poll(ids.exists, 120, "the holder's lease")
        assert _ids(ids) == {"0", "1", "2"}
        with lease_devices(1) as mine:
            assert mine == ("3",)  # the one the holder left
        os.killpg(holder.pid, signal.SIGKILL)  # no handler runs: the kernel drops its locks
        holder.wait(timeout=60)
        with lease_devices(4) as mine:
            assert mine == ("0", "1", "2", "3")
    finally:
        holder.kill()
        holder.wait()


def test_concurrent_trials_see_disjoint_devices_and_a_third_waits_for_one_to_end(host, tmp_path):
    files = {name: (tmp_path / f"{name}.devices", tmp_path / f"{name}.hold") for name in "abc"}
    results = {name: tmp_path / f"{name}.json" for name in "abc"}

    def start(name: str, hold: bool) -> subprocess.Popen:
        devices, held = files[name]
        return _start(host, tmp_path, name, "trial", str(devices), str(held) if hold else "-", str(results[name]))

    procs = {"a": start("a", True), "b": start("b", True)}
    try:
        # A and B train at once, each holding its first step until told.
        poll(lambda: all(files[n][0].exists() for n in "ab"), 240, "trials a and b to start")
        a, b = _ids(files["a"][0]), _ids(files["b"][0])
        assert len(a) == len(b) == 2 and not a & b and a | b == {"0", "1", "2", "3"}
        # C finds no two free devices: it waits, saying who holds them, and has not started.
        procs["c"] = start("c", False)
        waiting = poll(
            lambda: "waiting for 2 free GPUs of 4" in (text := (tmp_path / "c.err").read_text()) and text,
            120,
            "trial c to wait for devices",
        )
        assert "held by pid" in waiting and str(procs["a"].pid) in waiting and str(procs["b"].pid) in waiting
        assert not files["c"][0].exists()
        # A ends: C gets A's devices, while B still holds its own.
        files["a"][1].touch()
        poll(files["c"][0].exists, 240, "trial c to start")
        assert _ids(files["c"][0]) == a
        assert procs["c"].wait(timeout=240) == 0
        files["b"][1].touch()
        for name, proc in procs.items():
            assert proc.wait(timeout=240) == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
    finally:
        for name in "ab":
            files[name][1].touch()
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    outcomes = {name: json.loads(path.read_text()) for name, path in results.items()}
    assert all(o["status"] == "complete" for o in outcomes.values()), outcomes
