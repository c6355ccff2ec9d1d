"""A stage copies to its device only the batch tensors its step reads (strategy/_batch_leaves.py).

On CUDA each micro-batch tensor moves when the stage's code first reads it. On the CPU nothing
moves, so these tests make the lazy moves happen on CPU processes (``lazy_batch=True``) and record
each copy (``copy_to_device``, replaced in each rank by the model's ``setup``): a plain
``(x, y)`` pipeline's first stage copies ``x``, its last ``y`` and a middle stage nothing; a
Hugging Face-style step that reads an attention mask copies the mask on every stage; and the
losses stay one device's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import Callback, LightningModule
from test_batches import Record
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from dapple_lightning import Plan
from dapple_lightning.microbatch import Rows, slice_batch
from dapple_lightning.strategy import _batch_leaves
from dapple_lightning.strategy._batch_leaves import DeviceLeaf, HostLeaf, LeafMoves, plain
from dapple_lightning.strategy._step import PipelinedSteps

import models
from harness import fit

CPU = torch.device("cpu")
LAZY = {"lazy_batch": True}
COPIED: list[str] = []
"""In a rank: what each copy moved since the last step's record (dtype and per-row shape)."""


def recording_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    COPIED.append(f"{host.dtype}{list(host.shape[1:])}")
    return host.clone()  # a copy of its own, as the device's is


def record_copies() -> None:
    """In this process, each copy of a batch tensor goes through :func:`recording_copy`."""
    _batch_leaves.copy_to_device = recording_copy


@pytest.fixture
def lazy(monkeypatch) -> list[str]:
    monkeypatch.setattr(_batch_leaves, "copy_to_device", recording_copy)
    COPIED.clear()
    return COPIED


def on_device(batch, moves: LeafMoves, hook: str = "training_step"):
    """``batch`` as a step sees it: through Lightning's default transfer, moving lazily."""
    return plain(move_data_to_device(moves.host_leaves(batch, hook), moves.device))


# ------------------------------------------------------------------------ one process


def test_nothing_is_wrapped_where_the_device_is_the_cpu_unless_asked():
    batch = {"x": torch.randn(4, 3), "ids": ["a", "b", "c", "d"]}
    assert not PipelinedSteps(nn.Linear(1, 1), CPU).leaves.lazy
    assert PipelinedSteps(nn.Linear(1, 1), torch.device("cuda")).leaves.lazy
    assert not PipelinedSteps(nn.Linear(1, 1), torch.device("cuda"), lazy_batch=False).leaves.lazy
    assert LeafMoves(CPU, False).host_leaves(batch, "training_step") is batch
    assert isinstance(LeafMoves(CPU, True).host_leaves(batch, "training_step")["x"], HostLeaf)


