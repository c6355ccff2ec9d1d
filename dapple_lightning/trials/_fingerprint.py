"""What a study's measurements are valid for: the model, the ranks, the device and the batch.

A study's trials are throughputs of one model on one setup. Resuming it, or taking its best plan,
for another model or another world size would mix incomparable numbers, so every study stores a
fingerprint (``study.user_attrs["fingerprint"]``) and every later use compares it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from dapple_lightning.plan import whole

__all__ = ["Fingerprint", "FingerprintMismatch", "check_fingerprint"]


class FingerprintMismatch(ValueError):
    """A study was made for another model or setup than the one at hand."""


@dataclass(frozen=True)
class Fingerprint:
    """The setup a study measures."""

    num_layers: int
    """Layers of the pipelined ``nn.Sequential``."""
    architecture: str
    """Hash of the layer types and every parameter's name, shape and dtype (``""``: unknown)."""
    world_size: int
    """Ranks every plan runs on."""
    device: str
    """``"cpu"``, or the accelerator and device name (``"cuda:NVIDIA H200"``)."""
    global_batch: int
    """Samples per optimizer step."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "world_size", "global_batch"):
            whole(getattr(self, name), f"fingerprint {name}")
        for name in ("architecture", "device"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"fingerprint {name} must be a string, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fingerprint:
        names = {f.name for f in fields(cls)}
        missing = names - set(data)
        if missing:
            raise ValueError(f"fingerprint lacks {sorted(missing)}; it has {sorted(data)}")
        return cls(**{k: data[k] for k in names})

    def differences(self, other: Fingerprint) -> list[str]:
        """``"field: self_value != other_value"`` for every field that differs (``architecture``
        compares only when both are known)."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "architecture" and (not a or not b):
                continue
            if a != b:
                out.append(f"{f.name}: {a!r} != {b!r}")
        return out


def check_fingerprint(
    stored: Mapping[str, Any] | Fingerprint | None,
    current: Mapping[str, Any] | Fingerprint,
    *,
    study_name: str,
    allow_mismatch: bool = False,
) -> list[str]:
    """Compare a study's fingerprint with the current setup; the differences.

    Raises:
        FingerprintMismatch: When they differ and ``allow_mismatch`` is false.
    """
    if stored is None:
        return []
    stored = stored if isinstance(stored, Fingerprint) else Fingerprint.from_dict(stored)
    current = current if isinstance(current, Fingerprint) else Fingerprint.from_dict(current)
    diffs = stored.differences(current)
    if diffs and not allow_mismatch:
        raise FingerprintMismatch(
            f"study {study_name!r} was made for another setup (study != now): {'; '.join(diffs)}. "
            "Its measurements do not carry over: use another study name, or pass allow_mismatch=True "
            "(--allow-mismatch) to use it anyway"
        )
    return diffs
