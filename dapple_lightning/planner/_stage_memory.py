"""What one device of a stage holds at its peak, from the profile: the cost model's memory.

For a stage of layers ``[i, j)`` on ``r`` replicas running ``n`` samples per micro-batch (a
profile quantity ``q`` at the profile batch ``P`` counts ``q n / P``), keeping ``K`` of the
step's ``M`` micro-batches alive::

    static + max(K kept + transient,                 # up to its first backward
                 grads + K' kept + transient,        # after it: K' = K if M > K else K - 1
                 closing)                            # after the last backward

- ``static``: parameters + gradients (as many bytes) + optimizer state (what the user's
  optimizer allocated when the profile measured it, else ``optimizer_factor`` x parameters).
- ``kept``: what one micro-batch leaves on the stage until its backward: what its layers saved
  for the backward (``LayerProfile.saved_bytes``, ``saved_tensors_hooks``) plus, where that was
  measured, the stage's output, which the runtime holds until its gradient comes back (the last
  stage holds a loss). Layers without ``saved_bytes`` count their allocator peak, else their
  output (``LayerProfile.activation_memory``).
- ``transient``: the micro-batch being computed needs, on top, its largest layer's peak beyond
  what that layer saves (``LayerProfile.transient_memory``: output, input gradient, workspace).
- ``grads``: a second set of gradients. Under Lightning the strategy sets the step's fresh
  gradients aside while the previous step's stay in ``.grad`` until Lightning zeroes them after
  the training step, so once the first backward has made fresh ones, both are alive; under
  1F1B the stage then runs another forward while micro-batches remain (``K'``).
- ``closing``: after the last backward, the gradient all-reduce's flat buckets on a stage of
  ``r > 1`` replicas (a copy of the parameters, beside both sets of gradients; parameters of
  4 MiB and more are summed in place, so this errs on the side that fits), then, once Lightning
  has dropped the previous gradients, the optimizer step's temporaries
  (``LayerProfile.update_peak_bytes``, summed over the stage).

A stage that **recomputes** (``Stage.recompute``: each layer under ``torch.utils.checkpoint``)
keeps per micro-batch only each layer's input (``cut_bytes``) and its output; its ``transient``
is, once, its largest layer's whole peak (what that layer saves, made again in the backward,
plus its transient).

A stage that **offloads** (``Stage.offload``: its layers on disk, a working window of ``W`` in
memory, ``runtime._offload``) holds its model state only in part, in two phases::

    max(moving + K kept + transient,     # the schedule's forwards and backwards
        stepping + update)               # the gradient sum and the optimizer step, layer by layer

- ``moving``: the ``W + 1`` largest layers' parameters and gradients: the window, plus the layer
  whose gradients are being written out while the next one is read (never its optimizer state).
- ``stepping``: the 2 largest layers' parameters, gradients and optimizer state: the layer the
  optimizer steps (or the replicas sum) and the next one being read.
- ``update``: one layer's optimizer-step temporaries (the largest), not the stage's.
- no ``grads``: the runtime keeps an offloaded layer's gradients on disk, not a second set in memory.

``offload: auto`` is priced at :data:`~._window.AUTO_WINDOW_MOST`, the widest window it may pick.
Not priced: the whole stage is in memory until its first training step writes it out (the model is
built whole), and a checkpoint's save or load reads it back whole.

``grads`` and ``closing`` are this runtime's: they are counted for layers whose optimizer step
was measured (``update_peak_bytes``); other profiles (the papers', hand-written ones) are priced
as ``static + K kept + transient``. Each term only grows as a stage takes more layers or keeps
more micro-batches, which the planner's searches rely on (they stop lengthening a stage once it
no longer fits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dapple_lightning.planner._profile import ModelProfile
from dapple_lightning.planner._window import AUTO_WINDOW_MOST

__all__ = [
    "MemoryParts",
    "StageMemory",
    "cumulative",
    "offloaded_model_bytes",
    "peak_bytes",
    "range_max",
    "sparse_max",
]


def cumulative(values: Sequence[float]) -> tuple[float, ...]:
    """Prefix sums ``(0, v0, v0 + v1, ...)``: any range's sum in one subtraction."""
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)


