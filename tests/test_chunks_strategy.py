"""Chunked plans through the strategy: same training as one device, checkpoints both ways."""

from __future__ import annotations

import json

import pytest
import torch

from dapple_lightning import Plan
from dapple_lightning.strategy._refusals import _chunks_refusal

import models
from harness import SaveAtEnd, assert_close_tree, assert_same, fit, single_device_resumed

INTERLEAVED_2_1 = Plan(
    stages=[
        {"layers": [0, 2], "replicas": 2},
        {"layers": [2, 4]},
        {"layers": [4, 6], "replicas": 2},
        {"layers": [6, 7]},
    ],
    chunks=2,
    micro_batches=4,
    schedule="interleaved",
)
ZB_V_1_1 = Plan.chunked(7, "1:1", layout="v", micro_batches=4)
PLAIN_1_1 = Plan(stages=[{"layers": [0, 3]}, {"layers": [3, 7]}], micro_batches=2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-device Lightning: 4 steps, checkpoint, then resumed to 8 steps."""
    return single_device_resumed(tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize("plan", [INTERLEAVED_2_1, ZB_V_1_1], ids=["interleaved-2:1", "zb-v-1:1"])
def test_a_chunked_checkpoint_is_the_single_device_one_and_resumes_under_a_plain_plan(plan, reference, tmp_path):
    ref_ckpt, ref_first, ref_resumed = reference
    ckpt = tmp_path / "chunked.ckpt"
    first = fit(models.ScheduledMLP, tmp_path / "a", plan=plan, callbacks=(SaveAtEnd(ckpt),))
    assert_same(first, ref_first)
    got, want = torch.load(ckpt, weights_only=False), torch.load(ref_ckpt, weights_only=False)
    assert list(got["state_dict"]) == list(want["state_dict"])
    assert_close_tree(got["state_dict"], want["state_dict"])
    assert_close_tree(got["optimizer_states"], want["optimizer_states"])
    resumed = fit(models.ScheduledMLP, tmp_path / "b", plan=PLAIN_1_1, max_steps=8, ckpt_path=str(ckpt))
    assert_same(resumed, ref_resumed)


def test_a_plain_checkpoint_resumes_under_a_chunked_plan(reference, tmp_path):
    _, _, ref_resumed = reference
    ckpt = tmp_path / "plain.ckpt"
    fit(models.ScheduledMLP, tmp_path / "a", plan=PLAIN_1_1, callbacks=(SaveAtEnd(ckpt),))
    resumed = fit(models.ScheduledMLP, tmp_path / "b", plan=INTERLEAVED_2_1, max_steps=8, ckpt_path=str(ckpt))
    assert_same(resumed, ref_resumed)


def test_validation_under_a_chunked_plan_matches_one_device(tmp_path):
    want = fit(models.MLP, tmp_path / "single", val=True)
    got = fit(models.MLP, tmp_path / "zb-v", plan=ZB_V_1_1, val=True)
    assert_same(got, want)


def test_the_log_replay_is_refused_with_chunks_before_any_process_starts():
    # Recovery from a replica runs chunked plans (test_recovery.py); replaying a rank's stages does not yet.
    assert _chunks_refusal(PLAIN_1_1, logging=True) is None
    assert _chunks_refusal(ZB_V_1_1, logging=False) is None
    assert "use recovery='auto'" in _chunks_refusal(ZB_V_1_1, logging=True)


@pytest.mark.parametrize(
    "plan",
    [Plan.chunked(4, "1:1", micro_batches=4), Plan.chunked(4, "2:1", layout="v", micro_batches=4)],
    ids=["interleaved-1:1", "zb-v-2:1"],
)
def test_hugging_face_llama_under_a_chunked_plan_matches_one_device(plan, tmp_path):
    """The decoder layers of a tiny LlamaForCausalLM (a ModuleList its forward loops over, with side
    inputs), two stages per rank: each stage's layers compute only in that stage's calls."""
    pytest.importorskip("transformers")
    from test_hf_llama import CONTAINER, CountCalls, Llama, tokens

    want = fit(Llama, tmp_path / "single", loader=tokens)
    counts = tmp_path / "counts"
    counts.mkdir()
    got = fit(
        Llama,
        tmp_path / "chunked",
        plan=plan,
        loader=tokens,
        strategy_kwargs={"sequential": CONTAINER},
        callbacks=(CountCalls(counts),),
    )
    assert_same(got, want)
    # Four steps of four micro-batches: each layer's MLP ran once per micro-batch, on its own stage's ranks only.
    per_rank = [json.loads((counts / f"calls{rank}.json").read_text()) for rank in range(plan.world_size)]
    for rank, calls in enumerate(per_rank):
        mine = {i for s in plan.stages_of(rank) for i in range(plan.stages[s].start, plan.stages[s].end)}
        assert calls == [16 if layer in mine else 0 for layer in range(4)], rank