def test_a_leaf_moves_on_its_first_read_only(lazy):
    moves = LeafMoves(CPU, True)
    x, mask = torch.randn(4, 3), torch.ones(4, 5, dtype=torch.long)
    batch = on_device({"x": x, "mask": mask, "ids": ["a"] * 4}, moves)
    leaf = batch["x"]
    assert isinstance(leaf, DeviceLeaf) and isinstance(leaf, torch.Tensor) and batch["ids"] == ["a"] * 4
    # What describes it copies nothing.
    described = (leaf.shape, leaf.dtype, leaf.device, len(leaf), leaf.dim(), leaf.numel())
    assert described == (torch.Size([4, 3]), torch.float32, CPU, 4, 2, 12)
    assert leaf.to(CPU) is leaf and leaf.to("cpu", non_blocking=True) is leaf and leaf.is_floating_point()
    assert lazy == [] and moves.moved_bytes == 0
    # A layer reads it: one copy, and a plain tensor comes out.
    out = nn.Linear(3, 2)(leaf)
    assert type(out) is torch.Tensor and lazy == ["torch.float32[3]"] and moves.moved_bytes == x.nbytes
    assert torch.equal(leaf[1:3], x[1:3]) and leaf.sum().item() == pytest.approx(float(x.sum()))
    assert lazy == ["torch.float32[3]"]  # cached
    # An attention mask as a Hugging Face model widens it; .item(), .tolist(), numpy.
    m = batch["mask"]
    widened = (1.0 - m[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
    assert widened.shape == (4, 1, 1, 5) and type(widened) is torch.Tensor and float(widened.max()) == 0
    assert m[0, 0].item() == 1 and m.tolist()[0] == [1] * 5 and m.numpy().shape == (4, 5)
    assert moves.moved_bytes == x.nbytes + mask.nbytes
    assert moves.read == {("training_step", 0), ("training_step", 1)}


def test_in_place_changes_stay_on_the_copy_and_the_host_batch_is_untouched(lazy):
    host = torch.zeros(3, 2)
    leaf = on_device({"x": host}, LeafMoves(CPU, True))["x"]
    leaf.add_(1)
    leaf[0] = 5
    assert leaf.tolist() == [[5.0, 5.0], [1.0, 1.0], [1.0, 1.0]]
    assert torch.equal(host, torch.zeros(3, 2))


def test_metadata_after_an_in_place_change_is_the_copys(lazy):
    moves = LeafMoves(CPU, True)
    x = on_device({"x": torch.ones(4, 3)}, moves)["x"]
    x.requires_grad_()  # an input gradient (a saliency map, a gradient penalty)
    assert x.requires_grad and x.is_leaf
    (x * 2).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((4, 3), 2.0))
    y = on_device({"y": torch.ones(4, 3)}, moves)["y"]
    y.unsqueeze_(1)
    assert y.shape == (4, 1, 3) and y.dim() == 3 and (y + 0).shape == (4, 1, 3)


@dataclasses.dataclass
class Scaled:
    """A batch whose ``__post_init__`` changes what it is given: built twice, it would scale twice."""

    img: torch.Tensor

    def __post_init__(self) -> None:
        self.img = self.img.float() / 255


def test_a_batch_is_not_built_again_on_its_way_to_the_step(lazy):
    moves = LeafMoves(CPU, True)
    batch = Scaled(torch.full((4, 3), 255.0))
    assert torch.equal(batch.img, torch.ones(4, 3))
    seen = on_device(batch, moves)
    assert type(seen) is Scaled and torch.equal(seen.img + 0, torch.ones(4, 3))  # scaled once
    # What a transfer hook returns, holding none of dapple's leaves, is handed on as it is.
    made = Record("hook", {"x": torch.randn(4, 3)})  # its constructor takes no dict
    assert plain(made) is made
    assert plain(batch) is batch


def test_your_transfer_hook_sees_host_tensors_and_a_move_of_its_own_is_eager(lazy):
    moves = LeafMoves(CPU, True)
    leaves = moves.host_leaves({"x": torch.randn(4, 3), "y": torch.randn(4, 2)}, "training_step")
    x = leaves["x"]
    assert isinstance(x, HostLeaf) and x.device == CPU and x.numpy().shape == (4, 3)
    assert type(x + 1) is torch.Tensor
    assert isinstance(x.to(CPU), DeviceLeaf) and lazy == []  # .to(the rank's device): lazy
    widened = x.to(CPU, torch.float64)  # anything else runs as asked
    assert type(widened) is torch.Tensor and widened.dtype == torch.float64
    assert type(plain(leaves)["y"]) is torch.Tensor  # not moved by the hook: a host tensor, as it was


def test_what_a_step_read_moves_eagerly_in_the_next_steps_of_its_plan(lazy):
    moves = LeafMoves(CPU, True)

    def step(plan, hook: str = "training_step") -> dict:
        moves.begin_step(plan)
        return on_device({"x": torch.randn(4, 3), "y": torch.randn(4, 2)}, moves, hook)

    step("plan")["y"].sum()
    assert moves.moved_bytes == 4 * 2 * 4
    second = step("plan")
    assert moves.moved_bytes == 4 * 2 * 4  # y, eagerly
    assert isinstance(second["x"], DeviceLeaf)  # never read: still lazy
    assert type(second["y"]) is torch.Tensor  # read before: a plain tensor from the start
    assert isinstance(step("plan", "validation_step")["y"], DeviceLeaf)  # another hook reads its own
    assert isinstance(step("another plan: this rank holds another stage")["y"], DeviceLeaf)


def test_autograd_checkpointing_and_a_compiled_block_run_on_a_lazy_leaf(lazy):
    torch.manual_seed(0)
    block = nn.Linear(5, 5)
    x, mask = torch.randn(4, 3, 5), (torch.rand(4, 3) > 0.3).float()

    def run(mask_in):
        block.zero_grad()
        compiled = torch.compile(lambda h, m: block(h) * m[..., None], backend="eager")
        out = torch.utils.checkpoint.checkpoint(compiled, x, mask_in, use_reentrant=False)
        out.sum().backward()
        return out.detach(), block.weight.grad.clone()

    want = run(mask)
    got = run(on_device({"mask": mask}, LeafMoves(CPU, True))["mask"])
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_micro_batch_through_the_modules_transfer_hooks_is_copied_on_first_read(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device(device, 0) if device == "cuda" else CPU
    steps = PipelinedSteps(models.MLP(), device, lazy_batch=True)
    steps.dataloader_idx = 0
    steps.leaves.begin_step(Plan.data_parallel(7, 1))
    batch = steps.pinned((torch.randn(8, models.IN), torch.randn(8, models.OUT)))
    x, y = steps._on_device(slice_batch(batch, Rows(2, 6)), "training_step")
    assert isinstance(x, DeviceLeaf) and x.device == device and x.shape == (4, models.IN)
    assert steps.leaves.moved_bytes == 0
    assert torch.equal(x.cpu(), batch[0][2:6])
    assert steps.leaves.moved_bytes == 4 * models.IN * 4 and isinstance(y, DeviceLeaf)
    if device.type == "cuda":
        assert batch[0].is_pinned()  # the copy was queued from page-locked memory


# ------------------------------------------------------------------------ processes


class RecordsCopies(Callback):
    """Each rank writes, per step, the bytes its step moved and what its copies were."""

    def __init__(self, out: Path) -> None:
        self.out = str(out)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        moved = trainer.strategy.step_stats.batch_bytes_moved
        with open(Path(self.out) / f"rank{trainer.global_rank}.jsonl", "a") as f:
            f.write(json.dumps([moved, sorted(set(COPIED))]) + "\n")
        COPIED.clear()


def copies(out: Path, rank: int) -> list[list]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


class LazyMLP(models.MLP):
    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:
            record_copies()


VOCAB, SEQ, WIDTH = 11, 6, 8


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.mix(h)) * mask[..., None]


class MaskedBlocks(LightningModule):
    """Hugging Face-style: a dict batch; the embedding and the mask's use before the blocks run on
    every stage, the blocks take the mask as a side input, the head and the labels the last's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MaskedBlock() for _ in range(3))
        self.head = nn.Linear(WIDTH, 3)

    def setup(self, stage: str) -> None:
        if self.trainer.world_size > 1:
            record_copies()

    def training_step(self, batch, batch_idx):
        mask = batch["attention_mask"].float()
        h = self.embed(batch["input_ids"])
        for block in self.blocks:
            h = block(h, mask)
        loss = F.cross_entropy(self.head((h * mask[..., None]).sum(1)), batch["labels"])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def encoded(batch_size: int) -> DataLoader:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(2, SEQ + 1, (models.ROWS,), generator=g)
    samples = [
        {
            "input_ids": torch.randint(0, VOCAB, (SEQ,), generator=g),
            "attention_mask": (torch.arange(SEQ) < n).to(torch.int32),
            "labels": torch.randint(0, 3, (), generator=g),
        }
        for n in lengths
    ]
    return DataLoader(samples, batch_size=batch_size, shuffle=False)


@pytest.mark.parametrize(
    "first, schedule",
    [({}, "dapple"), ({"recompute": True}, "dapple"), ({}, "zb-h1")],
    ids=["dapple", "recomputed-first-stage", "zb-h1"],
)
def test_each_stage_of_a_plain_pipeline_copies_only_what_it_reads(tmp_path, first, schedule):
    want, _ = fit(LazyMLP, tmp_path / "single")
    (out := tmp_path / "copies").mkdir()
    stages = [{"layers": [0, 2], **first}, {"layers": [2, 5]}, {"layers": [5, 7]}]
    plan = Plan(stages=stages, micro_batches=3, schedule=schedule)
    got, _ = fit(LazyMLP, tmp_path / "dapple", plan=plan, callbacks=[RecordsCopies(out)], strategy_kwargs=LAZY)
    torch.testing.assert_close(torch.tensor(got["train_loss"]), torch.tensor(want["train_loss"]), rtol=1e-5, atol=1e-7)
    x_bytes, y_bytes = models.BATCH * models.IN * 4, models.BATCH * models.OUT * 4
    expected = {0: [x_bytes, ["torch.float32[8]"]], 1: [0, []], 2: [y_bytes, ["torch.float32[4]"]]}
    for rank, step in expected.items():
        assert copies(out, rank) == [step] * 4, rank


def test_an_attention_mask_is_copied_on_every_stage_and_the_labels_on_the_last(tmp_path):
    want, _ = fit(MaskedBlocks, tmp_path / "single", loader=encoded)
    (out := tmp_path / "copies").mkdir()
    plan = Plan(stages=[{"layers": [0, 1]}, {"layers": [1, 2]}, {"layers": [2, 3]}], micro_batches=2)
    got, _ = fit(
        MaskedBlocks,
        tmp_path / "dapple",
        plan=plan,
        loader=encoded,
        callbacks=[RecordsCopies(out)],
        strategy_kwargs=LAZY,
    )
    torch.testing.assert_close(torch.tensor(got["train_loss"]), torch.tensor(want["train_loss"]), rtol=1e-5, atol=1e-7)
    ids, mask, labels = models.BATCH * SEQ * 8, models.BATCH * SEQ * 4, models.BATCH * 8
    # The embedding runs on every stage (its output is dropped where the stage receives), so the ids move too.
    before_the_head = [ids + mask, ["torch.int32[6]", "torch.int64[6]"]]
    expected = {
        0: before_the_head,
        1: before_the_head,
        2: [ids + mask + labels, ["torch.int32[6]", "torch.int64[6]", "torch.int64[]"]],
    }
    for rank, step in expected.items():
        assert copies(out, rank) == [step] * 4, rank
