"""Model factories of ``benchmarks/search.py`` (``"benchmarks.search_models:transformer"``, ``...:vgg``).

Kept apart from the benchmark script so that trial processes import only the models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SEED = 1234


class Transformer(LightningModule):
    """Embedding + ``blocks`` ``TransformerEncoderLayer`` + head, all in ``self.layers`` (the runtime
    benchmark's reference model: vocabulary 512, d_model 256, 4 heads, FFN 1024)."""

    def __init__(self, vocab: int = 512, d_model: int = 256, heads: int = 4, ffn: int = 1024, blocks: int = 8) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        layers = [nn.Embedding(vocab, d_model)]
        layers += [
            nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=ffn, dropout=0.0, batch_first=True)
            for _ in range(blocks)
        ]
        self.layers = nn.Sequential(*layers, nn.Linear(d_model, vocab))

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return F.cross_entropy(self.layers(tokens).flatten(0, 1), targets.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def transformer(batch_size: int, seq: int = 64, batches: int = 8, blocks: int = 8) -> tuple[Transformer, DataLoader]:
    gen = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, 512, (batches * batch_size, seq + 1), generator=gen)
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return Transformer(blocks=blocks), DataLoader(data, batch_size=batch_size, shuffle=False)


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)
    )


class VGG(LightningModule):
    """A VGG-style CNN: ``blocks`` blocks of two 3x3 convolutions + pooling (channels doubling from
    ``base``), then Flatten, two hidden fully-connected layers and the classifier, one layer each
    in ``self.layers``: compute-heavy convolutions, parameter-heavy dense layers (DAPPLE's VGG-19
    shape in small)."""

    def __init__(self, image: int = 32, blocks: int = 4, base: int = 32, hidden: int = 1024, classes: int = 10) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        convs, cin = [], 3
        for i in range(blocks):
            convs.append(_block(cin, base * 2**i))
            cin = base * 2**i
        flat = cin * (image // 2**blocks) ** 2
        self.layers = nn.Sequential(
            *convs,
            nn.Flatten(),
            nn.Sequential(nn.Linear(flat, hidden), nn.ReLU()),
            nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
            nn.Linear(hidden, classes),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.layers(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def vgg(batch_size: int, image: int = 32, batches: int = 8) -> tuple[VGG, DataLoader]:
    gen = torch.Generator().manual_seed(SEED)
    x = torch.randn(batches * batch_size, 3, image, image, generator=gen)
    y = torch.randint(0, 10, (batches * batch_size,), generator=gen)
    return VGG(image=image), DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)