@dataclass(frozen=True)
class StageMemory:
    """Prefix sums and a range-maximum table over a profile's layers: any stage's bytes in O(1)."""

    profile: ModelProfile
    optimizer_factor: float
    static: tuple[float, ...] = field(init=False, repr=False)
    """Prefix sums of parameters + gradients + optimizer state."""
    activation: tuple[float, ...] = field(init=False, repr=False)
    """Prefix sums of what each layer keeps per micro-batch at the profile batch."""
    output: tuple[float, ...] = field(init=False, repr=False)
    """``output[j]``: what a stage ending before layer ``j`` keeps of its output per micro-batch."""
    transient: tuple[tuple[float, ...], ...] = field(init=False, repr=False)
    update: tuple[float, ...] = field(init=False, repr=False)
    """Prefix sums of the optimizer step's temporaries."""
    grads: tuple[float, ...] = field(init=False, repr=False)
    """Prefix sums of the parameter bytes of layers priced with this runtime's extra gradients."""
    inputs: tuple[float, ...] = field(init=False, repr=False)
    """Prefix sums of each layer's input bytes (``cut_bytes``): what a recomputing stage keeps."""
    whole: tuple[tuple[float, ...], ...] = field(init=False, repr=False)
    """Range-maximum table of each layer's whole peak: a recomputing stage's transient."""

    def __post_init__(self) -> None:
        layers = self.profile.layers
        factor = self.optimizer_factor
        set_ = object.__setattr__
        set_(self, "static", cumulative([2.0 * x.param_bytes + x.optimizer_bytes(factor) for x in layers]))
        set_(self, "activation", cumulative([float(x.activation_memory) for x in layers]))
        # An unmeasured layer's own count already holds its output.
        output = [0.0] * (len(layers) + 1)
        for j in range(1, len(layers)):
            if layers[j - 1].saved_bytes is not None:
                output[j] = float(self.profile.cut_bytes[j])
        set_(self, "output", tuple(output))
        set_(self, "transient", sparse_max([float(x.transient_memory) for x in layers]))
        set_(self, "update", cumulative([float(x.update_peak_bytes or 0) for x in layers]))
        set_(
            self, "grads", cumulative([float(x.param_bytes if x.update_peak_bytes is not None else 0) for x in layers])
        )
        set_(self, "inputs", cumulative([float(c) for c in self.profile.cut_bytes[:-1]]))
        set_(self, "whole", sparse_max([float(x.activation_memory + x.transient_memory) for x in layers]))

    def static_bytes(self, start: int, end: int) -> float:
        """Parameters, gradients and optimizer state of layers ``[start, end)``."""
        return self.static[end] - self.static[start]

    def kept_bytes(self, start: int, end: int, samples: int, recompute: bool = False) -> float:
        """Bytes one micro-batch of ``samples`` samples keeps on a stage of layers ``[start, end)``."""
        if recompute:
            output = self.profile.cut_bytes[end] if end < len(self.profile.layers) else 0.0
            kept = self.inputs[end] - self.inputs[start] + output
        else:
            kept = self.activation[end] - self.activation[start] + self.output[end]
        return kept * samples / self.profile.profile_batch_size

    def transient_bytes(self, start: int, end: int, samples: int, recompute: bool = False) -> float:
        table = self.whole if recompute else self.transient
        return range_max(table, start, end) * samples / self.profile.profile_batch_size

    def parts(self, start: int, end: int, samples: int, replicas: int, recompute: bool = False) -> MemoryParts:
        """The terms of a stage's peak that do not depend on how many micro-batches it keeps (what
        :func:`peak_bytes` makes the peak of)."""
        grads = self.grads[end] - self.grads[start]
        update = self.update[end] - self.update[start]
        closing = max(update, 2 * grads) if replicas > 1 else update
        return (
            self.static_bytes(start, end),
            self.kept_bytes(start, end, samples, recompute),
            self.transient_bytes(start, end, samples, recompute),
            grads,
            closing,
        )

    def stage_bytes(
        self,
        start: int,
        end: int,
        samples: int,
        depth: int,
        replicas: int,
        micro_batches: int,
        recompute: bool = False,
        offload: int | str | None = None,
    ) -> float:
        """Peak bytes per device of layers ``[start, end)`` keeping ``depth`` micro-batches (see the module docstring)."""
        if offload is not None:
            return self.offloaded_bytes(start, end, samples, depth, offload)
        return peak_bytes(self.parts(start, end, samples, replicas, recompute), depth, micro_batches)

    def offloaded_bytes(self, start: int, end: int, samples: int, depth: int, offload: int | str) -> float:
        """The peak of layers ``[start, end)`` offloaded with window ``offload`` (``W`` or ``"auto"``),
        keeping ``depth`` micro-batches (see the module docstring)."""
        layers = self.profile.layers[start:end]
        moving, stepping = offloaded_model_bytes(
            [2.0 * x.param_bytes for x in layers],
            [2.0 * x.param_bytes + x.optimizer_bytes(self.optimizer_factor) for x in layers],
            AUTO_WINDOW_MOST if offload == "auto" else int(offload),
        )
        update = max((float(x.update_peak_bytes or 0) for x in layers), default=0.0)
        kept = self.kept_bytes(start, end, samples)
        return max(moving + depth * kept + self.transient_bytes(start, end, samples), stepping + update)


