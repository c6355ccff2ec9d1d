"""The search space with chunked schedules: exactly the valid chunked plans, sampled, enqueued and
read back; the planner's chunked offers seeded when the space holds them."""

from __future__ import annotations

import itertools

import optuna
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_space import brute_force, sample

from dapple_lightning.plan import LAYOUTS, Plan, Stage
from dapple_lightning.planner import CostModel, LayerProfile, ModelProfile, estimate_chunked
from dapple_lightning.search import PlanSpace, local_cluster, params_from_plan, plan_from_params, planner_seeds
from dapple_lightning.search._loop import existing_study, open_study
from dapple_lightning.search._seed import CHUNKED_EXHAUSTIVE, EXHAUSTIVE, enqueue_planner_seeds, memory_refusal
from dapple_lightning.trials import Fingerprint

optuna.logging.set_verbosity(optuna.logging.WARNING)

MIXED = ("dapple", "interleaved", "zb-v", "v-half")


def brute_force_chunked(num_layers, world_size, global_batch, micro_batches, schedule, chunks, max_stages=None):
    """Every chunked plan: all group counts >= 2, replica vectors and cut sets, kept when ``Plan``
    accepts them (its own checks are the schedule's rules) and every slice is non-empty."""
    layout = next(name for name, names in LAYOUTS.items() if schedule in names)
    out = set()
    for m, groups in itertools.product(micro_batches, range(2, world_size + 1)):
        stages = groups * chunks
        if stages > num_layers or (max_stages is not None and stages > max_stages):
            continue
        for replicas in itertools.product(range(1, world_size + 1), repeat=groups):
            if sum(replicas) != world_size or m * max(replicas) > global_batch:
                continue
            for inner in itertools.combinations(range(1, num_layers), stages - 1):
                cuts = [0, *inner, num_layers]
                owner = [s % groups if layout == "looped" else min(s, 2 * groups - 1 - s) for s in range(stages)]
                built = [Stage(a, b, replicas[owner[s]]) for s, (a, b) in enumerate(itertools.pairwise(cuts))]
                try:
                    out.add(Plan(built, m, schedule, chunks=chunks, layout=layout))
                except ValueError:
                    continue  # the schedule's rule on micro-batches
    return out


@pytest.mark.parametrize(
    ("layers", "world", "batch", "micro", "chunks", "max_stages"),
    [
        (6, 2, 8, None, 2, None),
        (8, 3, 12, None, 2, None),
        (9, 3, 12, (2, 3, 4, 6), 3, None),
        (8, 4, 8, (2, 4, 8), 2, 6),  # max_stages bounds groups x chunks
    ],
)
def test_enumeration_is_exactly_the_valid_plans_with_chunked_schedules(layers, world, batch, micro, chunks, max_stages):
    space = PlanSpace(layers, world, batch, micro, MIXED, max_stages, chunks)
    plans = list(space.plans())
    assert len(plans) == len(set(plans)) == space.size
    expected = brute_force(layers, world, batch, space.schedule_micro_batches("dapple"), ("dapple",), max_stages)
    for schedule in MIXED[1:]:
        per = 2 if schedule != "interleaved" else chunks
        expected |= brute_force_chunked(layers, world, batch, space.micro_batches, schedule, per, max_stages)
    assert set(plans) == expected
    assert {p.schedule for p in plans} == set(MIXED)


@pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")
@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_sampled_chunked_plans_are_valid_and_read_back_from_their_parameters(sampler):
    seen = sample(PlanSpace(8, 3, 12, None, MIXED), sampler, 120)
    assert {p.schedule for p in seen} == set(MIXED)
    assert {p.chunks for p in seen} == {1, 2}


def test_every_chunked_plan_round_trips_through_enqueued_params():
    space = PlanSpace(6, 3, 12, (2, 4, 6), ("interleaved", "v-half"))
    plans = list(space.plans())
    assert plans and all(p.chunks == 2 for p in plans)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for plan in plans:
        study.enqueue_trial(space.params(plan))
    got: list[Plan] = []
    study.optimize(lambda t: got.append(space.suggest(t)) or 0.0, n_trials=len(plans))
    assert got == plans


