"""plan='auto''s trials of plans with several stages per rank group (chunks), on real processes (gloo):
each rank runs its group's stages from one program, holds their layers (and no others) on the
device, times every stage's passes, and leaves the model as it was. What the shortlist offers and
why is tested without processes (tests/planner/test_chunk_offers.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from test_modulelist import BLOCKS, TinyGPT, tokens

from dapple_lightning import Plan
from dapple_lightning.surgery import Chain, unchanged

from distributed import run_ranks
from models import MLP, loader

PLANS = {
    "interleaved": lambda layers: Plan.chunked(layers, "1:1", micro_batches=2),
    "zb-v": lambda layers: Plan.chunked(layers, "1:1", layout="v", micro_batches=4),
    "v-half": lambda layers: Plan.chunked(layers, "1:1", layout="v", micro_batches=4, schedule="v-half"),
}


def trials_of_chunks(rank: int, world_size: int, model_name: str) -> dict:
    """The chunked plans and a plain pipeline in turns, as plan='auto' runs its shortlist."""
    import contextlib

    from dapple_lightning.autoplan import optimizer_factory
    from dapple_lightning.strategy._auto import AutoSetting, Trials
    from dapple_lightning.strategy._pipelines import PipelineBuilder
    from dapple_lightning.strategy._resident import parameter_bytes
    from dapple_lightning.strategy._step import PipelinedSteps

    if model_name == "modulelist":
        model, path, batch = TinyGPT(), "blocks", next(iter(tokens(12)))
    else:
        model, path, batch = MLP(), "layers", next(iter(loader(12)))
    container = model.get_submodule(path)
    layers = list(container)
    device = torch.device("cpu")
    pipelines = PipelineBuilder(model, rank, device, timedelta(seconds=60))
    setting = AutoSetting(model, rank, device, 1, pipelines, PipelinedSteps(model, device), contextlib.nullcontext)
    plans = [make(len(layers)) for make in PLANS.values()]
    plans.append(Plan.straight(len(layers), 2, micro_batches=2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with unchanged(model):
        trials = Trials(setting, batch, Chain.of(path, container), optimizer_factory(model))
        try:
            measured, on_device = [], []
            for plan in (*plans, plans[0]):  # the first again: its pipeline is kept from its first turn
                measured.append(trials(plan))
                mine = [i for s in plan.stages_of(rank) for i in range(plan.stages[s].start, plan.stages[s].end)]
                on_device.append((trials.resident.held_bytes, parameter_bytes([layers[i] for i in mine])))
        finally:
            trials.close()
    return {
        "plans": plans,
        "measured": measured,
        "on_device": on_device,
        "released": trials.resident.held_bytes,
        "restored": model.get_submodule(path) is container and all(not m._forward_hooks for m in layers),
        "unchanged": all(torch.equal(v, before[k]) for k, v in model.state_dict().items()),
    }


@pytest.mark.parametrize("model_name", ["modulelist", "sequential"])
def test_trials_measure_chunked_plans_per_stage_and_put_the_model_back(model_name):
    results = run_ranks(trials_of_chunks, 2, model_name)
    plans = results[0]["plans"]
    for r in results:
        for plan, measured in zip([*plans, plans[0]], r["measured"]):
            assert measured.step_s > 0
            assert len(measured.forward_s) == len(measured.backward_s) == plan.num_stages
            assert all(t > 0 for t in (*measured.forward_s, *measured.backward_s)), (plan.describe(), measured)
            if plan.chunks > 1:
                # The timeline labels a rank's passes with its group: each stage gets its group's.
                for s in range(plan.num_stages):
                    same = [k for k in range(plan.num_stages) if plan.group_of_stage(k) == plan.group_of_stage(s)]
                    assert {measured.forward_s[k] for k in same} == {measured.forward_s[s]}
        # Each turn holds the rank's stages on the device (both chunks of its group) and nothing else.
        assert all(held == want > 0 for held, want in r["on_device"]), r["on_device"]
        assert r["released"] == 0 and r["restored"] and r["unchanged"]
    # Every rank reads the same figures (gathered from all).
    assert results[0]["measured"][0].forward_s == results[1]["measured"][0].forward_s
    if model_name == "modulelist":
        assert BLOCKS == 4 and plans[0].stages_of(0) == (0, 2) and plans[1].stages_of(0) == (0, 3)


def choose_with_a_chunked_offer(rank: int, world_size: int, chunks_refused: str | None) -> dict:
    """``autoplan.choose_plan`` with real trials on MLP's layers, the shortlist made from a profile in
    which a chunked plan is predicted as fast as the best pipeline (what the CPU's timings say of
    this tiny model depends on the machine's load; the trials, refining and report do not)."""
    import contextlib

    import dapple_lightning.autoplan as autoplan
    from dapple_lightning.autoplan import choose_plan, optimizer_factory
    from dapple_lightning.planner import GB, Cluster, LayerProfile, ModelProfile
    from dapple_lightning.strategy._auto import AutoSetting, Trials
    from dapple_lightning.strategy._pipelines import PipelineBuilder
    from dapple_lightning.strategy._step import PipelinedSteps

    crafted = ModelProfile(tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**3, 10**9, weight_s=1e-3) for i in range(7)), 4)
    cluster = Cluster.v100(1, 2, memory_bytes=1e12, intra_p2p_bw=10**6 * GB)
    real = autoplan.shortlist_with_levers
    autoplan.shortlist_with_levers = lambda _profile, _cluster, batch, **options: real(
        crafted, cluster, batch, **options
    )
    model, device = MLP(), torch.device("cpu")
    batch = next(iter(loader(12)))
    pipelines = PipelineBuilder(model, rank, device, timedelta(seconds=60))
    setting = AutoSetting(model, rank, device, 1, pipelines, PipelinedSteps(model, device), contextlib.nullcontext)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with unchanged(model):
        trials = Trials(setting, batch, Chain.of("layers", model.layers), optimizer_factory(model))
        try:
            chosen = choose_plan(
                list(model.layers),
                batch[0][:6],
                device,
                global_batch=12,
                trial=trials,
                optimizer=optimizer_factory(model),
                chunks_refused=chunks_refused,
            )
        finally:
            trials.close()
    return {
        "chosen": chosen,
        "report": chosen.report(),
        "unchanged": all(torch.equal(v, before[k]) for k, v in model.state_dict().items()),
    }


