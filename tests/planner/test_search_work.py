"""The planner's work, counted: a change that multiplies it fails here whatever the machine's speed.

Each case records what :class:`SearchRecord` counts for one ``plan_dapple`` call (states
expanded, stages priced, partial plans priced and kept). The counts are deterministic; a change
to the search that moves one by more than :data:`TOLERANCE` either way must say so by updating
the record (and ``docs/benchmarks.md``'s planner figures, from ``benchmarks/planner_speed.py``).
Wall-clock times stay in ``benchmarks/``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from dapple_lightning.planner import (
    REFERENCE_PROFILES,
    Cluster,
    LayerProfile,
    ModelProfile,
    plan_dapple,
    read_pipedream,
)
from dapple_lightning.planner.__main__ import main

TOLERANCE = 1.5
"""Most a count may move, as a factor, before the record must be updated."""


def _benchmark_module(name: str) -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


synthetic = _benchmark_module("planner_speed").synthetic
"""``benchmarks/planner_speed.py``'s transformer-like profiles: the counts are of the benchmark's own cases."""


def paper(file: str, batch: int) -> ModelProfile:
    return read_pipedream(REFERENCE_PROFILES / file, batch)


# case: (profile, cluster, global batch, top, exact, (states, stages priced, partial plans, kept))
RECORDED = {
    "VGG-19 on 2x8": (lambda: paper("vgg-19-pbs-32.txt", 32), Cluster.paper_2x8, 1024, 1, True,
                      (2238, 9146, 20954, 15232)),
    "XLNet-36 on 2x8": (lambda: paper("xlnet-36-pbs-1.txt", 1), Cluster.paper_2x8, 128, 1, True,
                        (1916, 8425, 30769, 19737)),
    "16 x 50, top 1": (lambda: synthetic(50, 0), lambda: Cluster.parse("2x8"), 1024, 1, True,
                       (1982, 13086, 28254, 20083)),
    "16 x 50, top 5": (lambda: synthetic(50, 0), lambda: Cluster.parse("2x8"), 1024, 5, True,
                       (2259, 13430, 33373, 23771)),
    "AmoebaNet-36 on 2x8, top 5": (lambda: paper("amoeba-36-pbs-1.txt", 1), Cluster.paper_2x8, 128, 5, True,
                                   (3519, 11706, 73775, 44310)),
    "BERT-48 on 2x8, top 5": (lambda: paper("bert-48-pbs-2.txt", 2), Cluster.paper_2x8, 128, 5, True,
                              (3876, 12023, 107264, 62501)),
    "32 x 40, beam": (lambda: synthetic(40, 0), lambda: Cluster.parse("4x8"), 1024, 1, False,
                      (3605, 19685, 53393, 31344)),
    "256 devices x 16, beam": (lambda: synthetic(16, 0), lambda: Cluster.parse("32x8"), 1024, 1, False,
                               (2241, 4855, 113819, 55120)),
}  # fmt: skip
NAMES = ("states", "stages priced", "partial plans", "kept")


@pytest.mark.parametrize("case", list(RECORDED))
def test_the_planners_work_stays_within_its_record(case: str) -> None:
    profile, cluster, batch, top, exact, recorded = RECORDED[case]
    plans = plan_dapple(profile(), cluster(), batch, top=top)
    record = plans[0].search
    assert record is not None and record.exact is exact
    counted = (record.states, record.stages_priced, record.partial_plans, record.kept)
    off = {
        name: (now, was)
        for name, now, was in zip(NAMES, counted, recorded)
        if not was / TOLERANCE <= now <= was * TOLERANCE
    }
    assert not off, (
        f"{case}: the planner's work moved more than {TOLERANCE}x from its record, (now, recorded): {off}; "
        f"if the change means to, record {counted} in RECORDED"
    )


def test_the_record_says_how_far_a_beam_may_be_from_the_optimum() -> None:
    best = plan_dapple(synthetic(40, 0), Cluster.parse("4x8"), 1024)[0]
    record = best.search
    assert record is not None and not record.exact
    # The bound is below every plan's step; the gap is the plan's step over it.
    assert 0 < record.lower_bound_s < best.predicted_step_s
    # Under a beam it counts each stage's all-reduce too: above the compute spread over every device.
    profile, cluster = synthetic(40, 0), Cluster.parse("4x8")
    compute = sum(layer.forward_s + layer.backward_s for layer in profile.layers) * 1024 / profile.profile_batch_size
    assert record.lower_bound_s > compute / cluster.world_size
    assert record.gap(best.predicted_step_s) == pytest.approx(best.predicted_step_s / record.lower_bound_s - 1)
    assert best.to_dict()["search"]["exact"] is False


def test_the_cli_says_whether_the_search_was_exact(tmp_path, capsys) -> None:
    path = tmp_path / "four.json"
    ModelProfile((LayerProfile("l", 1e-3, 2e-3, 10**6, 10**6),) * 4, 1).save(path)
    assert main(["--profile", str(path), "--cluster", "1x2", "--global-batch", "4"]) == 0
    assert "search: exact over its space (" in capsys.readouterr().out
    assert main(["--profile", str(path), "--cluster", "1x2", "--global-batch", "4", "--exact", "no"]) == 0
    out = capsys.readouterr().out
    assert "search: a beam, not exhaustive" in out and "% above the optimum (lower bound" in out