def test_a_chunked_plans_parameters_name_its_shape():
    plan = Plan.chunked(8, "2:1", layout="v", micro_batches=4)
    assert params_from_plan(plan) == {
        "schedule": "zb-v",
        "chunks": 2,
        "zb-v_micro_batches": 4,
        "zb-v_m4_groups": 2,
        "s2_r0": 2,
        "s4_c1": 2,
        "s4_c2": 4,
        "s4_c3": 6,
    }
    assert PlanSpace(8, 3, 12, schedules=("zb-v",)).params(plan) == params_from_plan(plan)


def test_chunked_plans_outside_the_space_are_refused_with_the_reason():
    space = PlanSpace(12, 2, 12, (2, 3, 4, 6), ("dapple", "interleaved"), chunks=3)
    with pytest.raises(ValueError, match=r"searches 'interleaved' with 3 \(chunks: 3\)"):
        space.params(Plan.chunked(12, "1:1", micro_batches=4))
    with pytest.raises(ValueError, match="micro-batch count 8 is not searched under 'interleaved'"):
        space.params(Plan.chunked(12, "1:1", chunks=3, micro_batches=8))
    four = PlanSpace(12, 3, 12, (6,), ("interleaved",), max_stages=4)
    with pytest.raises(ValueError, match=r"has 3 rank groups; with 6 micro-batches the space searches \[2\]"):
        four.params(Plan.chunked(12, "1:1:1", micro_batches=6))
    with pytest.raises(ValueError, match="'zb-v' is not searched"):
        space.params(Plan.chunked(12, "1:1", layout="v", micro_batches=4))
    assert space.schedule_micro_batches("interleaved") == (2, 4, 6)
    assert space.schedule_micro_batches("dapple") == (2, 3, 4, 6)


def test_a_chunked_schedule_that_fits_no_micro_batch_count_is_refused_naming_why():
    with pytest.raises(ValueError, match=r"schedule 'zb-v' fits no micro-batch count of \[1, 2, 3\].*at least 2G"):
        PlanSpace(8, 2, 6, (1, 2, 3), ("dapple", "zb-v"))
    with pytest.raises(ValueError, match=r"'interleaved' fits no .*at most 1 groups here"):
        PlanSpace(3, 2, 8, None, ("interleaved",))  # 3 layers hold one group of 2 chunks


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(2, 9),
    world=st.integers(2, 5),
    batch=st.integers(2, 16),
    chunks=st.integers(2, 3),
    data=st.data(),
)
def test_size_formula_matches_enumeration_with_chunks(layers, world, batch, chunks, data):
    try:
        space = PlanSpace(layers, world, batch, schedules=("interleaved", "zb-v"), chunks=chunks)
    except ValueError:
        # Then no group count >= 2 fits some schedule: too few layers for two groups, or no count M
        # with a group of at most B // M replicas.
        return
    plans = list(space.plans())
    assert len(plans) == space.size > 0
    plan = data.draw(st.sampled_from(plans))
    assert plan_from_params(space.params(plan), num_layers=layers, world_size=world) == plan


# Eight equal layers with a gigabyte of weights each on 2 independent devices: data parallelism's
# all-reduce is slow, the pipelines' bubble is what is left to win back (as in test_seed_chunks).
PROFILE = ModelProfile(
    tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**3, 10**9, weight_s=1e-3) for i in range(8)), 4
).to_dict()


PROFILE_40 = ModelProfile(
    tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**3, 10**8, weight_s=1e-3) for i in range(40)), 4
).to_dict()