def test_auto_measures_an_offered_chunked_plan_and_says_why():
    results = run_ranks(choose_with_a_chunked_offer, 2, None)
    chosen = results[0]["chosen"]
    assert results[1]["chosen"].plan == chosen.plan  # rank 0's choice, on every rank
    offered = [t for t in chosen.trials if t.plan.chunks > 1]
    assert len(offered) == 1 and offered[0].measured_step_s > 0, [t.plan.describe() for t in chosen.trials]
    plan = offered[0].plan
    assert plan.schedule == "zb-v" and plan.layout == "v" and plan.num_groups == 2
    ((offer, why),) = chosen.offers
    assert offer == plan and "zb-v with 2 stages per group (v): predicted" in why
    state = "chosen" if chosen.plan == plan else "offered"
    assert f"{state} {plan.describe()}: {why}" in results[0]["report"]
    # The refined profile and the prediction price whichever plan was chosen, chunked or not.
    assert chosen.predicted_step_s > 0 and len(chosen.stage_memory_bytes) == chosen.plan.num_stages
    assert all(r["unchanged"] for r in results)


def test_auto_offers_no_chunked_plan_to_a_run_that_cannot_train_one():
    results = run_ranks(choose_with_a_chunked_offer, 2, "recovery is on")
    chosen = results[0]["chosen"]
    assert chosen.trials and all(t.plan.chunks == 1 for t in chosen.trials) and chosen.offers == ()
    assert "plans with several stages per rank group were not offered: recovery is on" in results[0]["report"]
