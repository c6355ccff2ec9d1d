"""Small LightningModules used by the strategy tests (importable by spawned ranks)."""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ROWS, BATCH, IN, OUT = 48, 12, 8, 4


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(123)
    x = torch.randn(ROWS, IN, generator=g)
    y = torch.randn(ROWS, OUT, generator=g)
    return TensorDataset(x, y)


def loader(batch_size: int = BATCH) -> DataLoader:
    return DataLoader(dataset(), batch_size=batch_size, shuffle=False)


class MLP(LightningModule):
    """Seven layers in one Sequential; SGD with momentum so optimizer state matters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(IN, 16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, OUT),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layers(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layers(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class _Split(nn.Module):
    """Returns a tuple: the features and a second float branch."""

    def forward(self, x):
        return x, 2 * x


class _Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, pair):
        x, y = pair
        return torch.tanh(self.a(x) + self.b(y))


class TupleMLP(MLP):
    """Activations between some layers are a tuple of tensors."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(IN, 16),
            nn.Tanh(),
            _Split(),
            _Merge(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, OUT),
        )


class HeadMLP(MLP):
    """Parameters outside the Sequential: an input projection before it and a head after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(IN, 16)
        self.layers = nn.Sequential(
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.Tanh(),
        )
        self.head = nn.Linear(16, OUT)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.head(self.layers(self.embed(x))), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.head(self.layers(self.embed(x))), y))

    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.head(self.layers(self.embed(x)))


class ScheduledMLP(MLP):
    """MLP with Adam, two param groups and a per-step LR schedule: optimizer state in checkpoints matters."""

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if n.endswith("weight")]
        no_decay = [p for n, p in self.named_parameters() if not n.endswith("weight")]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=0.01
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PredictMLP(MLP):
    def predict_step(self, batch, batch_idx):
        x, _ = batch
        return self.layers(x)


class ManualMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class NoSequential(MLP):
    """Its layers in an nn.ModuleDict: neither a Sequential nor a ModuleList to pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(self.layers)})


class TwoSequentials(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Sequential(nn.Linear(OUT, OUT))


class CallsTwice(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.layers(x), y) + nn.functional.mse_loss(self.layers(x), y)


class NeverCalls(MLP):
    def training_step(self, batch, batch_idx):
        x, _ = batch
        return (self.layers[0].weight.sum() * 0 + x.sum()) * 0


class _Dict(nn.Module):
    def forward(self, x):
        return {"h": x}


class _Undict(nn.Module):
    def forward(self, d):
        return d["h"]


class DictActivation(MLP):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(IN, 16), _Dict(), _Undict(), nn.Linear(16, OUT))


class EvalMLP(MLP):
    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.layers(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)]  # per epoch