def test_a_small_space_is_ranked_whole_and_its_chunked_plans_can_be_the_planners_picks():
    space = PlanSpace(8, 2, 8, (4, 8), ("dapple", "interleaved", "zb-v", "v-half"), max_stages=4)
    study = optuna.create_study()
    enqueue_planner_seeds(study, space, PROFILE, 3, None, lambda _: None, memory_limit=1e12)
    queued = study.get_trials(deepcopy=False)
    plans = [plan_from_params(t.system_attrs["fixed_params"], num_layers=8, world_size=2) for t in queued]
    model = CostModel(ModelProfile.from_dict(PROFILE), local_cluster(2, None, 1e12), 8)
    best_plain = min(model.estimate(p).step_s for p in space.plans() if p.chunks == 1)
    assert len(plans) == 3 and all(p.chunks == 2 for p in plans)
    for t, plan in zip(queued, plans, strict=True):
        assert t.user_attrs["predicted_step_s"] == estimate_chunked(model, plan).step_s < best_plain


def test_the_planners_chunked_offers_are_seeded_when_the_space_searches_their_schedule():
    # 40 layers on 4 ranks: too many plans to rank whole, so the dynamic program (one stage per
    # group) picks the seeds and their chunked variants are offered beside them.
    profile = PROFILE_40
    space = PlanSpace(40, 4, 16, (8, 16), ("dapple", "interleaved", "zb-v", "v-half"))
    said: list[str] = []
    study = optuna.create_study()
    enqueue_planner_seeds(study, space, profile, 3, None, said.append, memory_limit=1e12)
    offers = [Plan.from_dict(d) for d in study.user_attrs["planner_chunked_offers"]]
    assert offers and all(plan.chunks == 2 for plan in offers), said
    seeded = [t for t in study.get_trials(deepcopy=False) if "planner_offer" in t.user_attrs]
    got = [plan_from_params(t.system_attrs["fixed_params"], num_layers=40, world_size=4) for t in seeded]
    assert got == offers  # each offer queued once, in the order offered
    model = CostModel(ModelProfile.from_dict(profile), local_cluster(4, None, 1e12), 16)
    for t, plan in zip(seeded, got, strict=True):
        assert t.user_attrs["predicted_step_s"] == estimate_chunked(model, plan).step_s
        assert "stages per group" in t.user_attrs["planner_offer"]
    assert sum("seeded. Why" in line for line in said) == len(offers)
    assert not any("not seeded" in line for line in said)


def test_an_offer_outside_the_space_says_what_to_add():
    space = PlanSpace(40, 4, 16, (8, 16), ("dapple",))
    said: list[str] = []
    study = optuna.create_study()
    enqueue_planner_seeds(study, space, PROFILE_40, 3, None, said.append, memory_limit=1e12)
    outside = [line for line in said if "not seeded" in line]
    assert outside and len(outside) == len(study.user_attrs["planner_chunked_offers"])
    for line in outside:
        assert "not seeded: the space searches no chunked schedule; add" in line and "to the searched schedules" in line
    assert not any("planner_offer" in t.user_attrs for t in study.get_trials(deepcopy=False))


def test_memory_refusal_prices_chunked_plans_per_rank_group():
    space = PlanSpace(8, 2, 8, (4,), ("zb-v",))
    plan = next(iter(space.plans()))
    model = CostModel(ModelProfile.from_dict(PROFILE), local_cluster(2, None, 1e12), 8)
    peaks = estimate_chunked(model, plan).memory_bytes
    assert memory_refusal(PROFILE, space, max(peaks) + 1)(plan) is None
    why = memory_refusal(PROFILE, space, min(peaks) - 1)(plan)
    assert why is not None and "rank group 0 (stages 0, 3)" in why and "rank group 1 (stages 1, 2)" in why


def _open(storage: str, space: PlanSpace) -> optuna.Study:
    """Open (or resume) study ``s`` of ``space``, as the search does."""
    return open_study(
        storage,
        "s",
        fingerprint=Fingerprint(space.num_layers, "m", space.world_size, "cpu", space.global_batch),
        space=space,
        directions=["maximize"],
        objectives=["samples_per_s"],
        sampler=lambda _: optuna.samplers.RandomSampler(),
        existing=existing_study(storage, "s"),
        say=lambda _: None,
    )


