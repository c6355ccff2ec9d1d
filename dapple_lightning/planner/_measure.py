"""Measure a layer profile by running the layers on the current device (one process).

Kept apart from the pure planning modules: it is the only one that imports torch, and only
when called.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from dapple_lightning.planner._profile import LayerProfile, ModelProfile

if TYPE_CHECKING:
    import torch

__all__ = ["profile_layers"]


def _tensors(value: Any) -> list[torch.Tensor]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        out: list[torch.Tensor] = []
        for item in value:
            out += _tensors(item)
        return out
    raise TypeError(
        f"layers must take and return a tensor or a tuple of tensors, got {type(value).__name__}; "
        "wrap the layer so that it returns tensors"
    )


def _leaf(value: Any) -> Any:
    # A fresh leaf per call: the layer's backward then computes the input gradient too, as
    # every stage but the first must, and nothing leaks from one repeat into the next.
    import torch

    if isinstance(value, torch.Tensor):
        leaf = value.detach()
        return leaf.requires_grad_(True) if leaf.is_floating_point() else leaf
    if isinstance(value, tuple | list):
        return type(value)(_leaf(v) for v in value)
    return value


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize()


def profile_layers(
    layers: Sequence[torch.nn.Module],
    sample_input: Any,
    *,
    repeats: int = 5,
    warmup: int = 2,
) -> ModelProfile:
    """Time each layer's forward and backward on the device of ``sample_input``.

    The layers run in order, each on the previous one's output (as ``nn.Sequential`` does; a
    tuple is passed as one argument). For each layer, after ``warmup`` untimed runs, the
    median of ``repeats`` timed runs is kept: forward, then ``torch.autograd.backward`` from a
    random gradient shaped like the output. Output bytes and parameter bytes are counted. The
    profile batch size is ``sample_input``'s first dimension. Parameter gradients are cleared
    (set to ``None``) afterwards.

    Args:
        layers: The modules, e.g. an ``nn.Sequential``.
        sample_input: A tensor or tuple of tensors with the batch in dim 0, on the target device.
        repeats: Timed runs per layer (the median is kept).
        warmup: Untimed runs per layer first (allocator, kernel selection).

    Raises:
        TypeError: When a layer takes or returns something other than tensors.
        ValueError: For no layers, ``repeats < 1`` or ``warmup < 0``.
    """
    import torch

    modules = list(layers)
    if not modules:
        raise ValueError("profile_layers needs at least one layer")
    for index, module in enumerate(modules):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"layer {index} is a {type(module).__name__}, not a torch.nn.Module")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
    first = _tensors(sample_input)
    if not first or first[0].dim() == 0:
        raise ValueError("sample_input must hold a tensor with the batch in dim 0")
    batch = first[0].shape[0]
    device = first[0].device

    profiles: list[LayerProfile] = []
    value = sample_input
    generator = torch.Generator(device=device).manual_seed(0)
    for index, module in enumerate(modules):
        forward_times: list[float] = []
        backward_times: list[float] = []
        output: Any = None
        for run in range(warmup + repeats):
            inputs = _leaf(value)
            _sync(device)
            t0 = time.perf_counter()
            output = module(inputs)
            _sync(device)
            t1 = time.perf_counter()
            outs = [t for t in _tensors(output) if t.requires_grad]
            grads = [torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) for t in outs]
            _sync(device)
            t2 = time.perf_counter()
            if outs:
                torch.autograd.backward(outs, grads)
            _sync(device)
            t3 = time.perf_counter()
            module.zero_grad(set_to_none=True)
            if run >= warmup:
                forward_times.append(t1 - t0)
                backward_times.append(t3 - t2 if outs else 0.0)
        tensors = _tensors(output)
        profiles.append(
            LayerProfile(
                name=f"{index}:{type(module).__name__}",
                forward_s=statistics.median(forward_times),
                backward_s=statistics.median(backward_times),
                activation_bytes=sum(t.numel() * t.element_size() for t in tensors),
                param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
            )
        )
        value = _detached(output)
    return ModelProfile(layers=tuple(profiles), profile_batch_size=int(batch), device=_device_name(device))


def _detached(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple | list):
        return type(value)(_detached(v) for v in value)
    return value


def _device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)
