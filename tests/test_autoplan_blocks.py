"""plan='auto' with an nn.ModuleList of blocks looped in forward (nanoGPT style, Hugging Face GPT-2).

One process: the blocks profiled as a chain through the user's step (one entry per block, the
hidden state's bytes, weights untouched), what the loop passes on, refusals. Real processes
(gloo): a 2-stage plan's trials with the stage's blocks standing in, and whole fits under
plan='auto' against single-device Lightning on the same batches.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from test_modulelist import BLOCKS, HFGPT2, CallsBlocksOutOfOrder, D, PairGPT, T, TinyGPT, tokens
from torch import nn

from dapple_lightning import DappleStrategy, Plan
from dapple_lightning.autoplan import small_batch_of
from dapple_lightning.microbatch import Rows, slice_batch
from dapple_lightning.planner import profile_layers
from dapple_lightning.strategy._auto_blocks import BlockChain
from dapple_lightning.surgery import Chain, unchanged

from distributed import run_ranks
from harness import assert_same, fit

ROWS = 8
SMALL = small_batch_of(ROWS)  # the smaller batch plan='auto' profiles at, and records the step at

MODELS = {
    "nanogpt": (TinyGPT, "blocks", D, 1),
    "pairs-by-keyword": (PairGPT, "blocks", D, 2),  # tuple activations, keyword side inputs
    "hf-gpt2": (HFGPT2, "model.transformer.h", 32, 1),
}


def chain_of(model: LightningModule, path: str, rows: int = ROWS, loader=tokens) -> BlockChain:
    batch = next(iter(loader(rows)))
    step = lambda n: model.training_step(slice_batch(batch, Rows(0, n)), 0)  # noqa: E731
    return BlockChain(model, Chain.of(path, model.get_submodule(path)), step, rows)


def hooks(blocks: nn.ModuleList) -> int:
    return sum(len(b._forward_hooks) + len(b._forward_pre_hooks) for b in blocks)


# ------------------------------------------------------------------ one process: the profile


@pytest.mark.parametrize("name", list(MODELS))
def test_the_block_profile_has_one_entry_per_block_with_the_hidden_states_bytes(name):
    model_cls, path, width, tensors = MODELS[name]
    torch.manual_seed(0)
    model = model_cls()
    blocks = model.get_submodule(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with unchanged(model):
        chain = chain_of(model, path)
        profile = chain.named(profile_layers(chain.layers, chain.sample_input, repeats=2, warmup=1, small_batch=SMALL))
        outside = chain.step_outside(ROWS)
    assert profile.num_layers == BLOCKS and profile.profile_batch_size == ROWS
    assert [layer.name for layer in profile.layers] == [f"{i}:{type(b).__name__}" for i, b in enumerate(blocks)]
    for layer, block in zip(profile.layers, blocks):
        assert layer.forward_s > 0 and layer.backward_s > 0
        assert layer.activation_bytes == tensors * ROWS * T * width * 4  # the hidden state, fp32
        assert layer.param_bytes == sum(p.numel() * 4 for p in block.parameters())
    assert outside[0] > 0 and outside[1] > 0  # embeddings, head and loss around the blocks
    # The step ran with hooks and stand-ins; afterwards the model is as it was built.
    assert model.get_submodule(path) is blocks and hooks(blocks) == 0
    assert all(p.grad is None for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class ReturnsPair(nn.Module):
    """A block returning (hidden, extra), of which the loop passes on only the hidden state."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(D, D)

    def forward(self, x, scale):
        h = torch.tanh(self.mix(x)) * scale
        return h, h.sum(dim=-1)


class LoopTakesFirst(TinyGPT):
    def make_block(self) -> nn.Module:
        return ReturnsPair()

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.blocks:
            x, _ = block(x, scale=0.5)
        return self.head(self.ln_f(x))


def test_the_chain_follows_what_the_loop_passes_on_to_the_next_block():
    model = LoopTakesFirst()
    with unchanged(model):
        chain = chain_of(model, "blocks")
        profile = profile_layers(chain.layers, chain.sample_input, repeats=1, warmup=0)
        outside = chain.step_outside(ROWS)  # the loop unpacks each replayed block's pair as it did the block's
    assert chain.picks == [0, 0, 0, None]  # the last block's whole output goes on to the step
    hidden = ROWS * T * D * 4
    assert [layer.activation_bytes for layer in profile.layers] == [hidden] * 3 + [hidden + ROWS * T * 4]
    assert outside[0] > 0 and outside[1] > 0


def test_side_inputs_are_the_steps_own_at_each_batch_size():
    model = TinyGPT()
    chain = chain_of(model, "blocks")
    mask = chain.calls(SMALL)[2].args[0]
    assert mask.shape == (T, T) and torch.equal(mask, chain.calls(ROWS)[2].args[0])  # not sliced to rows
    with pytest.raises(ValueError, match=r"recorded on \[1, 8\] rows, not 3"):
        chain.calls(3)


def test_blocks_called_out_of_order_are_refused_while_profiling():
    model = CallsBlocksOutOfOrder()
    with pytest.raises(RuntimeError, match="and it called block 3 before block 0; dapple needs forward to call"):
        chain_of(model, "blocks")
    assert hooks(model.blocks) == 0


# ------------------------------------------------------- real processes: trials, whole fits


