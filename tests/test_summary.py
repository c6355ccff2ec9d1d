"""Lightning's model summary on rank 0 is the whole model's, as one device prints it.

Each rank holds one stage after setup; the summary must still list the model's rows with their
parameter counts and totals as one device does, not the stage that stands in for the container.
"""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch.callbacks import ModelSummary

from dapple_lightning import DappleStrategy, Plan

import models
from harness import quiet_trainer

PLAN_2_1 = Plan(stages=[{"layers": [0, 4], "replicas": 2}, {"layers": [4, 7], "replicas": 1}], micro_batches=2)


class PrintsTo(ModelSummary):
    """Lightning's ModelSummary, also writing what it prints (on rank 0 only, as it prints) to a file."""

    def __init__(self, path: Path) -> None:
        super().__init__(max_depth=2)
        self.path = str(path)

    def summarize(self, summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs) -> None:
        printed = {"rows": summary_data, "total": total_parameters, "trainable": trainable_parameters, "MB": model_size}
        Path(self.path).write_text(json.dumps(printed))
        super().summarize(summary_data, total_parameters, trainable_parameters, model_size, *args, **kwargs)


def summary(path: Path, **placement) -> dict:
    quiet_trainer(max_steps=1, callbacks=[PrintsTo(path)], enable_model_summary=True, **placement).fit(
        models.HeadMLP(), models.loader()
    )
    return json.loads(path.read_text())


def test_rank_0_prints_the_whole_models_summary(tmp_path):
    want = summary(tmp_path / "one.json", devices=1)
    got = summary(tmp_path / "dapple.json", devices=3, strategy=DappleStrategy(PLAN_2_1, start_method="forkserver"))
    assert want["total"] == sum(p.numel() for p in models.HeadMLP().parameters()) == 1028
    assert got["total"] == want["total"]  # not rank 0's 756 (stage 0's layers, embed and head)
    assert got == want  # every row (layers.0 ... layers.6, not a StageModule), count and size as one device
