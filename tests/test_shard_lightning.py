"""Sharded stages under Lightning: a Hugging Face ModuleList model against one device."""

from __future__ import annotations

import pytest

from dapple_lightning import Plan

from harness import assert_same, fit

transformers = pytest.importorskip("transformers")

from test_hf_llama import CONTAINER, Llama, tokens  # noqa: E402


def sharded(first: str | None, replicas: int = 2) -> Plan:
    return Plan(
        stages=[{"layers": [0, 3], "replicas": replicas, "shard": first}, {"layers": [3, 4], "replicas": 1}],
        micro_batches=2,
    )


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    return fit(Llama, tmp_path_factory.mktemp("ref"), loader=tokens, val=True, gradient_clip_val=0.5)


# Llama's SGD with momentum, not Adam: Adam's first steps turn float rounding into visible weight
# differences (see test_hf_llama); Adam and AdamW are compared on a smaller model in test_shard.
@pytest.mark.parametrize("mode", ["full", "grads"])
def test_a_sharded_llama_stage_trains_as_one_device(mode, tmp_path, single_device):
    plan = sharded(mode)
    got = fit(
        Llama,
        tmp_path,
        plan=plan,
        loader=tokens,
        val=True,
        gradient_clip_val=0.5,
        strategy_kwargs={"sequential": CONTAINER},
    )
    assert_same(got, single_device)


def test_three_replicas_sharding_only_the_first_stage_accumulate_batches_as_one_device(tmp_path):
    import models

    plan = Plan(
        stages=[{"layers": [0, 4], "replicas": 3, "shard": "full"}, {"layers": [4, 7], "replicas": 1}],
        micro_batches=2,
    )
    options = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05, "max_steps": 3}
    want = fit(models.ScheduledMLP, tmp_path / "one", **options)
    got = fit(models.ScheduledMLP, tmp_path / "dapple", plan=plan, **options)
    assert_same(got, want)


@pytest.mark.parametrize("mode", ["full", "grads"])
def test_gpt2_with_tied_embeddings_across_stages_and_a_sharded_stage_trains_as_one_device(mode, tmp_path):
    """GPT-2's token embedding (used before the first block) is tied to its LM head (after the last
    block): one parameter, its gradient summed over every rank, while the first stage's blocks shard."""
    from test_modulelist import HFGPT2
    from test_modulelist import tokens as gpt2_tokens

    model = HFGPT2()
    assert model.model.lm_head.weight is model.model.transformer.wte.weight  # tied, as built
    plan = Plan(
        stages=[{"layers": [0, 2], "replicas": 2, "shard": mode}, {"layers": [2, 4], "replicas": 1}],
        micro_batches=2,
    )
    want = fit(HFGPT2, tmp_path / "one", loader=gpt2_tokens, gradient_clip_val=0.5)
    got = fit(
        HFGPT2,
        tmp_path / "dapple",
        plan=plan,
        loader=gpt2_tokens,
        gradient_clip_val=0.5,
        strategy_kwargs={"sequential": "model.transformer.h"},
    )
    assert_same(got, want)
