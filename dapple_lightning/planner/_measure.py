"""Measure a layer profile by running the layers on the current device (one process).

Kept apart from the pure planning modules: it is the only one that imports torch, and only
when called. Times come from a :class:`~planner._clock.Stopwatch`: CUDA events on a CUDA device,
read once per pass through the chain, the host's clock on the CPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from dapple_lightning.plan import whole
from dapple_lightning.planner._clock import Stopwatch
from dapple_lightning.planner._memory import LayerMemory, memory_counter, optimizer_state_bytes
from dapple_lightning.planner._profile import LayerProfile, ModelProfile

if TYPE_CHECKING:
    import torch

__all__ = ["SETTLE_STEPS", "fixed_part", "fresh_leaves", "profile_layers"]

SETTLE_STEPS = 3
"""Optimizer steps before one is timed: the first creates its state, the next still fault its
pages in, each faster than the one before (how much: ``docs/benchmarks.md``, "The optimizer as
training runs it")."""


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


def fresh_leaves(value: Any) -> Any:
    """``value``'s tensors detached, the floating ones requiring grad: what a layer is run on so
    that its backward computes its input gradient, as every stage but the first must, and goes no
    further."""
    from dapple_lightning.microbatch import map_tensors

    def leaf(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() else t

    return map_tensors(value, leaf)


_IN_PLACE = "leaf Variable that requires grad is being used in an in-place operation"


def _forward(module: Any, inputs: Any, index: int, on_copy: set[int]) -> Any:
    """``module(inputs)``, or on a copy of ``inputs`` for a layer that changes its input in place
    (``ReLU(inplace=True)``), which a leaf that requires grad refuses: a stage that begins with
    such a layer runs it on a copy too (``runtime.StageModule``), so the copy is timed with it."""
    from dapple_lightning.microbatch import map_tensors

    if index in on_copy:
        return module(map_tensors(inputs, lambda t: t.clone()))
    try:
        return module(inputs)
    except RuntimeError as err:
        if _IN_PLACE not in str(err):
            raise
        on_copy.add(index)
        return module(map_tensors(inputs, lambda t: t.clone()))


def profile_layers(
    layers: Sequence[torch.nn.Module],
    sample_input: Any,
    *,
    repeats: int = 5,
    warmup: int = 2,
    small_batch: int | None = None,
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    in_step: Callable[[], None] | None = None,
    split_backward: bool = False,
) -> ModelProfile:
    """Time each layer's forward and backward on the device of ``sample_input``.

    The layers run in order, each on the previous one's output (as ``nn.Sequential`` does; a
    tuple is passed as one argument). Each run passes the input through every layer's forward,
    then runs every layer's backward in reverse, each from a random gradient shaped like its
    output and with its parameter gradients unset (as for a step's first micro-batch); after
    ``warmup`` untimed runs, each layer's median over ``repeats`` timed runs is kept. Each run
    (on ``small_batch`` rows when given) is followed by a second that adds into the gradients
    the first created; for layers with parameters, the median difference of their backwards is
    their ``accumulate_s``. Output and parameter bytes are counted; one more, untimed pass
    measures each layer's ``saved_bytes`` and ``peak_bytes`` (``planner._memory.LayerMemory``:
    CUDA's allocator counters, elsewhere the live-bytes tracker). The profile batch is
    ``sample_input``'s first dimension; gradients are cleared after.

    Args:
        layers: The modules, e.g. an ``nn.Sequential``.
        sample_input: A tensor or tuple of tensors with the batch in dim 0, on the target device.
        repeats: Timed runs per layer (the median is kept).
        warmup: Untimed runs per layer first (allocator, kernel selection).
        small_batch: Also time the layers on the first ``small_batch`` rows, and split each time
            into a part that does not depend on the batch and a per-sample part (a straight line
            through the two measurements, clamped so that neither part is negative): the cost
            model then prices small micro-batches at what they really cost.
        optimizer: Builds an optimizer over given parameters (the user's kind and settings);
            each layer's ``update_s`` is then the median time of its ``step()`` over the
            layer's parameters, its ``optimizer_state_bytes`` what that optimizer keeps for
            them after its steps (:func:`planner._memory.optimizer_state_bytes`; 0 for a layer
            without parameters), and its ``update_peak_bytes`` what one more step allocates at
            its peak beyond that. Parameter values and gradients are restored afterwards.
        in_step: Called before each layer's optimizer steps are timed. Processes that share
            a machine's memory bandwidth (CPU ranks) slow each other's optimizer steps, which
            training runs at the same moment on every rank; ``plan="auto"`` passes a barrier
            so that the profile times them the same way.
        split_backward: Also time each layer's backward to its input alone (a zero-bubble
            ``B``) in passes of their own; the rest of its backward is its ``weight_s``.

    Raises:
        TypeError: When a layer takes or returns something other than tensors.
        ValueError: For no layers, ``repeats < 1``, ``warmup < 0`` or a ``small_batch`` outside
            ``[1, batch)``.
    """
    modules = list(layers)
    batch, device = _checked(modules, sample_input, repeats, warmup, small_batch)
    # Adding into gradients costs the same at any batch: it is timed on the cheaper pass.
    timed, output_bytes, accumulate = _time_layers(
        modules, sample_input, repeats, warmup, device, accumulate=small_batch is None
    )
    fixed = [(0.0, 0.0)] * len(modules)
    if small_batch is not None:
        from dapple_lightning.microbatch import map_tensors

        first_rows = map_tensors(sample_input, lambda t: t[:small_batch])  # the batch is dim 0
        small, _, accumulate = _time_layers(modules, first_rows, repeats, warmup, device, accumulate=True)
        fixed = [
            (fixed_part(big_f, small_f, batch, small_batch), fixed_part(big_b, small_b, batch, small_batch))
            for (big_f, big_b), (small_f, small_b) in zip(timed, small)
        ]
    weight = [None] * len(modules)
    if split_backward:
        inputs_only, _, _ = _time_layers(modules, sample_input, repeats, warmup, device, inputs_only=True)
        owns = [any(p.requires_grad for p in m.parameters()) for m in modules]
        weight = [max(b - only, 0.0) if own else 0.0 for (_, b), (_, only), own in zip(timed, inputs_only, owns)]
    memory = _measure_memory(modules, sample_input, device)
    update = None if optimizer is None else (lambda ps: _time_update(ps, optimizer, repeats, warmup, device, in_step))
    profiles = [
        _layer(index, module, *measured, memory[index], update)
        for index, (module, *measured) in enumerate(zip(modules, timed, fixed, output_bytes, accumulate, weight))
    ]
    return ModelProfile(layers=tuple(profiles), profile_batch_size=int(batch), device=_device_name(device))


def _layer(
    index: int,
    module: torch.nn.Module,
    times: tuple[float, float],
    fixed_s: tuple[float, float],
    nbytes: int,
    added: float,
    weight: float | None,
    memory: dict[str, Any],
    update: Callable[[list[torch.nn.Parameter]], tuple[float, int, int]] | None,
) -> LayerProfile:
    """One layer's profile from what :func:`profile_layers` measured, its optimizer step timed and
    its optimizer state counted with ``update`` (when given; a layer without parameters has none)."""
    params = [p for p in module.parameters() if p.requires_grad]
    update_s, state, temporaries = 0.0, (None if update is None else 0), (None if update is None else 0)
    if update is not None and params:
        update_s, state, temporaries = update(params)
    return LayerProfile(
        name=f"{index}:{type(module).__name__}",
        forward_s=times[0],
        backward_s=times[1],
        activation_bytes=nbytes,
        param_bytes=sum(p.numel() * p.element_size() for p in module.parameters()),
        optimizer_state_bytes=state,
        forward_fixed_s=fixed_s[0],
        backward_fixed_s=fixed_s[1],
        update_s=update_s,
        accumulate_s=added,
        weight_s=weight,
        update_peak_bytes=temporaries,
        **memory,
    )


def _checked(
    modules: list[torch.nn.Module], sample_input: Any, repeats: int, warmup: int, small_batch: int | None
) -> tuple[int, torch.device]:
    """The batch size and device of ``sample_input``, once :func:`profile_layers`' arguments are
    found valid."""
    import torch

    if not modules:
        raise ValueError("profile_layers needs at least one layer")
    for index, module in enumerate(modules):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"layer {index} is a {type(module).__name__}, not a torch.nn.Module")
    whole(repeats, "repeats")
    whole(warmup, "warmup", 0)
    first = _tensors(sample_input)
    if not first or first[0].dim() == 0:
        raise ValueError("sample_input must hold a tensor with the batch in dim 0")
    batch = first[0].shape[0]
    if small_batch is not None and (isinstance(small_batch, bool) or not isinstance(small_batch, int)
                                    or not 1 <= small_batch < batch):  # fmt: skip
        raise ValueError(f"small_batch must be an integer in [1, {batch}), got {small_batch!r}")
    return batch, first[0].device


def _time_layers(
    modules: list[torch.nn.Module],
    sample_input: Any,
    repeats: int,
    warmup: int,
    device: torch.device,
    *,
    accumulate: bool = False,
    inputs_only: bool = False,
) -> tuple[list[tuple[float, float]], list[int], list[float]]:
    """Median forward and backward seconds of each layer, the bytes of each layer's output, and with
    ``accumulate`` what a backward costs more when it adds into existing gradients (0 otherwise).

    Each run goes through the chain as training does (:func:`_chain`). Timing one layer many
    times in a row instead finds its weights and code warm and comes out well below the same
    layers run as a chain (``docs/benchmarks.md``, "Layers timed as a chain").
    """
    import torch

    count, generator = len(modules), torch.Generator(device=device).manual_seed(0)
    on_copy: set[int] = set()  # layers that change their input in place (see _forward)
    forward_times: list[list[float]] = [[] for _ in modules]
    backward_times: list[list[float]] = [[] for _ in modules]
    added: list[list[float]] = [[] for _ in modules]
    output_bytes: list[int] = []
    for run in range(warmup + repeats):
        # The first pass creates the gradients.
        forward_s, backward_s, output_bytes = _chain(
            modules, sample_input, device, on_copy, generator, inputs_only=inputs_only
        )
        if accumulate:
            # A second pass adds into them, its layers apart from one another as in training
            # (back to back, a layer finds its gradients in cache and adds for nearly nothing).
            _, again, _ = _chain(modules, sample_input, device, on_copy, generator)
        for module in modules:
            module.zero_grad(set_to_none=True)
        if run < warmup:
            continue
        for k in range(count):
            forward_times[k].append(forward_s[k])
            backward_times[k].append(backward_s[k])
            if accumulate:
                added[k].append(again[k] - backward_s[k])
    has_params = [any(p.requires_grad for p in m.parameters()) for m in modules]
    times = [(statistics.median(f), statistics.median(b)) for f, b in zip(forward_times, backward_times)]
    extra = [max(statistics.median(a), 0.0) if a and params else 0.0 for a, params in zip(added, has_params)]
    return times, output_bytes, extra


def _chain(
    modules: list[torch.nn.Module],
    sample_input: Any,
    device: torch.device,
    on_copy: set[int],
    generator: torch.Generator,
    memory: LayerMemory | None = None,
    *,
    inputs_only: bool = False,
) -> tuple[list[float], list[float], list[int]]:
    """One pass: every forward in order, then every backward in reverse, each backward from a
    random gradient shaped like the layer's output; seconds of each and the outputs' bytes.
    ``memory`` (when given) measures around each forward and backward; with ``inputs_only`` each
    backward computes the layer's input gradients alone (none for an integer input)."""
    import torch

    from dapple_lightning.microbatch import map_tensors

    count, watch = len(modules), Stopwatch(device)
    outputs: list[Any] = []
    leaves: list[list[torch.Tensor]] = []
    value = sample_input
    for index, module in enumerate(modules):
        # A fresh leaf per layer: its backward computes the input gradient too, as every stage
        # but the first must, and goes no further.
        inputs = fresh_leaves(value)
        leaves.append([t for t in _tensors(inputs) if t.requires_grad])
        with watch.span(), nullcontext() if memory is None else memory.forward(index):
            output = _forward(module, inputs, index, on_copy)
        outputs.append(output)
        value = map_tensors(output, torch.Tensor.detach)
    timed_backward = []
    for k in reversed(range(count)):
        outs = [t for t in _tensors(outputs[k]) if t.requires_grad]
        if outs and (leaves[k] or not inputs_only):
            grads = [torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype) for t in outs]
            with watch.span(), nullcontext() if memory is None else memory.backward(k):
                if inputs_only:
                    torch.autograd.grad(outs, leaves[k], grads, allow_unused=True)
                else:
                    torch.autograd.backward(outs, grads)
            timed_backward.append(k)
        outputs[k] = map_tensors(outputs[k], torch.Tensor.detach)  # frees the layer's graph
    seconds = watch.seconds()  # the pass's one wait for the device
    backward_s = [0.0] * count
    for k, spent in zip(timed_backward, seconds[count:]):
        backward_s[k] = spent
    return seconds[:count], backward_s, [sum(t.numel() * t.element_size() for t in _tensors(o)) for o in outputs]


