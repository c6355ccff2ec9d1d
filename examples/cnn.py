"""Train a VGG-style CNN on generated images with DAPPLE (a Hydra app).

    python examples/cnn.py                                  # 2-stage pipeline on 2 CPU processes
    python examples/cnn.py plan=dp                          # pure data parallelism instead
    python examples/cnn.py plan=cnn_2to1 trainer.devices=3  # DAPPLE's shape: convs x2, head x1
    python examples/cnn.py -m plan.micro_batches=2,4        # a sweep, one job after the other

Configs: ``conf/cnn.yaml`` and its groups under ``conf/`` (model, data, trainer, plan), typed by
``examples/configs.py``. Outputs go to ``outputs/cnn/<date>/<time>/`` (multiruns:
``outputs/cnn-multirun/...``); the working directory does not change. Ranks start with
``spawn``: see ``examples/common.py``.
"""

from __future__ import annotations

import hydra
from cnn_model import GratingsData, VGGNet
from common import fit, job_result, output_dir
from configs import register
from lightning.pytorch import seed_everything
from omegaconf import DictConfig

register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="cnn")
def main(cfg: DictConfig) -> dict[str, float] | None:
    seed_everything(cfg.seed, workers=True)
    d, m = cfg.data, cfg.model
    data = GratingsData(
        image_size=d.image_size,
        channels=d.channels,
        num_classes=d.num_classes,
        train_size=d.train_size,
        val_size=d.val_size,
        noise=d.noise,
        batch_size=d.batch_size,
        seed=cfg.seed,
    )
    model = VGGNet(
        image_size=m.image_size,
        in_channels=m.in_channels,
        num_classes=m.num_classes,
        conv_blocks=m.conv_blocks,
        base_channels=m.base_channels,
        fc_layers=m.fc_layers,
        fc_width=m.fc_width,
        dropout=m.dropout,
        lr=m.lr,
        weight_decay=m.weight_decay,
    )
    fit(cfg, model, data)
    return job_result(output_dir())  # what a sweep over plans compares


if __name__ == "__main__":
    main()
