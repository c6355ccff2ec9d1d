"""Blocks in an nn.ModuleList that forward loops over (nanoGPT / Hugging Face style), pipelined.

The models live here at module level so that spawned ranks can import them. Each is compared
with single-device Lightning on the same batches (tests/harness.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from dapple_lightning import Plan
from dapple_lightning.runtime import Placeholder, StageCall, StageExit
from dapple_lightning.surgery import Chain, Cut, find_container

from harness import assert_same, fit

VOCAB, T, D, BLOCKS, ROWS = 32, 8, 16, 4, 48


def tokens(batch_size: int) -> DataLoader:
    """Token sequences and their next tokens, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(0, VOCAB, (ROWS, T + 1), generator=g)
    return DataLoader(TensorDataset(seq[:, :-1], seq[:, 1:]), batch_size=batch_size, shuffle=False)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention (the mask is a side input) and an MLP."""

    def __init__(self, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.calls = 0  # counted on every rank, read by CountCalls

    def attend(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        q, k, v = (z.view(b, t, self.heads, D // self.heads).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, t, D))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = x + self.attend(x, mask)
        return x + self.mlp(self.ln2(x))


class TinyGPT(LightningModule):
    """nanoGPT's layout: embeddings, a ModuleList of blocks looped in forward, final norm and head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList([self.make_block() for _ in range(BLOCKS)])
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def make_block(self) -> nn.Module:
        return Block()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = torch.ones(t, t, dtype=torch.bool, device=idx.device).tril()
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def loss(self, batch) -> torch.Tensor:
        idx, target = batch
        return F.cross_entropy(self(idx).reshape(-1, VOCAB), target.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def rotary(t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.arange(t, device=device)[:, None] * torch.linspace(0.1, 1.0, D // 2, device=device)
    return angles.cos(), angles.sin()


class PairBlock(nn.Module):
    """Takes and returns a pair (features, residual stream); keyword side inputs as in Hugging Face."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)
        self.gate = nn.Linear(D, D)
        self.pos = nn.Embedding(T, D)

    def forward(self, pair, mask=None, *, position_embeddings, position_ids, cache=None, scaled=True):
        h, r = pair
        assert cache is None and mask is None
        cos, sin = position_embeddings
        a, b = h[..., : D // 2], h[..., D // 2 :]
        h = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1) + self.pos(position_ids)
        h = torch.tanh(self.mix(h)) * (0.5 if scaled else 1.0)
        return h, r + torch.sigmoid(self.gate(h))


class PairGPT(TinyGPT):
    """Tuple activations between blocks; side inputs by keyword: a (cos, sin) tuple, position ids, None, flags."""

    def make_block(self) -> nn.Module:
        return PairBlock()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        h = self.wte(idx)
        pair = (h, torch.zeros_like(h))
        cos_sin = rotary(t, idx.device)
        position_ids = torch.arange(t, device=idx.device).expand(b, t)
        for block in self.blocks[:BLOCKS]:  # sliced, as Llama loops self.layers[: n]
            pair = block(pair, None, position_embeddings=cos_sin, position_ids=position_ids, cache=None, scaled=True)
        h, r = pair
        return self.head(self.ln_f(h + r))


class CallsBlockTwice(TinyGPT):
    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        x = self.blocks[0](x, mask)  # an extra call of the first block
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


class CallsBlocksOutOfOrder(TinyGPT):
    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        for block in reversed(self.blocks):
            x = block(x, mask)
        return self.head(self.ln_f(x))


def plan(*stages: tuple[tuple[int, int], int], micro_batches: int = 3) -> Plan:
    return Plan(stages=[{"layers": list(r), "replicas": n} for r, n in stages], micro_batches=micro_batches)


TWO_ONE = plan(((0, 2), 2), ((2, 4), 1))
THREE = plan(((0, 1), 1), ((1, 3), 1), ((3, 4), 1))


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    cache = {}

    def get(model_cls, val=False):
        if (model_cls, val) not in cache:
            cache[model_cls, val] = fit(model_cls, tmp_path_factory.mktemp("ref"), val=val, loader=tokens)
        return cache[model_cls, val]

    return get


# ------------------------------------------------------------------ one process: the surgery


def cut_for(model: nn.Module, p: Plan, rank: int) -> Cut:
    name, container = find_container(model)
    return Cut.apply(model, Chain.of(name, container), p, rank)


def test_a_modulelist_is_found_and_cut_into_blocks_and_placeholders_under_the_original_keys():
    model = TinyGPT()
    assert find_container(model)[0] == "blocks"
    blocks, keys = list(model.blocks), set(model.state_dict())
    weights = {f"blocks.{k}": v.clone() for k, v in model.blocks.state_dict().items()}
    cut = cut_for(model, THREE, rank=1)
    stand_in = model.blocks
    assert type(stand_in) is nn.ModuleList and len(stand_in) == BLOCKS
    assert [type(b) for b in stand_in] == [Placeholder, Block, Block, Placeholder]
    assert stand_in[1] is blocks[1] and stand_in[2] is blocks[2]
    assert len(stand_in[:3]) == 3 and stand_in[:3][1] is blocks[1] and list(stand_in)[3] is stand_in[-1]
    assert stand_in[0].heads == 2  # a placeholder reads the real block's plain attributes
    assert not list(stand_in[0].parameters()) and all(p.is_meta for p in blocks[0].parameters())
    assert set(model.state_dict()) == {k for k in keys if not k.startswith(("blocks.0.", "blocks.3."))}
    assert set(cut.stage.state_dict()) == {
        k[len("blocks.") :] for k in keys if k.startswith(("blocks.1.", "blocks.2."))
    }
    with cut.whole():
        assert model.blocks is cut.chain.containers[0]
    assert model.blocks is stand_in
    cut.restore(weights, torch.device("cpu"))
    assert model.blocks is cut.chain.containers[0] and list(model.blocks) == blocks
    assert all(torch.equal(v, weights[f"blocks.{k}"]) for k, v in model.blocks.state_dict().items())
    assert not blocks[1]._forward_hooks and not blocks[1]._forward_pre_hooks


def test_the_stage_runs_its_blocks_on_what_it_received_and_leaves_after_its_last():
    torch.manual_seed(1)
    model, reference = TinyGPT(), TinyGPT()
    idx = torch.randint(0, VOCAB, (2, T))
    cut = cut_for(model, THREE, rank=1)
    received = torch.randn(2, T, D)
    call = StageCall(1, first=False, last=False, blocks=BLOCKS, received=[received])
    with cut.stage.calling(call), pytest.raises(StageExit):
        model(idx)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    want = reference.blocks[2](reference.blocks[1](received, mask), mask)
    assert call.inputs[0] is received and torch.allclose(call.outputs[0], want)
    assert call.next_block == 3 and [b.calls for b in cut.chain.containers[0]] == [0, 1, 1, 0]


@pytest.mark.parametrize(
    ("model_cls", "message"),
    [
        (CallsBlockTwice, "block 0 was called again after block 0"),
        (CallsBlocksOutOfOrder, "block 3 was called before block 0"),
    ],
)
def test_blocks_called_twice_or_out_of_order_are_refused(model_cls, message):
    model = model_cls()
    cut = cut_for(model, THREE, rank=2)  # the last stage sees every call
    call = StageCall(2, first=False, last=True, blocks=BLOCKS, received=[torch.randn(2, T, D)])
    with (
        cut.stage.calling(call),
        pytest.raises(RuntimeError, match=message + ".*every block of the pipelined ModuleList once"),
    ):
        model(torch.randint(0, VOCAB, (2, T)))


def test_a_step_that_skips_blocks_is_refused_once_it_is_over():
    model = TinyGPT()
    cut = cut_for(model, THREE, rank=2)
    call = StageCall(2, first=False, last=True, blocks=BLOCKS, received=[torch.randn(2, T, D)])
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    with cut.stage.calling(call):
        for block in model.blocks[:3]:
            block(torch.randn(2, T, D), mask)
    with pytest.raises(RuntimeError, match="called 3 of the 4 blocks of the pipelined ModuleList"):
        call.check_called()


class CheckpointsBlocks(TinyGPT):
    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, mask, use_reentrant=False)
        return self.head(self.ln_f(x))


def test_activation_checkpointing_around_a_block_is_refused_in_backward():
    model = CheckpointsBlocks()
    cut = cut_for(model, THREE, rank=2)
    received = torch.randn(2, T, D, requires_grad=True)
    with cut.stage.calling(StageCall(2, first=False, last=True, blocks=BLOCKS, received=[received])):
        loss = model(torch.randint(0, VOCAB, (2, T))).sum()
    # Out of the call, as the executor leaves the stage before the backward.
    with pytest.raises(RuntimeError, match="block 3 of the pipelined ModuleList was recomputed during backward"):
        loss.backward()


def test_plan_auto_takes_a_modulelist_and_the_plan_search_refuses_it_naming_the_fix():
    from dapple_lightning.strategy._refusals import check_before_start
    from dapple_lightning.surgery import find_sequential

    model = TinyGPT()  # plan='auto' profiles its blocks: tests/test_autoplan_blocks.py
    assert check_before_start(model, "32-true", None, "auto", 2).single() == ("blocks", model.blocks)
    fix = r"'blocks', is an nn.ModuleList: the plan search .* plan='auto' .* explicit plan"
    with pytest.raises(TypeError, match=fix):
        find_sequential(model)


# ------------------------------------------------------------ real processes vs one device


@pytest.mark.parametrize("shape", ["2:1", "1:1:1"])
def test_nanogpt_style_blocks_match_single_device(shape, tmp_path, single_device):
    p, val = (TWO_ONE, False) if shape == "2:1" else (THREE, True)
    got = fit(TinyGPT, tmp_path, plan=p, val=val, loader=tokens, strategy_kwargs={"sequential": "blocks"})
    assert_same(got, single_device(TinyGPT, val=val))


def test_keyword_side_inputs_and_tuple_activations_match_single_device(tmp_path, single_device):
    assert_same(fit(PairGPT, tmp_path, plan=TWO_ONE, loader=tokens), single_device(PairGPT))


class CountCalls(Callback):
    """Writes, on every rank, how often each block's own forward ran there."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        calls = [block.calls for block in pl_module.blocks]  # placeholders read their meta block's count
        (self.folder / f"calls{trainer.global_rank}.json").write_text(json.dumps(calls))


def test_each_block_runs_only_on_its_stages_ranks(tmp_path):
    fit(TinyGPT, tmp_path, plan=TWO_ONE, loader=tokens, max_steps=2, callbacks=(CountCalls(tmp_path),))
    per_rank = [json.loads((tmp_path / f"calls{rank}.json").read_text()) for rank in range(3)]
    each = 2 * TWO_ONE.micro_batches  # steps x micro-batches
    assert per_rank == [[each, each, 0, 0], [each, each, 0, 0], [0, 0, each, each]]


def test_a_checkpoint_saved_under_the_plan_loads_on_one_device(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    _, trained = fit(
        TinyGPT, tmp_path, plan=THREE, loader=tokens, max_steps=2, enable_checkpointing=True, callbacks=(saver,)
    )
    state = torch.load(tmp_path / "ckpt" / "epoch=0-step=2.ckpt", weights_only=False)["state_dict"]
    assert list(state) == list(TinyGPT().state_dict())
    fresh = TinyGPT()
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize(
    ("model_cls", "message"),
    [
        (CallsBlockTwice, "block 0 was called again after block 0"),
        (CallsBlocksOutOfOrder, "block 3 was called before block 0"),
    ],
    ids=["twice", "out-of-order"],
)
def test_the_strategy_refuses_bad_block_calls_at_the_first_micro_batch(model_cls, message, tmp_path):
    # Every rank sees the bad call before its own blocks end, so each refuses with the same message.
    with pytest.raises(Exception, match=message):
        fit(model_cls, tmp_path, plan=plan(((0, 2), 1), ((2, 4), 1)), loader=tokens, max_steps=1)


class HFGPT2(LightningModule):
    """Hugging Face's GPT-2 (blocks in model.transformer.h, wte tied to lm_head, both outside them)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        config = GPT2Config(
            n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
        )
        config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
        self.model = GPT2LMHeadModel(config)
        from test_hf_llama import Counter

        self.counters = [Counter() for _ in self.model.transformer.h]  # read by CountMLPCalls
        for block, counter in zip(self.model.transformer.h, self.counters):
            block.mlp.register_forward_hook(counter)

    def training_step(self, batch, batch_idx):
        idx, _ = batch
        loss = self.model(input_ids=idx, labels=idx, use_cache=False).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("shape", ["2:1", "1:1:1"])
def test_hugging_face_gpt2_matches_single_device_and_runs_each_block_on_its_stage_only(shape, tmp_path, single_device):
    from test_hf_llama import CountCalls as CountMLPCalls

    p = TWO_ONE if shape == "2:1" else THREE
    got = fit(
        HFGPT2,
        tmp_path,
        plan=p,
        loader=tokens,
        callbacks=(CountMLPCalls(tmp_path),),
        strategy_kwargs={"sequential": "model.transformer.h"},
    )
    assert_same(got, single_device(HFGPT2))
    each = 4 * p.micro_batches  # steps x micro-batches
    for rank in range(p.world_size):
        stage = p.stages[p.stage_of(rank)]
        calls = json.loads((tmp_path / f"calls{rank}.json").read_text())
        assert calls == [each if stage.start <= i < stage.end else 0 for i in range(BLOCKS)], rank
