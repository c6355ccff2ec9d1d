"""A small character-level GPT whose every layer lives in one ``nn.Sequential``.

``layers = [Embedding, Block x n_blocks, LayerNorm, Linear head]``: a DAPPLE plan may cut it
anywhere. Between layers flows a ``(batch, time, d_model)`` tensor (token ids into the first).
No weight is shared across layers (no tied input/output embedding), so no parameter has to live
on two stages.

Importable by spawned ranks: the examples' Hydra apps start ranks with ``spawn``, which
pickles the LightningModule and the DataModule; their classes must live in a module, not in
``__main__``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

__all__ = ["Block", "CharData", "CharGPT", "Embedding", "Vocabulary", "Windows"]


class Embedding(nn.Module):
    """Token embedding plus a learned positional embedding: ``(B, T)`` ids to ``(B, T, d)``."""

    def __init__(self, vocab_size: int, context: int, d_model: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, d_model)
        self.positions = nn.Embedding(context, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, ids: Tensor) -> Tensor:
        length = ids.shape[1]
        if length > self.positions.num_embeddings:
            raise ValueError(
                f"sequence of {length} tokens is longer than the model's context "
                f"({self.positions.num_embeddings}); raise model.context or shorten the input"
            )
        pos = torch.arange(length, device=ids.device)
        return self.drop(self.tokens(ids) + self.positions(pos))


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharLM(LightningModule):
    """A character language model's steps and sampling, around ``_logits`` (ids -> next-id logits).

    Subclasses set ``hparams.context`` and pass every batch through their pipelined container once
    in ``_logits``.
    """

    def _logits(self, ids: Tensor) -> Tensor:
        raise NotImplementedError

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        ids, targets = batch
        logits = self._logits(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    @torch.no_grad()
    def generate(self, prompt: Tensor, new_tokens: int, *, temperature: float = 1.0, seed: int = 0) -> Tensor:
        """Sample ``new_tokens`` ids after ``prompt`` (1-D ids); needs the whole, unpartitioned model."""
        context = self.hparams.context
        g = torch.Generator().manual_seed(seed)
        ids = prompt.reshape(1, -1)
        for _ in range(new_tokens):
            logits = self._logits(ids[:, -context:])[0, -1] / temperature
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
            ids = torch.cat([ids, nxt.reshape(1, 1)], dim=1)
        return ids[0]

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)


class CharGPT(CharLM):
    """Next-character prediction with cross-entropy; AdamW, weight decay on matrices only."""

    def __init__(
        self,
        vocab_size: int,
        context: int = 64,
        n_blocks: int = 4,
        d_model: int = 128,
        n_heads: int = 4,
        dropout: float = 0.0,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layers = nn.Sequential(
            Embedding(vocab_size, context, d_model, dropout),
            *(Block(d_model, n_heads, dropout) for _ in range(n_blocks)),
            nn.LayerNorm(d_model),
            nn.Linear(d_model, vocab_size),
        )
        self.apply(_init_weights)
        # GPT-2: scale the residual projections by depth so the residual stream starts small.
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_blocks))

    def forward(self, ids: Tensor) -> Tensor:
        return self.layers(ids)

    def _logits(self, ids: Tensor) -> Tensor:
        return self.layers(ids)  # the one pass through the pipelined Sequential

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Under dapple this sees the whole model (other stages' layers on the meta device); each rank keeps its own.
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.hparams.lr, betas=(0.9, 0.99))


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)


class Vocabulary:
    """The sorted set of characters of a text; ids are positions in it."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        return torch.tensor([self._ids[c] for c in text], dtype=torch.long)

    def decode(self, ids: Tensor) -> str:
        return "".join(self.chars[i] for i in ids.tolist())


class Windows(Dataset):
    """``(ids[s : s + T], ids[s + 1 : s + T + 1])`` for ``s = 0, stride, 2 * stride, ...``."""

    def __init__(self, ids: Tensor, context: int, stride: int) -> None:
        if len(ids) <= context:
            raise ValueError(f"{len(ids)} tokens are too few for windows of {context} (+1 target)")
        self.ids, self.context, self.stride = ids, context, stride
        self.length = (len(ids) - context - 1) // stride + 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = index * self.stride
        chunk = self.ids[start : start + self.context + 1]
        return chunk[:-1], chunk[1:]


class CharData(LightningDataModule):
    """A text file as next-character windows; the file's last ``val_fraction`` is validation.

    The vocabulary is built from the whole file in the constructor (the model needs its size);
    the ids are built in :meth:`setup`, so nothing large is pickled to spawned ranks. Training
    order comes from a generator seeded with ``seed``: every rank draws the same batches.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        context: int,
        batch_size: int,
        stride: int = 1,
        val_fraction: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise FileNotFoundError(f"data.path={str(path)!r} does not exist (relative to {Path.cwd()})")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.context, self.batch_size, self.stride = context, batch_size, stride
        self.val_fraction, self.seed = val_fraction, seed
        self.vocab = Vocabulary(self._read())
        self.train_ids: Tensor | None = None
        self.val_ids: Tensor | None = None

    def _read(self) -> str:
        return self.path.read_text(encoding="utf-8")

    def setup(self, stage: str) -> None:
        if self.train_ids is not None:
            return
        ids = self.vocab.encode(self._read())
        split = len(ids) - int(len(ids) * self.val_fraction)
        self.train_ids, self.val_ids = ids[:split], ids[split:]

    def train_dataloader(self) -> DataLoader:
        assert self.train_ids is not None
        return DataLoader(
            Windows(self.train_ids, self.context, self.stride),
            batch_size=self.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=True,  # every step's global batch has the same size (it is cut into micro-batches)
        )

    def val_dataloader(self) -> DataLoader:
        assert self.val_ids is not None
        return DataLoader(
            Windows(self.val_ids, self.context, self.context),
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
        )


REPO = Path(__file__).resolve().parents[1]


def char_data(cfg: Any) -> CharData:
    """The text data a config's ``data`` group names (a relative path also works from any directory)."""
    path = Path(cfg.data.path)
    if not path.is_absolute() and not path.exists():
        path = REPO / path
    d = cfg.data
    return CharData(
        path, context=d.context, batch_size=d.batch_size, stride=d.stride, val_fraction=d.val_fraction, seed=cfg.seed
    )


def print_sample(cfg: Any, trainer: Any, model: Any, data: CharData) -> None:
    """Rank 0 prints ``cfg.sample_chars`` characters the trained model writes after a newline.

    With spawn the ranks hand the trained weights back to this process; with popen this process
    is rank 0, which holds the whole model again after fit.
    """
    if cfg.sample_chars > 0 and trainer.global_rank == 0:
        model.eval()
        prompt = data.vocab.encode("\n")
        text = data.vocab.decode(model.generate(prompt, cfg.sample_chars, temperature=0.8, seed=cfg.seed))
        print(f"sample ({cfg.sample_chars} characters, temperature 0.8):\n{text}", flush=True)
