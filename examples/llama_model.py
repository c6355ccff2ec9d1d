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
from gpt_model import CharLM
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["CharLlama"]


class CharLlama(CharLM):
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

    def _logits(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, use_cache=False).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
