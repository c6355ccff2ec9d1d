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
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(self.layers)


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
