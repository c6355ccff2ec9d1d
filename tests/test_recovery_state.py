"""What recovery keeps while training runs well: the per-step snapshot (strategy/_snapshot.py) and
the log of ``recovery="log"`` (strategy/_logbook.py)."""

from __future__ import annotations

import random

import numpy as np
import torch
from lightning.fabric.utilities.seed import _collect_rng_states
from torch import nn

from dapple_lightning.strategy._snapshot import BufferCopies, Snapshot


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.inner = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.norm(x))


def test_buffer_copies_hold_the_state_dicts_buffers_as_they_were_when_taken() -> None:
    module = WithBuffers().train()
    copies = BufferCopies(module)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    taken = copies.take()
    params = {name for name, _ in module.named_parameters()}
    assert taken.keys() == before.keys() - params  # persistent buffers only, under their state_dict keys
    module(torch.randn(5, 3))  # running statistics move in place
    assert not torch.equal(module.norm.running_mean, before["norm.running_mean"])
    for key, value in taken.items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    # A buffer replaced by assignment is read from its slot again.
    module.norm.running_mean = torch.full((3,), 7.0)
    torch.testing.assert_close(copies.take()["norm.running_mean"], torch.full((3,), 7.0))
    assert copies.of(module) and not copies.of(WithBuffers())


def test_buffer_copies_read_keys_a_state_dict_hook_made_through_the_state_dict() -> None:
    module = WithBuffers()

    def renamed(mod, state, prefix, local):
        state["norm.running_mean_renamed"] = state.pop("norm.running_mean").clone()

    module._register_state_dict_hook(renamed)
    copies = BufferCopies(module)
    taken = copies.take()
    assert "norm.running_mean_renamed" in taken and "norm.running_mean" not in taken
    module.norm.running_mean.fill_(3.0)
    torch.testing.assert_close(copies.take()["norm.running_mean_renamed"], torch.full((3,), 3.0))


def test_a_snapshot_shares_nothing_with_what_it_was_taken_from() -> None:
    live_callbacks = {"counter": {"seen": [1, 2]}}
    state = {
        "global_step": 4,
        "callbacks": live_callbacks,
        "rng": _collect_rng_states(include_cuda=False),
        "order": {"generator": torch.Generator().manual_seed(3).get_state(), "skip": 2},
    }
    snapshot = Snapshot.of(state)
    drawn = (torch.rand(4), np.random.rand(4), random.random())  # what the step draws after its safe point
    live_callbacks["counter"]["seen"].append(3)  # a callback's state moves on during the step
    restored = snapshot.unpack()
    assert snapshot.step == 4
    assert restored["callbacks"] == {"counter": {"seen": [1, 2]}}
    torch.set_rng_state(restored["rng"]["torch"])
    np.random.set_state(restored["rng"]["numpy"])
    random.setstate(restored["rng"]["python"])
    torch.testing.assert_close(torch.rand(4), drawn[0], rtol=0, atol=0)
    assert (np.random.rand(4) == drawn[1]).all() and random.random() == drawn[2]


def test_the_log_keeps_only_steps_a_replay_can_start_from(tmp_path) -> None:
    """recovery="log": a replay starts from a checkpoint, so nothing is kept before the first save (a run
    that never saves would otherwise grow the log every step), then the steps since the checkpoint
    before the last, in memory and on storage."""
    from dapple_lightning.plan import Plan
    from dapple_lightning.strategy._logbook import Logbook

    plan = Plan.coerce({"micro_batches": 1, "stages": [{"layers": [0, 1]}, {"layers": [1, 2]}]})
    book = Logbook(plan, 0, tmp_path / "log")
    assert book.watched == {1}

    def train(steps: range) -> None:
        for step in steps:
            book.record("F", 1, [torch.full((2,), float(step))], False)
            book.end_step(step, (torch.ones(1),), step)

    train(range(0, 50))
    assert book._steps == {}
    book.checkpointed(50)
    train(range(50, 55))
    book.flush()
    assert sorted(book._steps) == [50, 51, 52, 53, 54]
    assert sorted(int(p.stem[4:]) for p in (tmp_path / "log").glob("step*.pt")) == [50, 51, 52, 53, 54]
    book.checkpointed(53)  # one more checkpoint back is kept: a save a failure interrupted
    assert sorted(book._steps) == [50, 51, 52, 53, 54]
    book.checkpointed(55)
    train(range(55, 57))
    assert sorted(book._steps) == [53, 54, 55, 56]
    assert sorted(int(p.stem[4:]) for p in (tmp_path / "log").glob("step*.pt")) == [53, 54]
    (entry,) = book.read(range(53, 54), 1)
    torch.testing.assert_close(entry["messages"][("F", 1)][0][0][0], torch.full((2,), 53.0))


# --------------------------------------------------------------------- the vote certifies finished work


class _Ballot:
    """The store's vote as the main thread sees it, recording when it is cast."""

    def __init__(self, events: list[str]) -> None:
        self.events = events

    def cast(self, step: int) -> bool:
        self.events.append(f"cast {step}")
        return True

    def abort(self, step: int) -> bool:
        self.events.append(f"abort {step}")
        return False

    def forget(self, step: int) -> None:
        pass


