"""Train a character-level GPT on the King James Version (Genesis to Numbers) with DAPPLE (a Hydra app).

    python examples/gpt.py                                  # 2-stage pipeline on 2 CPU processes
    python examples/gpt.py plan=dp                          # pure data parallelism instead
    python examples/gpt.py plan.micro_batches=8 plan.schedule=gpipe
    python examples/gpt.py model.n_blocks=6 model.cut=4 trainer.max_steps=400
    python examples/gpt.py -m plan.micro_batches=2,4        # a sweep, one job after the other
    python examples/gpt.py --cfg job                        # print the composed config

Configs: ``conf/gpt.yaml`` and its groups under ``conf/`` (model, data, trainer, plan), typed by
``examples/configs.py``. Outputs (``metrics.csv``, ``losses.json``, Hydra's config) go to
``outputs/gpt/<date>/<time>/`` (multiruns: ``outputs/gpt-multirun/<date>/<time>/<job>/``); the
working directory does not change. Ranks start with ``spawn``: see ``examples/common.py``.
"""

from __future__ import annotations

import hydra
from common import fit, job_result, output_dir
from configs import register
from gpt_model import CharData, CharGPT, char_data, print_sample
from lightning.pytorch import seed_everything
from omegaconf import DictConfig
from torch.utils.data import DataLoader

register()


def build(cfg: DictConfig, data: CharData) -> CharGPT:
    m = cfg.model
    return CharGPT(
        vocab_size=len(data.vocab),
        context=m.context,
        n_blocks=m.n_blocks,
        d_model=m.d_model,
        n_heads=m.n_heads,
        dropout=m.dropout,
        lr=m.lr,
        weight_decay=m.weight_decay,
    )


def search_model(cfg: DictConfig) -> tuple[CharGPT, DataLoader]:
    """A job's model and training batches, for the plan search's profile
    (``hydra.sweeper.model=gpt:search_model``; the planner seeds the study with its picks)."""
    seed_everything(cfg.seed, workers=True, verbose=False)
    data = char_data(cfg)
    data.setup("fit")
    return build(cfg, data), data.train_dataloader()


@hydra.main(version_base="1.3", config_path="../conf", config_name="gpt")
def main(cfg: DictConfig) -> dict[str, float] | None:
    seed_everything(cfg.seed, workers=True)
    data = char_data(cfg)
    model = build(cfg, data)
    trainer = fit(cfg, model, data)
    print_sample(cfg, trainer, model, data)
    return job_result(output_dir())  # what a sweep over plans compares


if __name__ == "__main__":
    main()