def test_a_study_resumed_with_another_chunk_count_is_refused(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    _open(storage, PlanSpace(9, 2, 12, (2, 4, 6), ("dapple", "interleaved"), chunks=2))
    _open(storage, PlanSpace(9, 2, 12, (2, 4, 6), ("dapple", "interleaved"), chunks=2))
    with pytest.raises(ValueError, match="chunks: study 2 != now 3"):
        _open(storage, PlanSpace(9, 2, 12, (2, 4, 6), ("dapple", "interleaved"), chunks=3))


def test_a_study_resumed_with_other_group_choices_is_refused(tmp_path):
    # max_stages 7 leaves the stage limit at 4 ranks and the micro-batch counts as they were, but
    # takes 4 groups of 2 chunks (8 stages) out of the interleaved choices.
    storage = f"sqlite:///{tmp_path / 's.db'}"
    _open(storage, PlanSpace(16, 4, 16, None, ("dapple", "interleaved")))
    with pytest.raises(ValueError, match=r"choices: study .*'interleaved_m4_groups': \[2, 4\]"):
        _open(storage, PlanSpace(16, 4, 16, None, ("dapple", "interleaved"), 7))


PROFILE_12 = ModelProfile(
    tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**3, 10**8, weight_s=1e-3) for i in range(12)), 4
).to_dict()


def test_too_many_chunked_plans_to_replay_leave_them_to_the_offers():
    space = PlanSpace(12, 4, 16, None, MIXED)
    chunked = space.size - space.schedule_size("dapple")
    assert chunked > CHUNKED_EXHAUSTIVE >= 0 < space.schedule_size("dapple") <= EXHAUSTIVE
    said: list[str] = []
    study = optuna.create_study()
    enqueue_planner_seeds(study, space, PROFILE_12, 3, None, said.append, memory_limit=1e12)
    picks = [line for line in said if line.startswith("planner pick")]
    assert len(picks) == 3 and all("chunks" not in line for line in picks)  # the pipelines, ranked
    assert any("seeded. Why" in line for line in said)  # and a chunked variant beside them
    with pytest.raises(ValueError, match=r"chunked plans and no other, more than the 2000 .* add dapple"):
        planner_seeds(PROFILE_12, PlanSpace(12, 4, 16, None, MIXED[1:]), 3, memory_limit=1e12)


@pytest.mark.parametrize(
    ("schedules", "chunks", "offered"),
    [
        (("dapple", "interleaved"), 3, {("interleaved", 3)}),
        (("dapple", "zb-v"), 2, {("zb-v", 2)}),
        (("gpipe", "v-half"), 2, {("v-half", 2)}),  # a gpipe seed's pipeline is offered as DAPPLE's
    ],
)
def test_the_offers_are_the_variants_the_space_searches(schedules, chunks, offered):
    space = PlanSpace(40, 4, 16, (8, 16), schedules, chunks=chunks)
    said: list[str] = []
    study = optuna.create_study()
    enqueue_planner_seeds(study, space, PROFILE_40, 3, None, said.append, memory_limit=1e12)
    offers = [Plan.from_dict(d) for d in study.user_attrs["planner_chunked_offers"]]
    assert offers and {(p.schedule, p.chunks) for p in offers} == offered, said
    assert all(space.contains(p) for p in offers) and not any("not seeded" in line for line in said)
    assert sum("planner_offer" in t.user_attrs for t in study.get_trials(deepcopy=False)) == len(offers)


def test_chunks_below_2_are_refused_only_where_interleaved_plans_are_searched():
    assert PlanSpace(6, 2, 8, schedules=("dapple", "zb-v"), chunks=1).chunks == 1
    with pytest.raises(ValueError, match="interleaved plans give each rank group chunks >= 2 stages; got chunks: 1"):
        PlanSpace(6, 2, 8, schedules=("dapple", "interleaved"), chunks=1)
