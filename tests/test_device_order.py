"""What reaches a collective, and what is left after setup (real processes, gloo).

NCCL takes tensors on the rank's CUDA device only. On CPU every tensor is on the one device, so
"on the right device" cannot fail here by itself; what can is how a tensor was made. The ranks
run under a torch function mode that marks every tensor a factory made without an explicit
``device=`` (``torch.tensor([...])``), and everything computed from one, until an explicit move
(``.to(device)``) clears it: under NCCL such a tensor is a CPU tensor. No marked tensor may
reach a collective or point-to-point call, and every tensor that does is on the strategy's
root device. Rank 0's initial weights must reach the others through the bounded staging
buffer, and ``plan="auto"`` must leave no process group that only its trials used.
"""

from __future__ import annotations

import json
import os
import re
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.overrides import TorchFunctionMode

from dapple_lightning import DappleStrategy, Plan

import models
from distributed import run_ranks
from harness import quiet_trainer

MADE_ON_HOST = "_dapple_test_made_without_device"
FACTORIES = {torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn}
EXPLICIT_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
TENSOR_CALLS = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
TENSOR_CALLS += ("reduce", "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")


class MadeWithoutDevice(TorchFunctionMode):
    """Marks tensors made without ``device=`` and those computed from them (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in EXPLICIT_MOVES and out is args[0] and _marked(out):
            # On the CPU, ``.to(cpu)`` returns the tensor itself; on a GPU it would be a new one.
            return out.view_as(out)
        if func in FACTORIES:
            marked = kwargs.get("device") is None
        else:
            marked = func not in EXPLICIT_MOVES and any(_marked(a) for a in (*args, *kwargs.values()))
        if marked:
            origin = _origin()
            for t in out if isinstance(out, list | tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    setattr(t, MADE_ON_HOST, origin)
        return out


def _marked(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return hasattr(value, MADE_ON_HOST)
    if isinstance(value, list | tuple):
        return any(_marked(v) for v in value)
    return False


def _origin() -> str:
    frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename and __file__ != f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dist.P2POp):
        return [value.tensor]
    return []


def record_collectives(records: list[dict]) -> dict[str, Any]:
    """Wrap torch.distributed's tensor calls so that each records its tensors; the originals, to put back."""
    originals = {name: getattr(dist, name) for name in TENSOR_CALLS}

    def wrapped(name: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            for t in _tensors([*args, *kwargs.values()]):
                records.append({"call": name, "device": str(t.device), "host": getattr(t, MADE_ON_HOST, None)})
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(dist, name, wrapped(name, original))
    return originals


class Watch(Callback):
    """In each rank: records what reaches a collective from the strategy's setup to the end of
    fit, makes rank 1's initial weights differ from rank 0's, and counts the process groups
    created during setup that are still alive when training starts."""

    def __init__(self, folder: Path, trial_margin: float | None = None) -> None:
        self.folder, self.trial_margin = folder, trial_margin

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.trial_margin is not None:  # measure every close plan, so that trials surely run
            import dapple_lightning.autoplan as autoplan

            autoplan.choose_plan.__kwdefaults__["margin"] = self.trial_margin
        with torch.no_grad():
            for p in pl_module.parameters():
                p.add_(trainer.global_rank)  # rank 0's stay the model's own
        self.records: list[dict] = []
        self.created: list[Any] = []
        new_group = dist.new_group

        def recording_new_group(*args: Any, **kwargs: Any) -> Any:
            group = new_group(*args, **kwargs)
            self.created.append(group)
            return group

        dist.new_group = recording_new_group
        self.originals = {**record_collectives(self.records), "new_group": new_group}
        self.mode = MadeWithoutDevice()
        self.mode.__enter__()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        pg_map = dist.distributed_c10d._world.pg_map
        alive = [g for g in self.created if g is not dist.GroupMember.NON_GROUP_MEMBER and g in pg_map]
        self.held = {name: p.detach().cpu().tolist() for name, p in pl_module.named_parameters() if not p.is_meta}
        self.start = {
            "alive_groups": len(alive),
            "plan": strategy.plan.to_dict(),
            "trials": len(strategy.auto_plan.trials) if strategy.auto_plan is not None else 0,
            "staged": None if strategy.staged is None else [str(strategy.staged.device), strategy.staged.buckets],
            "root_device": str(strategy.root_device),
        }

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.mode.__exit__(None, None, None)
        for name, original in self.originals.items():
            setattr(dist, name, original)
        out = {**self.start, "records": self.records, "held": self.held}
        (self.folder / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


def fit_watched(tmp_path: Path, plan: Plan | str, trial_margin: float | None = None) -> list[dict]:
    model = models.MLP()
    trainer = quiet_trainer(
        strategy=DappleStrategy(plan, start_method="forkserver"),
        devices=2,
        max_steps=2,
        callbacks=[Watch(tmp_path, trial_margin)],
    )
    trainer.fit(model, train_dataloaders=models.loader())
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def assert_every_collective_on_the_root_device(ranks: list[dict]) -> None:
    for rank, seen in enumerate(ranks):
        assert seen["records"], f"rank {rank} recorded no collective: the recorder is not in place"
        made_on_host = sorted({f"{r['call']} <- {r['host']}" for r in seen["records"] if r["host"]})
        assert made_on_host == [], f"rank {rank}: tensors made without a device reached collectives: {made_on_host}"
        elsewhere = [r for r in seen["records"] if r["device"] != seen["root_device"]]
        assert elsewhere == [], f"rank {rank}: off the root device {seen['root_device']}: {elsewhere[:5]}"


def assert_rank_zero_weights(ranks: list[dict]) -> None:
    """Every rank trains from rank 0's initial weights, broadcast through the staging buffer."""
    initial = {name: p.detach().tolist() for name, p in models.MLP().named_parameters()}
    for rank, seen in enumerate(ranks):
        assert seen["staged"] is not None and seen["staged"][0] == seen["root_device"] and seen["staged"][1] >= 1
        assert seen["held"], f"rank {rank} holds no parameter"
        for name, values in seen["held"].items():
            torch.testing.assert_close(torch.tensor(values), torch.tensor(initial[name]), msg=f"rank {rank}: {name}")


def test_a_pipelined_fit_sends_only_root_device_tensors_and_starts_from_rank_zero(tmp_path):
    plan = Plan(stages=[{"layers": [0, 3], "replicas": 1}, {"layers": [3, 7], "replicas": 1}], micro_batches=2)
    ranks = fit_watched(tmp_path, plan)
    assert_every_collective_on_the_root_device(ranks)
    assert_rank_zero_weights(ranks)
    calls = {r["call"] for seen in ranks for r in seen["records"]}
    assert "broadcast" in calls and calls & {"send", "isend", "batch_isend_irecv"}, calls


def test_auto_profiles_tries_and_trains_on_root_device_tensors_and_destroys_the_trials_groups(tmp_path):
    ranks = fit_watched(tmp_path, "auto", trial_margin=0.99)
    assert_every_collective_on_the_root_device(ranks)
    assert_rank_zero_weights(ranks)
    for rank, seen in enumerate(ranks):
        assert seen["trials"] >= 2, "no trials ran: nothing to destroy"
        plan = Plan.coerce(seen["plan"])
        needed = (2 if plan.num_stages > 1 else 0) + (len(plan.stage_ranks(plan.stage_of(rank))) > 1)
        assert seen["alive_groups"] == needed, f"rank {rank}: {seen['alive_groups']} groups alive for {plan.describe()}"


# ------------------------------------------------------------------ the staging buffer


class Mixed(nn.Module):
    """Several dtypes, a tensor larger than a bucket, and a strided (transposed) parameter."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.big = nn.Parameter(torch.randn(5, 9, generator=g) + shift)  # 180 bytes: three buckets and a bit
        self.small = nn.Parameter(torch.randn(3, generator=g) + shift)
        self.strided = nn.Parameter((torch.randn(4, 3, generator=g) + shift).t())
        self.register_buffer("counts", torch.arange(11, dtype=torch.int64) + int(shift))
        self.register_buffer("wide", torch.randn(6, dtype=torch.float64, generator=g) + shift)
        self.register_buffer("short", torch.arange(7, dtype=torch.int16) * 300 + int(shift))  # NCCL has no int16


def stage_mixed(rank: int, world_size: int, bucket_bytes: int) -> dict:
    from dapple_lightning.strategy._pipelines import broadcast_module

    module = Mixed(shift=float(rank))
    sizes: list[int] = []
    dtypes: set[str] = set()
    original = dist.broadcast

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel() * tensor.element_size())
        dtypes.add(str(tensor.dtype))
        return original(tensor, *args, **kwargs)

    dist.broadcast = recording
    try:
        staged = broadcast_module(module, torch.device("cpu"), bucket_bytes=bucket_bytes)
    finally:
        dist.broadcast = original
    return {
        "sizes": sizes,
        "dtypes": sorted(dtypes),
        "staged": (str(staged.device), staged.buckets, staged.largest_bytes),
        "state": {k: v.tolist() for k, v in module.state_dict().items()},
        "strided_still_strided": not module.strided.is_contiguous(),
    }


def test_initial_weights_travel_in_buckets_no_larger_than_asked():
    bucket = 64
    results = run_ranks(stage_mixed, 3, bucket)
    want = Mixed(shift=0.0).state_dict()
    per_dtype = {torch.float32: 0, torch.int64: 0, torch.float64: 0, torch.int16: 0}
    for t in want.values():
        per_dtype[t.dtype] += t.numel() * t.element_size()
    expected = sum(-(-nbytes // bucket) for nbytes in per_dtype.values())
    for rank, r in enumerate(results):
        assert max(r["sizes"]) <= bucket and sum(r["sizes"]) == sum(per_dtype.values()), r["sizes"]
        assert r["staged"] == ("cpu", expected, bucket) and len(r["sizes"]) == expected
        assert r["strided_still_strided"]
        assert "torch.int16" not in r["dtypes"], "16-bit integers travel as bytes (NCCL has none)"
        for key, value in want.items():
            assert torch.equal(torch.tensor(r["state"][key], dtype=value.dtype), value), f"rank {rank}: {key}"


def agree_short_buffers(rank: int, world_size: int) -> dict:
    from dapple_lightning.runtime import agree_buffers

    buffers = [torch.arange(5, dtype=torch.int16) * 1000 + rank, torch.full((3,), 0.5 + rank)]
    dtypes: list[str] = []
    original = dist.broadcast

    def recording(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        dtypes.append(str(tensor.dtype))
        return original(tensor, *args, **kwargs)

    dist.broadcast = recording
    try:
        agree_buffers(buffers, 1, None)
    finally:
        dist.broadcast = original
    return {"dtypes": dtypes, "buffers": [b.tolist() for b in buffers]}


def test_buffers_of_16_bit_integers_agree_as_bytes():
    for r in run_ranks(agree_short_buffers, 2):
        assert "torch.int16" not in r["dtypes"] and len(r["dtypes"]) == 2, r["dtypes"]
        assert r["buffers"] == [[1, 1001, 2001, 3001, 4001], [1.5, 1.5, 1.5]]


# --------------------------------------------------------------------- failure texts

NCCL_TEXTS = [
    # the watchdog's timeout, as ProcessGroupNCCL logs and raises it
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=BROADCAST, NumelIn=4, "
    "NumelOut=4, Timeout(ms)=120000) ran for 120021 milliseconds before timing out.",
    # the next call on a communicator the watchdog aborted (TORCH_NCCL_ASYNC_ERROR_HANDLING=2)
    "NCCL communicator was aborted on rank 0. Original reason for failure was: [Rank 0] Watchdog caught "
    "collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE)",
    "Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, subsequent "
    "GPU operations might run on corrupted/incomplete data.",
    # a peer's process died under NCCL's transport
    "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or there was "
    "a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a "
    "remote process exiting prematurely.\nLast error:\nsocketProgressOpt: Connection closed by remote peer",
]
NCCL_OWN_ERRORS = [
    # errors of the rank itself that NCCL reports in its own words: not a lost peer
    "NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled system error (run with NCCL_DEBUG=INFO for details)",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version "
    "2.21.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU "
    "detected : rank 1 and rank 0 both on CUDA device 1000",
    "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for details)\n"
    "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\nCuda failure 'out of memory'",
]
GLOO_TEXTS = [
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:44215",
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 120000ms for recv operation",
]


@pytest.mark.parametrize("text", NCCL_TEXTS + GLOO_TEXTS)
def test_a_lost_peer_is_named_for_nccl_and_gloo_errors(text):
    strategy = DappleStrategy(Plan.data_parallel(7, 2), timeout=timedelta(seconds=120))
    error = dist.DistBackendError(text)
    strategy.on_exception(error)
    message = str(error)
    assert "dapple: rank 0 lost a peer" in message and "DappleStrategy(timeout=120 s)" in message
    assert message.startswith(text), "the original error comes first, the note after it"


@pytest.mark.parametrize(
    "text", ["CUDA out of memory. Tried to allocate 2.00 GiB", "mat1 and mat2 shapes cannot", *NCCL_OWN_ERRORS]
)
def test_an_error_of_the_rank_itself_is_not_called_a_lost_peer(text):
    from dapple_lightning.strategy._failures import PEER_LOST

    assert re.match(PEER_LOST, text) is None
    error = RuntimeError(text)
    DappleStrategy(Plan.data_parallel(7, 2)).on_exception(error)
    assert str(error) == text


def test_the_timeout_is_a_timedelta_or_seconds():
    assert DappleStrategy("auto", timeout=30)._timeout == timedelta(seconds=30)
    assert DappleStrategy("auto", timeout=timedelta(minutes=2))._timeout == timedelta(seconds=120)
    with pytest.raises(TypeError, match="timedelta or a number of seconds"):
        DappleStrategy("auto", timeout="30")
    with pytest.raises(ValueError, match="more than 0 seconds"):
        DappleStrategy("auto", timeout=0)


def test_nccl_raises_on_failure_unless_the_user_chose(monkeypatch):
    from dapple_lightning.strategy._failures import prepare_backend

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    prepare_backend("gloo")
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    prepare_backend("nccl")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    prepare_backend("nccl")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"


def test_under_torchrun_nccl_raises_although_the_agent_exports_1(monkeypatch):
    """torchrun's agent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless its own environment
    names a value: there 1 is the launcher's default, not the user's choice. Another value is kept."""
    from dapple_lightning.strategy._failures import prepare_backend

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    prepare_backend("nccl")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    prepare_backend("nccl")
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def stage_on_cuda(rank: int, world_size: int) -> tuple[str, int]:
    from dapple_lightning.strategy._pipelines import broadcast_module

    module = Mixed(shift=float(rank))
    staged = broadcast_module(module, torch.device("cuda", 0), bucket_bytes=64)
    return str(module.big.device), staged.buckets


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_staging_on_cuda_leaves_the_module_on_the_cpu():
    assert all(device == "cpu" and buckets > 0 for device, buckets in run_ranks(stage_on_cuda, 2))


# --------------------------------------------------------------------- refused before any process group

CUDA = torch.device("cuda", 0)  # a device object only: nothing here runs on it


@pytest.mark.parametrize(
    ("plan", "world_size"),
    [({"micro_batches": 2, "stages": [{"layers": [0, 4]}, {"layers": [4, 7]}]}, 2), ("auto", 2)],
    ids=["two-stages", "auto"],
)
def test_gloo_on_cuda_refuses_plans_that_send_between_stages(plan, world_size):
    from dapple_lightning.strategy._refusals import check_before_start

    from models import MLP

    plan = plan if plan == "auto" else Plan.coerce(plan)
    with pytest.raises(ValueError, match=r"gloo has no send or receive for CUDA tensors.*'nccl'"):
        check_before_start(MLP(), "32-true", None, plan, world_size, backend="gloo", device=CUDA)
    # the same plan is fine under NCCL on CUDA, and under gloo on the CPU
    check_before_start(MLP(), "32-true", None, plan, world_size, backend="nccl", device=CUDA)
    check_before_start(MLP(), "32-true", None, plan, world_size, backend="gloo", device=torch.device("cpu"))


def test_gloo_on_cuda_runs_a_one_stage_plan():
    from dapple_lightning.strategy._refusals import check_before_start

    from models import MLP

    chain = check_before_start(MLP(), "32-true", None, Plan.data_parallel(7, 2), 2, backend="gloo", device=CUDA)
    assert len(chain) == 7


def test_offload_on_a_gpu_is_refused_at_setup():
    from dapple_lightning.strategy._refusals import check_before_start

    from models import MLP

    plan = Plan.coerce({"micro_batches": 2, "stages": [{"layers": [0, 4], "offload": 1}, {"layers": [4, 7]}]})
    with pytest.raises(ValueError, match=r"offloads stages \[0\], and the device is cuda.*accelerator='cpu'"):
        check_before_start(MLP(), "32-true", None, plan, 2, backend="nccl", device=CUDA)


def test_two_nccl_ranks_on_one_gpu_are_refused_at_setup():
    from dapple_lightning.strategy._refusals import check_before_start

    from models import MLP

    plan = Plan.data_parallel(7, 2)
    shared = [CUDA, CUDA]
    with pytest.raises(ValueError, match=r"local ranks \[0, 1\] would all run on cuda:0.*Plan\.data_parallel\(7, 2\)"):
        check_before_start(MLP(), "32-true", None, plan, 2, backend="nccl", device=CUDA, node_devices=shared)
    # gloo shares a GPU between ranks (a one-stage plan), and NCCL runs on GPUs of their own
    check_before_start(MLP(), "32-true", None, plan, 2, backend="gloo", device=CUDA, node_devices=shared)
    own = [CUDA, torch.device("cuda", 1)]
    check_before_start(MLP(), "32-true", None, plan, 2, backend="nccl", device=CUDA, node_devices=own)
