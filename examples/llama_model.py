"""A small character-level Llama from Hugging Face ``transformers``, built from a config (nothing downloaded).

Unlike ``CharGPT`` the model is not written for dapple: it is ``transformers.LlamaForCausalLM`` as
is. Its decoder layers sit in the ``nn.ModuleList`` ``model.model.layers`` that
``LlamaModel.forward`` loops over; the app pipelines that list (``strategy.sequential`` in
``conf/llama.yaml``). The token embedding, the rotary embedding, the final norm and the head stay
outside it and run on every rank, so a plan indexes only the decoder layers.

Importable by spawned ranks (see ``gpt_model.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["CharLlama"]


class CharLlama(LightningModule):
    """``LlamaForCausalLM`` trained on next-character windows (``CharData`` batches ``(ids, targets)``)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        context: int,
        n_layers: int,
        hidden_size: int,
        intermediate_size: int,
        n_heads: int,
        n_kv_heads: int,
        lr: float,
        weight_decay: float,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads,
            max_position_embeddings=context,
        )
        self.model = LlamaForCausalLM(config)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        ids, targets = batch
        logits = self.model(input_ids=ids).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    @torch.no_grad()
    def generate(self, prompt: Tensor, new_tokens: int, *, temperature: float = 1.0, seed: int = 0) -> Tensor:
        """Sample ``new_tokens`` ids after ``prompt`` (1-D ids); needs the whole, unpartitioned model."""
        context = self.hparams.context
        g = torch.Generator().manual_seed(seed)
        ids = prompt.reshape(1, -1)
        for _ in range(new_tokens):
            logits = self.model(input_ids=ids[:, -context:], use_cache=False).logits[0, -1] / temperature
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g)
            ids = torch.cat([ids, nxt.reshape(1, 1)], dim=1)
        return ids[0]
