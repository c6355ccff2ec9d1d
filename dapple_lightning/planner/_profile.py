"""Layer profiles: what the planner knows about a model.

A profile lists, for each layer of the pipelined ``nn.Sequential`` (in order), its forward and
backward time for one batch of ``profile_batch_size`` samples, the bytes of its output and the
bytes of its parameters, plus the bytes that cross each possible cut of the chain.

**Scaling.** Time is affine in the number of samples: a layer that took ``forward_s`` for the
profile batch ``P``, of which ``forward_fixed_s`` does not depend on the batch (per-call
overhead; real devices are less efficient at small batches), takes
``forward_fixed_s + (forward_s - forward_fixed_s) * b / P`` for ``b`` samples (likewise
backward). With the fixed parts 0 (the default, and all a single-batch profile can tell) time
is linear in ``b``: profile at a batch near the micro-batch size you expect per device. The
output holds ``activation_bytes * b / P`` bytes; parameter bytes and the optimizer's
``update_s`` (one optimizer step over the layer's parameters) do not depend on the batch;
neither does ``accumulate_s``, what a backward costs on top of ``backward_s`` when the
parameters' gradients already hold a value: a step's first micro-batch creates them, each later
one adds into them, so a stage's backward averages ``accumulate_s * (M - 1) / M`` extra.

**JSON schema** (``ModelProfile.save`` / ``ModelProfile.load``; version 1)::

    {
      "format": "dapple-lightning-profile",
      "version": 1,
      "profile_batch_size": 32,          # samples per profiled batch
      "device": "V100",                  # free text
      "layers": [
        {"name": "conv1", "forward_s": 0.0034, "backward_s": 0.0068,
         "activation_bytes": 384000000, "param_bytes": 6835,
         "optimizer_state_bytes": null,   # null: the planner's optimizer factor x param_bytes
         "forward_fixed_s": 0.0001, "backward_fixed_s": 0.0002,   # optional, default 0
         "update_s": 0.00002, "accumulate_s": 0.00001,             # optional, default 0
         "weight_s": 0.0031,              # optional: the weights' part of backward_s (zero bubble)
         "peak_bytes": 512000000,         # optional: the measured peak (see LayerProfile)
         "peak_source": "allocator",      # optional: "allocator" (CUDA) or "tracker" (elsewhere)
         "saved_bytes": 256000000,        # optional: what autograd saved for the backward
         "update_peak_bytes": 4096},      # optional: the optimizer step's temporaries
        ...
      ],
      "cut_bytes": [0, 384000000, ..., 0]   # len(layers) + 1 entries, see ModelProfile.cut_bytes
    }

The PipeDream graph format of the DAPPLE authors' published profiles is read in ``_pipedream``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from dapple_lightning.plan import number, whole

__all__ = ["PEAK_SOURCES", "PROFILE_FORMAT", "PROFILE_VERSION", "LayerProfile", "ModelProfile"]

PROFILE_FORMAT = "dapple-lightning-profile"
PROFILE_VERSION = 1
PEAK_SOURCES = (None, "allocator", "tracker")
"""What ``LayerProfile.peak_source`` may be."""
_MEASURED = ("weight_s", "peak_bytes", "peak_source", "saved_bytes", "update_peak_bytes")
"""Layer fields written only when measured (not ``None``)."""


def _bytes(value: Any, what: str) -> int:
    # Byte counts are often written as floats ("384000000.000"); keep them whole.
    return round(number(value, what))


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of one layer at the profile batch size."""

    name: str
    """Layer name, for tables and error messages."""
    forward_s: float
    """Forward time in seconds for one batch of ``profile_batch_size`` samples."""
    backward_s: float
    """Backward time in seconds for the same batch (gradients of inputs and parameters)."""
    activation_bytes: int
    """Bytes of the layer's output for the same batch (what the backward pass keeps alive)."""
    param_bytes: int
    """Bytes of the layer's parameters (the gradients take as many again)."""
    optimizer_state_bytes: int | None = None
    """Bytes of optimizer state, or ``None`` to use the planner's factor times ``param_bytes``."""
    forward_fixed_s: float = 0.0
    """The part of ``forward_s`` that does not scale with the samples (at most ``forward_s``)."""
    backward_fixed_s: float = 0.0
    """The part of ``backward_s`` that does not scale with the samples (at most ``backward_s``)."""
    update_s: float = 0.0
    """Seconds of one optimizer step over the layer's parameters."""
    accumulate_s: float = 0.0
    """Extra backward seconds when the parameters' gradients already exist (added into, not created)."""
    weight_s: float | None = None
    """The part of ``backward_s`` that computes the parameters' gradients (zero-bubble schedules
    run it apart from the input gradients, see ``runtime._split_backward``), scaling with the
    samples; ``None`` when not measured: the planner then prices a split backward as unsplit
    (all of it on the critical path)."""
    peak_bytes: int | None = None
    """Memory the layer's forward and backward took at their peak for the same batch, above what
    was allocated before, less its parameters' gradients (counted with the parameters): what it
    saved for the backward and the workspace of both passes; ``None`` when not measured. How it
    was measured is ``peak_source``."""
    peak_source: str | None = None
    """Where ``peak_bytes`` comes from: ``"allocator"``, CUDA's allocator counters
    (``max_memory_allocated``, a kernel's workspace included), or ``"tracker"``, the live-bytes
    tracker of ``planner._memory`` (any device; the tensors ops return, not scratch memory inside
    a kernel); ``None`` (profiles written before it, or by hand) reads as ``"allocator"``."""
    saved_bytes: int | None = None
    """Bytes autograd saved for the layer's backward for the same batch, each storage once and
    its parameters left out (``planner._memory.SavedBytes``); ``None`` when not measured. It
    counts the layer's input when the layer saves it, so summing it over a stage can count a
    tensor that two neighbouring layers both save (ReLU its output, the next Linear its input)
    twice."""
    update_peak_bytes: int | None = None
    """Bytes the optimizer's step over the layer's parameters allocates at its peak beyond its
    state (temporaries such as Adam's denominator), measured once the state exists; ``None``
    when not measured."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"layer name must be a string, got {self.name!r}")
        object.__setattr__(self, "forward_s", number(self.forward_s, f"layer {self.name!r} forward_s"))
        object.__setattr__(self, "backward_s", number(self.backward_s, f"layer {self.name!r} backward_s"))
        object.__setattr__(
            self, "activation_bytes", _bytes(self.activation_bytes, f"layer {self.name!r} activation_bytes")
        )
        object.__setattr__(self, "param_bytes", _bytes(self.param_bytes, f"layer {self.name!r} param_bytes"))
        if self.optimizer_state_bytes is not None:
            object.__setattr__(
                self,
                "optimizer_state_bytes",
                _bytes(self.optimizer_state_bytes, f"layer {self.name!r} optimizer_state_bytes"),
            )
        for part in ("forward", "backward"):
            fixed = number(getattr(self, f"{part}_fixed_s"), f"layer {self.name!r} {part}_fixed_s")
            if fixed > getattr(self, f"{part}_s"):
                raise ValueError(
                    f"layer {self.name!r}: {part}_fixed_s ({fixed}) exceeds {part}_s ({getattr(self, f'{part}_s')}); "
                    "the fixed part is a share of the time at the profile batch"
                )
            object.__setattr__(self, f"{part}_fixed_s", fixed)
        for name in ("update_s", "accumulate_s"):
            object.__setattr__(self, name, number(getattr(self, name), f"layer {self.name!r} {name}"))
        if self.weight_s is not None:
            weight = number(self.weight_s, f"layer {self.name!r} weight_s")
            if weight > self.backward_s:
                raise ValueError(
                    f"layer {self.name!r}: weight_s ({weight}) exceeds backward_s ({self.backward_s}); "
                    "it is the weights' share of the backward"
                )
            object.__setattr__(self, "weight_s", weight)
        for name in ("peak_bytes", "saved_bytes", "update_peak_bytes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _bytes(getattr(self, name), f"layer {self.name!r} {name}"))
        if self.peak_source not in PEAK_SOURCES:
            raise ValueError(
                f"layer {self.name!r}: peak_source must be one of {PEAK_SOURCES}, got {self.peak_source!r}"
            )
        if self.peak_source is not None and self.peak_bytes is None:
            raise ValueError(f"layer {self.name!r}: peak_source {self.peak_source!r} without peak_bytes")

    @property
    def activation_memory(self) -> int:
        """Bytes one batch's pass keeps on the device until its backward: what autograd saved
        (``saved_bytes``) when measured; else, for profiles written before it, the allocator's
        peak (which also holds the pass's workspace, counted for every live micro-batch, erring on
        the side that fits); else the output."""
        if self.saved_bytes is not None:
            return self.saved_bytes
        if self.peak_bytes is None or self.peak_source == "tracker":
            return self.activation_bytes
        return self.peak_bytes

    @property
    def transient_memory(self) -> int:
        """Bytes the layer's passes take at their peak beyond what it saves (its output, its input's
        gradient, workspace): ``peak_bytes - saved_bytes`` when both are measured, else 0 (the
        peak, if any, is then counted in :attr:`activation_memory`). A stage needs it once, for
        the micro-batch it is computing, on top of the ones it keeps."""
        if self.saved_bytes is None or self.peak_bytes is None:
            return 0
        return max(self.peak_bytes - self.saved_bytes, 0)

    def optimizer_bytes(self, factor: float) -> float:
        """Optimizer state bytes: the explicit value, else ``factor * param_bytes`` (Adam: 2)."""
        if self.optimizer_state_bytes is not None:
            return float(self.optimizer_state_bytes)
        return factor * self.param_bytes

    def to_dict(self) -> dict[str, Any]:
        # The memory fields only when measured: a profile without them reads as before, in readers
        # that predate them too.
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in values.items() if v is not None or k not in _MEASURED}

    @classmethod
    def from_dict(cls, data: Any) -> LayerProfile:
        if not isinstance(data, Mapping):
            raise TypeError(f"a layer profile must be a mapping, got {type(data).__name__}")
        required = ("name", "forward_s", "backward_s", "activation_bytes", "param_bytes")
        missing = [k for k in required if k not in data]
        if missing:
            raise ValueError(f"layer profile {dict(data)!r} lacks keys {missing}; required: {list(required)}")
        optional = tuple(f.name for f in fields(cls) if f.name not in required)
        unknown = set(data) - {*required, *optional}
        if unknown:
            raise ValueError(
                f"unknown layer profile keys {sorted(map(str, unknown))}; allowed: {[*required, *optional]}"
            )
        return cls(**{k: data[k] for k in data})


@dataclass(frozen=True)
class ModelProfile:
    """Per-layer profile of a chain of layers, plus the bytes crossing each cut.

    ``cut_bytes[i]`` (``0 < i < L``) is the total size, at the profile batch, of all tensors
    that cross the boundary between layer ``i - 1`` and layer ``i``: in a chain that is layer
    ``i - 1``'s output; in a graph with branches (skip connections, GNMT's residuals) it also
    counts every earlier output still needed after the cut. ``cut_bytes[0]`` and
    ``cut_bytes[L]`` are the model's input and output boundaries; no stage sends those, so the
    cost model ignores them (they are 0 when unknown). When ``cut_bytes`` is not given the
    layers are taken as a chain.
    """

    layers: tuple[LayerProfile, ...]
    """The layers in pipeline order."""
    profile_batch_size: int
    """Samples in the batch the times and activation bytes were measured for."""
    device: str = "unknown"
    """What the profile was measured on (free text, e.g. ``"V100"``)."""
    cut_bytes: tuple[int, ...] = field(default=())
    """Bytes crossing each boundary, ``len(layers) + 1`` entries (see the class docstring)."""

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, Mapping | str | bytes) or not isinstance(layers, Sequence):
            raise TypeError(f"profile layers must be a list of LayerProfile, got {type(layers).__name__}")
        layers = tuple(x if isinstance(x, LayerProfile) else LayerProfile.from_dict(x) for x in layers)
        if not layers:
            raise ValueError("a profile needs at least one layer")
        object.__setattr__(self, "layers", layers)
        whole(self.profile_batch_size, "profile_batch_size")
        if not isinstance(self.device, str):
            raise TypeError(f"device must be a string, got {self.device!r}")
        if self.cut_bytes == () or self.cut_bytes is None:
            cuts = (0, *(layer.activation_bytes for layer in layers[:-1]), 0)
        else:
            if isinstance(self.cut_bytes, str | bytes) or not isinstance(self.cut_bytes, Sequence):
                raise TypeError(f"cut_bytes must be a list of byte counts, got {type(self.cut_bytes).__name__}")
            cuts = tuple(_bytes(c, f"cut_bytes[{i}]") for i, c in enumerate(self.cut_bytes))
            if len(cuts) != len(layers) + 1:
                raise ValueError(
                    f"cut_bytes has {len(cuts)} entries but the profile has {len(layers)} layers; give one "
                    f"entry per boundary, {len(layers) + 1} in all (the two ends may be 0)"
                )
        object.__setattr__(self, "cut_bytes", cuts)

    # ----------------------------------------------------------------------------- queries

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # ------------------------------------------------------------------------ conversions

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "profile_batch_size": self.profile_batch_size,
            "device": self.device,
            "layers": [layer.to_dict() for layer in self.layers],
            "cut_bytes": list(self.cut_bytes),
        }

    @classmethod
    def from_dict(cls, data: Any) -> ModelProfile:
        if not isinstance(data, Mapping):
            raise TypeError(f"a profile must be a mapping, got {type(data).__name__}")
        if data.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
            raise ValueError(f"not a {PROFILE_FORMAT} file: format is {data.get('format')!r}")
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(
                f"profile version {version!r} is not supported; this planner reads version {PROFILE_VERSION}"
            )
        unknown = set(data) - {"format", "version", "profile_batch_size", "device", "layers", "cut_bytes"}
        if unknown:
            raise ValueError(f"unknown profile keys {sorted(map(str, unknown))}")
        for key in ("profile_batch_size", "layers"):
            if key not in data:
                raise ValueError(f"the profile lacks `{key}`")
        return cls(
            layers=tuple(LayerProfile.from_dict(x) for x in data["layers"]),
            profile_batch_size=data["profile_batch_size"],
            device=data.get("device", "unknown"),
            cut_bytes=tuple(data.get("cut_bytes") or ()),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON (schema in the module docstring)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModelProfile:
        """Read a profile written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {str(path)!r} is not valid JSON: {e}") from e
        return cls.from_dict(data)