def _measure_memory(modules: list[torch.nn.Module], sample_input: Any, device: torch.device) -> list[dict[str, Any]]:
    """Each layer's ``peak_bytes``, ``peak_source`` and ``saved_bytes`` (:class:`LayerMemory`)
    over one untimed pass of the chain, its gradients unset as at a step's first micro-batch.

    A pass of its own: the meters' hooks (on CPU one per op) would slow the timed passes.
    """
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    with LayerMemory(modules, device) as memory:
        _chain(modules, sample_input, device, set(), generator, memory)
    for module in modules:
        module.zero_grad(set_to_none=True)
    return [
        {"peak_bytes": peak, "peak_source": memory.source, "saved_bytes": saved}
        for peak, saved in zip(memory.peaks(), memory.saved)
    ]


def fixed_part(big: float, small: float, big_rows: int, small_rows: int) -> float:
    """Time at zero rows of the line through (small_rows, small) and (big_rows, big), within [0, big]."""
    slope = max(big - small, 0.0) / (big_rows - small_rows)
    return min(max(big - slope * big_rows, 0.0), big)


def _time_update(
    params: list[torch.nn.Parameter],
    optimizer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
    repeats: int,
    warmup: int,
    device: torch.device,
    in_step: Callable[[], None] | None = None,
) -> tuple[float, int, int]:
    """Median seconds of one ``step()`` of a fresh optimizer over ``params``, the bytes of the
    state it then keeps for them, and the peak bytes one more step allocates beyond that state
    (its temporaries; values restored after)."""
    import torch

    saved = [p.detach().clone() for p in params]
    grads = [p.grad for p in params]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        opt, watch = optimizer(params), Stopwatch(device)
        settle = max(warmup, SETTLE_STEPS)
        for run in range(settle + repeats):
            if in_step is not None and run in (0, settle):
                in_step()
            with watch.span() if run >= settle else nullcontext():
                opt.step()
        with memory_counter(device) as counter:
            counter.reset_peak()
            base = counter.live
            opt.step()
            temporaries = max(counter.peak - base, 0)
        return statistics.median(watch.seconds()), optimizer_state_bytes(opt, params), temporaries
    finally:
        with torch.no_grad():
            for p, value, grad in zip(params, saved, grads):
                p.copy_(value)
                p.grad = grad


def _device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)
