"""Train a character-level Llama (Hugging Face ``transformers``) on the King James Version with DAPPLE.

    python examples/llama.py                                # 2 stages of decoder layers, 2 CPU processes
    python examples/llama.py plan=dp                        # pure data parallelism instead
    python examples/llama.py model.n_layers=6 model.cut=4 plan.micro_batches=8
    python examples/llama.py --cfg job                      # print the composed config

The model is ``transformers.LlamaForCausalLM`` built from a ``LlamaConfig`` (nothing is
downloaded), inside an ordinary LightningModule (``examples/llama_model.py``). dapple pipelines
the ``nn.ModuleList`` of decoder layers that ``LlamaModel.forward`` loops over
(``strategy.sequential=model.model.layers``): each rank keeps its stage's layers, computes the
embedding, the rotary ``(cos, sin)``, the causal mask and the cache itself, and only the hidden
states cross stages. Configs: ``conf/llama.yaml`` and the groups under ``conf/``; outputs go to
``outputs/llama/<date>/<time>/``. Ranks start with ``spawn``: see ``examples/common.py``.
"""

from __future__ import annotations

import hydra
from common import fit, job_result, output_dir
from configs import register
from gpt_model import char_data, print_sample
from lightning.pytorch import seed_everything
from llama_model import CharLlama
from omegaconf import DictConfig

register()


@hydra.main(version_base="1.3", config_path="../conf", config_name="llama")
def main(cfg: DictConfig) -> dict[str, float] | None:
    seed_everything(cfg.seed, workers=True)
    data = char_data(cfg)
    m = cfg.model
    model = CharLlama(
        vocab_size=len(data.vocab),
        context=m.context,
        n_layers=m.n_layers,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads,
        lr=m.lr,
        weight_decay=m.weight_decay,
    )
    trainer = fit(cfg, model, data)
    print_sample(cfg, trainer, model, data)
    return job_result(output_dir())  # what a sweep over plans compares


if __name__ == "__main__":
    main()