def offloaded_model_bytes(resident: Sequence[float], whole: Sequence[float], window: int) -> tuple[float, float]:
    """The most model state an offloaded stage holds, from each layer's parameter + gradient bytes
    (``resident``) and those plus its optimizer state (``whole``): while its window moves (the
    ``window + 1`` largest ``resident``), and while it steps layer by layer (the 2 largest ``whole``)."""
    moving = sum(sorted(resident, reverse=True)[: window + 1])
    return moving, sum(sorted(whole, reverse=True)[:2])


MemoryParts = tuple[float, float, float, float, float]
"""``(static, kept, transient, grads, closing)`` of one stage (see the module docstring)."""


def peak_bytes(parts: MemoryParts, depth: int, micro_batches: int) -> float:
    """A stage's peak from its :class:`StageMemory.parts` when it keeps ``depth`` of ``micro_batches``
    alive: what the cost model and the searches both compute, so their comparisons agree exactly."""
    static, kept, transient, grads, closing = parts
    after = depth if micro_batches > depth else depth - 1
    # max(max(depth * kept, grads + after * kept) + transient, closing), without max's calls (the
    # search asks this for every stage and warm-up depth): the same comparisons, the same float.
    alive = depth * kept
    stepping = grads + after * kept
    if stepping > alive:
        alive = stepping
    alive += transient
    return static + (closing if closing > alive else alive)


def sparse_max(values: Sequence[float]) -> tuple[tuple[float, ...], ...]:
    """Table ``t`` with ``t[k][i] = max(values[i : i + 2**k])``: any range's maximum in two lookups."""
    table = [tuple(values)]
    width = 1
    while 2 * width <= len(values):
        row = table[-1]
        table.append(tuple(max(row[i], row[i + width]) for i in range(len(values) - 2 * width + 1)))
        width *= 2
    return tuple(table)


def range_max(table: tuple[tuple[float, ...], ...], start: int, end: int) -> float:
    """``max(values[start:end])`` from :func:`sparse_max`'s table (0 for an empty range)."""
    if end <= start:
        return 0.0
    k = (end - start).bit_length() - 1
    return max(table[k][start], table[k][end - (1 << k)])
