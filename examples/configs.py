"""Structured configs of the examples, registered in Hydra's ConfigStore.

The YAML files under ``conf/`` fill these schemas: a key that is not declared here, or a value of
the wrong type (``trainer.max_steps=ten``), fails when Hydra composes the config, before any
process starts. The plan is the exception: it is typed ``Any`` (a string ``auto``, a mapping, or
a search's result ``optuna://STORAGE?study=NAME``, which ``common.make_trainer`` resolves with
:func:`dapple_lightning.search.resolve_plan_spec`), and :meth:`dapple_lightning.Plan.coerce`
validates it in ``DappleStrategy``'s constructor, with messages that name the fix.

Plans that work for any model use two derived model fields:

* ``model.num_layers``: the length of the model's ``nn.Sequential`` (the Llama's: of its ModuleList of
  decoder layers, ``strategy.sequential``);
* ``model.cut``: the layer where a 2-stage pipeline splits the model's compute about evenly.

Both are interpolations (``add`` and ``floordiv`` are resolvers registered below), so they
follow ``model.n_blocks`` and friends; ``model.cut`` may be overridden.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING, OmegaConf

__all__ = [
    "CNNAppConfig",
    "CNNModelConfig",
    "GPTAppConfig",
    "GPTModelConfig",
    "ImageDataConfig",
    "LlamaAppConfig",
    "LlamaModelConfig",
    "StrategyConfig",
    "TextDataConfig",
    "TrainerConfig",
    "register",
]


@dataclass
class TrainerConfig:
    """Keyword arguments of ``lightning.pytorch.Trainer`` (every field is passed through)."""

    accelerator: str = "cpu"
    devices: int = 2
    """Processes; must equal the plan's ranks (the sum of its stages' replicas)."""
    max_steps: int = 200
    """Optimizer steps; each consumes one DataLoader batch (the global batch)."""
    log_every_n_steps: int = 10
    val_check_interval: int = 50
    """Validate every this many optimizer steps (counted across epochs, see below)."""
    check_val_every_n_epoch: int | None = None
    """``None`` so that ``val_check_interval`` counts steps across epoch boundaries."""
    limit_val_batches: int = 8
    num_sanity_val_steps: int = II(".limit_val_batches")
    """Validate once before training, so the report shows the initial validation loss."""
    enable_progress_bar: bool = True
    enable_checkpointing: bool = False
    enable_model_summary: bool = False
    precision: str = "32-true"


@dataclass
class StrategyConfig:
    """How ``DappleStrategy`` starts and guards its processes (the plan is a separate node)."""

    start_method: str = "spawn"
    """``spawn`` (default) or ``popen``; see the comment in ``examples/common.py`` for why."""
    timeout_s: float = 120.0
    """Seconds a rank waits on a dead or stuck peer before giving up."""
    trace: str | None = None
    """Write a Chrome trace of every rank's schedule to this path when training ends."""
    sequential: str | None = None
    """Attribute path of the container a plan indexes (``DappleStrategy(sequential=...)``); ``None``:
    found as the strategy finds it, the module's only ``nn.Sequential`` or ``nn.ModuleList`` (the
    GPT's and the CNN's ``layers``; a wrapped Hugging Face model's block list)."""


@dataclass
class GPTModelConfig:
    """A character-level GPT; every layer lives in one ``nn.Sequential``."""

    context: int = 64
    """Tokens per sequence (also the size of the learned positional embedding)."""
    n_blocks: int = 4
    d_model: int = 128
    n_heads: int = 4
    dropout: float = 0.0
    lr: float = 1e-3
    weight_decay: float = 0.1
    num_layers: int = II("add:${.n_blocks},3")
    """Derived: embedding + blocks + final LayerNorm + head. Do not set."""
    cut: int = II("add:1,${floordiv:${.n_blocks},2}")
    """First layer of a 2-stage pipeline's second stage: the embedding and half the blocks go first."""


