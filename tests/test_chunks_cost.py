"""The planner's price of chunked plans: more transfers, less bubble, memory per rank group."""

from __future__ import annotations

import pytest

from dapple_lightning.plan import Plan
from dapple_lightning.planner import GB, Cluster, CostModel, LayerProfile, ModelProfile
from dapple_lightning.planner._chunks import chunked_variants, estimate_chunked, offer_chunks


def _model(layers: int = 8, link_bw: float = 10**6 * GB, weight_s: float | None = 1e-3) -> CostModel:
    profile = ModelProfile(
        tuple(LayerProfile(f"l{i}", 1e-3, 2e-3, 10**6, 10**6, weight_s=weight_s) for i in range(layers)), 4
    )
    return CostModel(profile, Cluster.v100(1, 2, intra_p2p_bw=link_bw), 32)


def test_chunks_shrink_the_bubble_on_free_links_and_are_offered_with_their_reason():
    model = _model()
    plain = model.estimate(Plan.straight(8, 2, 8))
    interleaved = estimate_chunked(model, Plan.chunked(8, "1:1", micro_batches=8))
    zb_v = estimate_chunked(model, Plan.chunked(8, "1:1", layout="v", micro_batches=8))
    # 1F1B on two stages of 4 layers: (M + S - 1)(F + B) = 9 x 12 ms; interleaved halves the bubble.
    assert plain.step_s == pytest.approx(108e-3, rel=0.02)
    assert interleaved.pipeline_s == pytest.approx(102e-3, rel=0.02)
    assert zb_v.bubble_fraction < interleaved.bubble_fraction < plain.bubble_fraction
    offers = offer_chunks(model, plain)
    assert offers[0][0].plan.schedule == "zb-v"
    assert all(o.step_s < plain.step_s and o.fits for o, _ in offers)
    assert "zb-v with 2 stages per group (v): predicted" in offers[0][1] and "within" in offers[0][1]


def test_chunks_are_not_offered_where_their_transfers_cost_more_than_the_bubble():
    slow = _model(link_bw=2e5)  # 1 MB per cut: 5 s per message, against millisecond passes
    plain = slow.estimate(Plan.straight(8, 2, 8))
    assert offer_chunks(slow, plain) == []
    assert estimate_chunked(slow, Plan.chunked(8, "1:1", micro_batches=8)).step_s > plain.step_s


def test_memory_per_group_follows_the_schedule():
    model = _model()
    peak = {
        name: estimate_chunked(
            model, Plan.chunked(8, "1:1", layout=layout, micro_batches=8, schedule=name)
        ).memory_bytes
        for name, layout in (("interleaved", "looped"), ("zb-v", "v"), ("v-half", "v"))
    }
    # Same layers per group everywhere; V-Half keeps the fewest chunk micro-batches, interleaved's first group the most.
    assert peak["v-half"][0] < peak["zb-v"][0] < peak["interleaved"][0]
    assert [p.schedule for p in chunked_variants(model, Plan.straight(8, 2, 8))] == ["interleaved", "zb-v", "v-half"]
    assert [
        p.schedule for p in chunked_variants(model, Plan.straight(8, 2, 3))
    ] == []  # M = 3: neither a multiple of G nor >= 2G