def test_the_vote_is_cast_only_after_the_device_finished_the_steps_work(monkeypatch) -> None:
    """Under NCCL a reduction's ``wait()`` returns before its work is done; the vote must come after a
    host wait on the device (:func:`device_work_done`), else a peer's death could leave partial sums
    in a committed step. Here the device's work completes late, when the host wait asks for it."""
    from types import SimpleNamespace

    from dapple_lightning.strategy import _recovery

    events: list[str] = []
    queued = ["all-reduce of the step's gradients", "the clipping norm's all-reduce"]

    def device_work_done(device: torch.device) -> None:
        events.extend(f"finished {work}" for work in queued)  # the late completion
        queued.clear()

    monkeypatch.setattr(_recovery, "device_work_done", device_work_done)
    recovery = _recovery.Recovery(True)
    recovery.active = True
    recovery._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)))
    recovery._identity = {"world": 2}
    recovery._snapshot = SimpleNamespace(step=3)
    recovery._ballot = _Ballot(events)
    recovery._vote()
    assert events == [
        *(f"finished {w}" for w in ["all-reduce of the step's gradients", "the clipping norm's all-reduce"]),
        "cast 3",
    ]


def test_waiting_for_the_device_is_free_on_the_cpu() -> None:
    from dapple_lightning.strategy._recovery import device_work_done

    device_work_done(torch.device("cpu"))  # gloo's wait() already finished the work: nothing to record


def test_waiting_for_the_device_waits_for_queued_kernels() -> None:
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dapple_lightning.strategy._recovery import device_work_done

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda._sleep(200_000_000)  # a kernel that spins for a while on the current stream
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    assert not done.query(), "the kernel should still run when the host goes on"
    device_work_done(device)
    assert done.query()


# --------------------------------------------------------------------- where the state is kept


class _Kept:
    """A snapshot as :meth:`Recovery._write` reads it."""

    step = 7

    def unpack(self) -> dict:
        return {"loops": {}}


def _places(tmp_path, monkeypatch):
    """The preferred place (as /dev/shm) and the disk fallback (the temporary directory), both under ``tmp_path``."""
    import tempfile

    memory, disk = tmp_path / "shm", tmp_path / "disk"
    memory.mkdir()
    disk.mkdir()
    monkeypatch.setenv("DAPPLE_RECOVERY_DIR", str(memory))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-a")
    monkeypatch.setattr(tempfile, "tempdir", str(disk))
    return memory, disk


def _write_state(free, log=None) -> tuple[dict, nn.Module]:
    from types import SimpleNamespace

    from dapple_lightning.strategy._recovery import Recovery

    recovery = Recovery(True)
    identity = {"run": "run-a", "rank": 0}
    model = nn.Linear(64, 64)
    recovery._trainer = SimpleNamespace(lightning_module=model, strategy=SimpleNamespace(optimizers=[]))
    recovery._identity, recovery._snapshot, recovery.free_bytes, recovery.logbook = identity, _Kept(), free, log
    recovery._write()
    return identity, model


def test_state_goes_to_disk_when_the_memory_file_system_lacks_room_and_is_found_there(
    tmp_path, monkeypatch, capsys
) -> None:
    """``/dev/shm`` is often small in containers: a write that would not fit goes to the disk fallback,
    saying where, and the restart's reader finds it there."""
    from dapple_lightning.plan import Plan
    from dapple_lightning.strategy._logbook import Logbook
    from dapple_lightning.strategy._recovery import files_of
    from dapple_lightning.strategy._resume import _read

    memory, disk = _places(tmp_path, monkeypatch)
    assert [p.parents[2] for p in files_of(0)] == [memory, disk]
    plan = Plan.coerce({"micro_batches": 1, "stages": [{"layers": [0, 1]}, {"layers": [1, 2]}]})
    book = Logbook(plan, 0, *(p.parent / "log-rank0" for p in files_of(0)))
    book.checkpointed(5)
    for step in (5, 6):
        book.record("F", 1, [torch.full((3,), float(step))], False)
        book.end_step(step, (torch.ones(1),), step)

    # Room in memory: the state and the log go there.
    identity, _ = _write_state(lambda path: 2**40, book)
    assert files_of(0)[0].is_file() and not files_of(0)[1].exists()
    assert _read(0, identity)["step"] == 7
    assert "keeps its state" not in capsys.readouterr().err

    # Too little room in memory (the limit told through ``free``): on disk, said, found, the memory copy gone.
    identity, model = _write_state(lambda path: 1_000 if memory in path.parents else 2**40, book)
    assert "keeps its state for recovery in " + str(files_of(0)[1].parent) in capsys.readouterr().err
    assert files_of(0)[1].is_file() and not files_of(0)[0].exists()
    state = _read(0, identity)
    assert state["step"] == 7 and torch.equal(state["state_dict"]["weight"], model.weight.detach())
    assert sorted(p.name for p in (files_of(0)[1].parent / "log-rank0").glob("step*.pt")) == ["step5.pt", "step6.pt"]
    assert not list((files_of(0)[0].parent / "log-rank0").glob("step*.pt"))
    (entry,) = book.read(range(6, 7), 1)
    torch.testing.assert_close(entry["messages"][("F", 1)][0][0][0], torch.full((3,), 6.0))


def test_the_log_copies_device_messages_without_waiting_and_writes_them_whole(tmp_path) -> None:
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from dapple_lightning.plan import Plan
    from dapple_lightning.strategy._logbook import Logbook

    plan = Plan.coerce({"micro_batches": 1, "stages": [{"layers": [0, 1]}, {"layers": [1, 2]}]})
    book = Logbook(plan, 0, tmp_path / "log")
    book.checkpointed(0)
    torch.cuda._sleep(100_000_000)  # the device is busy: a blocking copy would wait for it here
    sent = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    book.record("F", 1, [sent], False)
    assert book._copied is not None and not book._copied.query()
    book.end_step(0, (torch.ones(1),), 0)
    book.flush()
    (entry,) = book.read(range(0, 1), 1)
    torch.testing.assert_close(entry["messages"][("F", 1)][0][0][0], sent.cpu())