@dataclass
class LlamaModelConfig:
    """``transformers.LlamaForCausalLM``; a plan indexes its decoder layers (``model.model.layers``)."""

    context: int = 64
    """Tokens per sequence (``max_position_embeddings``)."""
    n_layers: int = 4
    hidden_size: int = 128
    intermediate_size: int = 344
    """The MLP's width (Llama's 8/3 of ``hidden_size``, rounded)."""
    n_heads: int = 4
    n_kv_heads: int = 2
    """Grouped-query attention: each key/value head serves ``n_heads / n_kv_heads`` query heads."""
    lr: float = 3e-3
    weight_decay: float = 0.1
    num_layers: int = II(".n_layers")
    """Derived: the decoder layers (embedding, norm and head are outside the container). Do not set."""
    cut: int = II("floordiv:${.n_layers},2")
    """First layer of a 2-stage pipeline's second stage: half the decoder layers go first."""


@dataclass
class CNNModelConfig:
    """A VGG-style network: cheap-in-parameters, compute-heavy convolutions, then a big dense head."""

    image_size: int = 32
    in_channels: int = 3
    num_classes: int = 10
    conv_blocks: int = 3
    """VGG blocks (two 3x3 convolutions + ReLU each, then 2x2 max-pool); channels double per block."""
    base_channels: int = 32
    fc_layers: int = 2
    """Hidden fully-connected layers (Linear + ReLU + Dropout each) before the classifier."""
    fc_width: int = 1024
    dropout: float = 0.0
    lr: float = 1e-3
    weight_decay: float = 0.01
    num_layers: int = II("add:${.conv_blocks},${.fc_layers},2")
    """Derived: conv blocks + Flatten + hidden FC layers + classifier. Do not set."""
    cut: int = 2
    """First layer of a 2-stage pipeline's second stage. In the default model the first two conv
    blocks do 59% of the multiply-adds, the last block and the head 41%: the most even cut."""


@dataclass
class TextDataConfig:
    path: str = "examples/data/kjv_genesis_to_numbers.txt"
    """Relative to the directory the command runs in (Hydra does not chdir), else to the repository."""
    context: int = II("model.context")
    batch_size: int = 32
    """The global batch; the plan cuts it into micro-batches."""
    stride: int = 1
    """Training windows start every ``stride`` characters (validation windows do not overlap)."""
    val_fraction: float = 0.1
    """The file's last ``val_fraction`` of characters is the validation split."""


@dataclass
class ImageDataConfig:
    image_size: int = II("model.image_size")
    channels: int = II("model.in_channels")
    num_classes: int = II("model.num_classes")
    train_size: int = 65536
    """Images are generated on demand from (seed, index): nothing is stored, any size is free."""
    val_size: int = 1024
    noise: float = 2.0
    """Standard deviation of the per-pixel Gaussian noise (the pattern's amplitude is 1); images are
    then scaled to unit variance. At 1.0 the task is learnt in ~60 steps, at 3.0 not in 150."""
    batch_size: int = 64


@dataclass
class GPTAppConfig:
    model: GPTModelConfig = field(default_factory=GPTModelConfig)
    data: TextDataConfig = field(default_factory=TextDataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    plan: Any = MISSING
    """``auto``, a plan mapping ({micro_batches, schedule, stages: [{layers: [a, b], replicas}]}) or
    ``optuna://STORAGE?study=NAME`` (a search's best plan, ``conf/plan/best.yaml``)."""
    seed: int = 1234
    sample_chars: int = 200
    """Characters to generate with the trained weights at the end (spawn only; 0: none)."""


@dataclass
class LlamaAppConfig:
    model: LlamaModelConfig = field(default_factory=LlamaModelConfig)
    data: TextDataConfig = field(default_factory=TextDataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    plan: Any = MISSING
    seed: int = 1234
    sample_chars: int = 200


@dataclass
class CNNAppConfig:
    model: CNNModelConfig = field(default_factory=CNNModelConfig)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    plan: Any = MISSING
    seed: int = 1234


def _register_resolvers() -> None:
    if not OmegaConf.has_resolver("add"):
        OmegaConf.register_new_resolver("add", lambda *xs: sum(int(x) for x in xs))
    if not OmegaConf.has_resolver("floordiv"):
        OmegaConf.register_new_resolver("floordiv", lambda a, b: int(a) // int(b))


def register() -> None:
    """Register the schemas (primary configs list ``gpt_schema``, ``cnn_schema``, ``llama_schema`` first)."""
    _register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="gpt_schema", node=GPTAppConfig)
    cs.store(name="cnn_schema", node=CNNAppConfig)
    cs.store(name="llama_schema", node=LlamaAppConfig)