class BarMLP(MLP):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.layers(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss


class ScheduledHeadMLP(HeadMLP):
    """Parameters outside the Sequential, AdamW with two param groups and a per-step LR schedule."""

    configure_optimizers = ScheduledMLP.configure_optimizers


def as_records(x: torch.Tensor, y: torch.Tensor):
    """``[x, y]`` as a Hugging Face collator with per-sample extras would hand it: a BatchEncoding
    of tensors, a list of strings, a list of one-shape per-sample tensors and a list of per-sample
    tensors of different lengths, each derived from its row."""
    from transformers import BatchEncoding

    return BatchEncoding(
        {
            "x": list(x),  # stacked in the step: the Sequential's input comes from a per-sample list
            "y": y,
            "id": [f"{float(v):+.5f}" for v in x[:, 0]],
            "seq": [torch.arange(1.0, 2.0 + int(abs(float(v)) * 3)) for v in x[:, 1]],
        }
    )


class RecordsMLP(MLP):
    """Its batches are BatchEncodings with per-sample lists; each row's loss is weighted by its
    string and its per-sample tensor, so a slice that gets wrong items changes the numbers."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return as_records(*batch)

    def _predict(self, batch):
        weight = torch.stack([s.mean() for s in batch["seq"]]) * torch.tensor([float(i) ** 2 + 1 for i in batch["id"]])
        return self.layers(torch.stack(batch["x"])), weight

    def training_step(self, batch, batch_idx):
        pred, weight = self._predict(batch)
        loss = (((pred - batch["y"]) ** 2).mean(1) * weight).mean()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        pred, weight = self._predict(batch)
        self.log("val_loss", (((pred - batch["y"]) ** 2).mean(1) * weight).mean())

    def predict_step(self, batch, batch_idx):
        pred, weight = self._predict(batch)
        return {
            "pred": pred,
            "id": batch["id"],
            "top": [int(i) for i in pred.argmax(1)],
            "pair": (weight, batch["seq"]),
            "fields": [pred.sum(1), pred[:, :2]],
            "batch": batch_idx,
        }


class ReduceMLP(MLP):
    """Logs a maximum, a minimum and sums beside the mean loss, per step and per epoch."""

    def _errors(self, prefix: str, batch) -> torch.Tensor:
        x, y = batch
        err = (self.layers(x) - y).abs()
        self.log(f"{prefix}_max", err.max(), reduce_fx="max", on_epoch=True)
        self.log(f"{prefix}_min", err.amin(), reduce_fx=torch.min, on_epoch=True)
        self.log(f"{prefix}_sse", (err**2).sum(), reduce_fx="sum", on_epoch=True)
        self.log(f"{prefix}_rows", float(len(x)), reduce_fx=sum, on_epoch=True)
        return (err**2).mean()

    def training_step(self, batch, batch_idx):
        loss = self._errors("train", batch)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._errors("val", batch))


class MedianLogMLP(MLP):
    """Logs with a reduce_fx that per-micro-batch values cannot be combined into."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss_median", loss, reduce_fx=torch.median)
        return loss


class StackedSamplesMLP(MLP):
    """Its batch is a custom collate's list of one-shape per-sample tensors (12 of shape (8,)), which
    it stacks: nothing else in the batch counts its rows, so dapple reads 8 rows of 12 fields."""

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return list(batch[0])

    def training_step(self, batch, batch_idx):
        return self.layers(torch.stack(batch)).pow(2).mean()


class DeepMLP(MLP):
    """Eight layers that each hold parameters (seven of them 16 x 16): an offloaded stage has layers to move."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        hidden = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)]
        self.layers = nn.Sequential(nn.Linear(IN, 16), *hidden, nn.Linear(16, OUT))


class WideMiddleMLP(MLP):
    """Five layers, the third a 16 -> 256 -> 256 -> 16 block that holds nearly all the parameters and
    hands on 16 features: no pipeline cut splits its state, and its replicas can (``shard:``). Adam,
    whose state (twice the parameters') sharding splits; its ``eps`` well above float rounding, so that
    gradients near zero do not turn a sum's rounding into a step of ``lr``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        wide = nn.Sequential(nn.Linear(16, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 16))
        self.layers = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), wide, nn.Tanh(), nn.Linear(16, OUT))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01, eps=1e-4)


class _T5LikeBlock(nn.Module):
    """Returns ``(hidden, position_bias, None)`` as T5's blocks do: the first block makes the bias
    (one row, shared by every row of the batch) and the loop hands it to the next blocks."""

    def __init__(self, makes_bias: bool) -> None:
        super().__init__()
        self.ff = nn.Linear(16, 16)
        self.relative_bias = nn.Parameter(torch.zeros(1, 16)) if makes_bias else None

    def forward(self, hidden, position_bias=None):
        if position_bias is None:
            position_bias = self.relative_bias
        return torch.tanh(self.ff(hidden) + position_bias), position_bias, None


class T5LikeBlocks(MLP):
    """An nn.ModuleList of T5-like blocks, looped as T5's stack loops them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(IN, 16)
        self.layers = nn.ModuleList(_T5LikeBlock(makes_bias=i == 0) for i in range(4))
        self.head = nn.Linear(16, OUT)

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden, bias = self.embed(x), None
        for block in self.layers:
            hidden, bias, _ = block(hidden, position_bias=bias)
        return nn.functional.mse_loss(self.head(hidden), y)
