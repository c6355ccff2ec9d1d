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

from pathlib import Path

import hydra
from common import fit, job_result, output_dir
from configs import register
from gpt_model import CharData, CharGPT
from lightning.pytorch import seed_everything
from omegaconf import DictConfig

register()
REPO = Path(__file__).resolve().parents[1]


@hydra.main(version_base="1.3", config_path="../conf", config_name="gpt")
def main(cfg: DictConfig) -> dict[str, float] | None:
    seed_everything(cfg.seed, workers=True)
    path = Path(cfg.data.path)
    if not path.is_absolute() and not path.exists():
        path = REPO / path  # so that the default works from any directory
    data = CharData(
        path,
        context=cfg.data.context,
        batch_size=cfg.data.batch_size,
        stride=cfg.data.stride,
        val_fraction=cfg.data.val_fraction,
        seed=cfg.seed,
    )
    m = cfg.model
    model = CharGPT(
        vocab_size=len(data.vocab),
        context=m.context,
        n_blocks=m.n_blocks,
        d_model=m.d_model,
        n_heads=m.n_heads,
        dropout=m.dropout,
        lr=m.lr,
        weight_decay=m.weight_decay,
    )
    trainer = fit(cfg, model, data)

    # With spawn the ranks hand the trained weights back to this process; with popen this process
    # is rank 0, which holds the whole model again after fit.
    if cfg.sample_chars > 0 and trainer.global_rank == 0:
        model.eval()
        prompt = data.vocab.encode("\n")
        text = data.vocab.decode(model.generate(prompt, cfg.sample_chars, temperature=0.8, seed=cfg.seed))
        print(f"sample ({cfg.sample_chars} characters, temperature 0.8):\n{text}", flush=True)
    return job_result(output_dir())  # what a sweep over plans compares


if __name__ == "__main__":
    main()
