"""A VGG-style classifier on generated images; every layer lives in one ``nn.Sequential``.

``layers = [VGG block x conv_blocks, Flatten, (Linear + ReLU + Dropout) x fc_layers, Linear]``.
This is the shape for which DAPPLE's paper found its lopsided plans (VGG-19 on 16 GPUs: 15:1):
the convolutions hold few parameters but most of the compute, the dense head the reverse.
For the default model (32x32x3 input, channels 32-64-128, two 1024-wide hidden layers)::

    layers            params     MACs/image
    conv blocks 0-2     0.29 M       39 M
    flatten + head      3.16 M      3.2 M

so replicating the convolutions (cheap to all-reduce) and giving the head fewer devices (costly
to all-reduce) is what a planner should find. No BatchNorm: its statistics would depend on the
micro-batch size, and the example is meant to train the same numbers as one device.

Images are oriented, coloured sine gratings: each class has its own orientation, spatial
frequency and colour; each image a random phase and Gaussian noise, and is scaled to unit
variance. They are generated on demand from ``(seed, index)``, so a dataset of any size costs no
memory and pickles in bytes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["Gratings", "GratingsData", "VGGNet", "vgg_block"]


def vgg_block(in_channels: int, out_channels: int) -> nn.Sequential:
    """Two 3x3 convolutions with ReLU, then a 2x2 max-pool (halves height and width)."""
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_channels, out_channels, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class VGGNet(LightningModule):
    def __init__(
        self,
        image_size: int = 32,
        in_channels: int = 3,
        num_classes: int = 10,
        conv_blocks: int = 3,
        base_channels: int = 32,
        fc_layers: int = 2,
        fc_width: int = 1024,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if image_size % 2**conv_blocks:
            raise ValueError(
                f"image_size ({image_size}) must be divisible by 2**conv_blocks ({2**conv_blocks}): "
                "each block halves the image; lower model.conv_blocks or change the image size"
            )
        layers: list[nn.Module] = []
        channels = in_channels
        for i in range(conv_blocks):
            layers.append(vgg_block(channels, base_channels * 2**i))
            channels = base_channels * 2**i
        layers.append(nn.Flatten())
        features = channels * (image_size // 2**conv_blocks) ** 2
        for _ in range(fc_layers):
            layers.append(nn.Sequential(nn.Linear(features, fc_width), nn.ReLU(inplace=True), nn.Dropout(dropout)))
            features = fc_width
        layers.append(nn.Linear(features, num_classes))
        self.layers = nn.Sequential(*layers)
        for m in self.modules():
            if isinstance(m, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.layers[-1].weight, std=0.01)  # small logits: the first loss is about log(classes)

    def forward(self, images: Tensor) -> Tensor:
        return self.layers(images)

    def _loss_and_accuracy(self, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        images, labels = batch
        logits = self.layers(images)  # the one pass through the pipelined Sequential
        accuracy = (logits.argmax(dim=1) == labels).float().mean()
        return F.cross_entropy(logits, labels), accuracy

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss, _ = self._loss_and_accuracy(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss, accuracy = self._loss_and_accuracy(batch)
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_acc", accuracy)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Under dapple this runs after partitioning: self.parameters() are this rank's only.
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.hparams.lr)


class Gratings(Dataset):
    """``length`` images ``(channels, size, size)`` with labels, image ``i`` a function of ``(seed, i)``.

    The class patterns (orientation, frequency, colour) depend on ``class_seed`` only, so a
    training and a validation set built with different ``seed`` share their classes.
    """

    def __init__(
        self,
        length: int,
        *,
        seed: int,
        class_seed: int,
        num_classes: int = 10,
        size: int = 32,
        channels: int = 3,
        noise: float = 2.0,
    ) -> None:
        self.length, self.seed, self.noise = length, seed, noise
        self.num_classes, self.size, self.channels = num_classes, size, channels
        g = torch.Generator().manual_seed(class_seed)
        self.angles = torch.arange(num_classes) * math.pi / num_classes
        self.freqs = 2.0 + torch.arange(num_classes).remainder(3).float()  # 2, 3 or 4 cycles per image
        colours = torch.randn(num_classes, channels, generator=g)
        self.colours = colours / colours.norm(dim=1, keepdim=True) * math.sqrt(channels)
        coords = torch.arange(size).float() / size
        self.y, self.x = torch.meshgrid(coords, coords, indexing="ij")

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(torch.randint(self.num_classes, (1,), generator=g))
        phase = float(torch.rand(1, generator=g)) * 2 * math.pi
        angle, freq = self.angles[label], self.freqs[label]
        wave = torch.sin(2 * math.pi * freq * (self.x * torch.cos(angle) + self.y * torch.sin(angle)) + phase)
        image = self.colours[label][:, None, None] * wave
        image = image + self.noise * torch.randn(self.channels, self.size, self.size, generator=g)
        return image / math.sqrt(0.5 + self.noise**2), torch.tensor(label)  # unit variance per pixel


class GratingsData(LightningDataModule):
    """Generated training and validation images; training order seeded identically on every rank."""

    def __init__(
        self,
        *,
        image_size: int = 32,
        channels: int = 3,
        num_classes: int = 10,
        train_size: int = 65536,
        val_size: int = 1024,
        noise: float = 2.0,
        batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        common = {"class_seed": seed, "num_classes": num_classes, "size": image_size, "channels": channels}
        self.train_set = Gratings(train_size, seed=seed + 1, noise=noise, **common)
        self.val_set = Gratings(val_size, seed=seed + 2, noise=noise, **common)
        self.batch_size, self.seed = batch_size, seed

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=True,  # every step's global batch has the same size (it is cut into micro-batches)
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, drop_last=True)