def trials_of_blocks(rank: int, world_size: int) -> dict:
    """Run a 2-stage plan and data parallelism in turns on TinyGPT's blocks, as plan='auto' does."""
    import contextlib

    from dapple_lightning.autoplan import optimizer_factory
    from dapple_lightning.strategy._auto import AutoSetting, Trials
    from dapple_lightning.strategy._pipelines import PipelineBuilder
    from dapple_lightning.strategy._resident import parameter_bytes
    from dapple_lightning.strategy._step import PipelinedSteps

    model, device = TinyGPT(), torch.device("cpu")
    blocks = model.blocks
    pipelines = PipelineBuilder(model, rank, device, timedelta(seconds=60))
    setting = AutoSetting(model, rank, device, 1, pipelines, PipelinedSteps(model, device), contextlib.nullcontext)
    pipe = Plan(stages=[{"layers": [0, 2], "replicas": 1}, {"layers": [2, 4], "replicas": 1}], micro_batches=2)
    dp = Plan.data_parallel(BLOCKS, world_size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with unchanged(model):
        trials = Trials(setting, next(iter(tokens(12))), Chain.of("blocks", blocks), optimizer_factory(model))
        try:
            measured, on_device = [], []
            for plan in (pipe, dp, pipe):
                measured.append(trials(plan))
                stage = plan.stages[plan.stage_of(rank)]
                # The blocks on the device after the plan's turn, against the stage's share of them.
                on_device.append((trials.resident.held_bytes, parameter_bytes(list(blocks)[stage.start : stage.end])))
            held = [type(b).__name__ for b in model.blocks]  # the 2-stage plan's stand-in, last in turn
        finally:
            trials.close()
    return {
        "measured": measured,
        "on_device": on_device,
        "peak": trials.resident.peak_bytes,
        "released": trials.resident.held_bytes,
        "block_bytes": parameter_bytes(list(blocks)),
        "held": held,
        "restored": model.blocks is blocks and hooks(blocks) == 0,
        "unchanged": all(torch.equal(v, before[k]) for k, v in model.state_dict().items()),
    }


def test_trials_run_a_two_stage_plan_on_the_stages_blocks_and_put_the_list_back():
    results = run_ranks(trials_of_blocks, 2)
    assert [r["held"] for r in results] == [
        ["Block", "Block", "Placeholder", "Placeholder"],
        ["Placeholder", "Placeholder", "Block", "Block"],
    ]
    for r in results:
        pipe, dp, again = r["measured"]
        assert len(pipe.forward_s) == 2 and all(t > 0 for t in (*pipe.forward_s, *pipe.backward_s))
        assert len(dp.forward_s) == 1 and pipe.step_s > 0 and dp.step_s > 0 and again.step_s > 0
        assert r["restored"] and r["unchanged"]
        # Each turn holds its stage's blocks on the device and no others (data parallelism's stage is all of
        # them); none stay once the trials are over.
        half, whole = r["block_bytes"] // 2, r["block_bytes"]
        assert r["on_device"] == [(half, half), (whole, whole), (half, half)]
        assert r["peak"] == whole and r["released"] == 0


class WritesAutoPlan(Callback):
    """Rank 0 writes what plan='auto' chose and the profile behind it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        chosen = trainer.strategy.auto_plan
        if trainer.global_rank == 0:
            info = {
                "report": chosen.report(),
                "plan": chosen.plan.to_dict(),
                "layers": [layer.name for layer in chosen.profile.layers],
                "trials": [t.plan.describe() for t in chosen.trials],
            }
            (self.folder / "auto.json").write_text(json.dumps(info))


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    cache = {}

    def get(model_cls):
        if model_cls not in cache:
            cache[model_cls] = fit(model_cls, tmp_path_factory.mktemp("ref"), loader=tokens)
        return cache[model_cls]

    return get


@pytest.mark.parametrize("name", ["hf-gpt2", "pairs-by-keyword"])
def test_plan_auto_trains_blocks_like_single_device(name, tmp_path, single_device):
    model_cls, path, _, _ = MODELS[name]
    if name == "hf-gpt2":
        pytest.importorskip("transformers")
    # plan="auto", the default; GPT-2's blocks (model.transformer.h) are found without being named.
    strategy = DappleStrategy(start_method="forkserver", sequential=None if name == "hf-gpt2" else path)
    got = fit(model_cls, tmp_path, loader=tokens, devices=2, strategy=strategy, callbacks=(WritesAutoPlan(tmp_path),))
    assert_same(got, single_device(model_cls))
    info = json.loads((tmp_path / "auto.json").read_text())
    assert info["report"].startswith(f"dapple plan='auto': profiled {BLOCKS} layers")
    assert Plan.coerce(info["plan"]).table() in info["report"]
    block = type(model_cls().get_submodule(path)[0]).__name__
    assert info["layers"] == [f"{i}:{block}" for i in range(BLOCKS)]


def test_a_key_value_cache_among_the_side_inputs_is_copied_for_every_profiled_call():
    pytest.importorskip("transformers")
    import test_hf_llama  # use_cache is on in its config: every decoder layer gets the step's DynamicCache

    model = test_hf_llama.Llama()
    with unchanged(model):
        chain = chain_of(model, test_hf_llama.CONTAINER, loader=test_hf_llama.tokens)
        profile = profile_layers(chain.layers, chain.sample_input, repeats=2, warmup=1, small_batch=SMALL)
    assert profile.num_layers == test_hf_llama.LAYERS and all(layer.forward_s > 0 for layer in profile.layers)
    for index, call in enumerate(chain.calls(ROWS)):
        cache = call.kwargs["cache"]
        # As the step's call found it: earlier layers' keys and values, none of its own; the
        # profiled calls appended theirs to copies.
        assert [cache.get_seq_length(i) for i in range(index + 1)] == [test_hf_llama.T] * index + [0]
