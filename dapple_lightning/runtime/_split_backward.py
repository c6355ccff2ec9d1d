"""A stage's backward in two parts, as zero-bubble schedules run it: input gradients, weights later.

:func:`backward_input` (the schedule's ``B``) computes the gradients of the stage's inputs from
the saved graph and keeps the graph alive; it also records the gradients that reach the
*frontier*: the nodes where a weight's part of the graph joins the part that depends on the
inputs (the matmul that takes a layer's input and its weight, say). :func:`backward_weight`
(``W``) back-propagates from those recorded gradients to the weights only, so nothing of the
input path is computed twice, and accumulates into ``.grad`` through autograd, so the
parameters' post-accumulate hooks (the gradient reducer's) fire as in a plain backward.

The graph analysis follows what torch.distributed.pipelining's ``stage_backward_input`` /
``stage_backward_weight`` do. Where it cannot split (a weight whose path to the outputs never
meets the inputs' part, e.g. when no input needs a gradient), ``W`` back-propagates from the
outputs to the weights instead: correct, at the price of redoing the input path.

Between a micro-batch's ``B`` and its ``W`` the frontier gradients and the graph stay alive, so
later allocations cannot reuse their memory; when they are freed, glibc's malloc hands the top
of its heap back to the OS (its trim threshold follows the largest freed block, a few MiB) and
the next micro-batch faults the same pages in again, zero-filled by the kernel: measured by
``benchmarks/split_backward.py``, that costs more than the split's engine calls and graph
analysis together. So the first ``B`` of a process fixes malloc's thresholds
(:func:`keep_freed_memory`): freed memory stays in the process for reuse, as a caching allocator
would keep it, and the process' resident memory stays at its peak.
"""

from __future__ import annotations

import ctypes
import os
from collections import deque
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.overrides import has_torch_function

__all__ = ["WeightWork", "backward_input", "backward_weight", "keep_freed_memory"]

# glibc's mallopt parameters (malloc.h) and the values set: blocks up to 32 MiB (glibc's largest
# fixed mmap threshold on 64-bit) come from the heap, and up to 1 GiB free at its top stays mapped.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM_BYTES, _MMAP_BYTES = 1 << 30, 32 << 20
_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_malloc_fixed: bool | None = None


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in the process (once per process; see the module
    docstring). Does nothing where the C library has no ``mallopt`` (not glibc) or where one of
    glibc's ``MALLOC_*_`` tuning variables is set: the user's setting wins. Returns whether the
    thresholds are now fixed by this call or an earlier one."""
    global _malloc_fixed
    if _malloc_fixed is None:
        _malloc_fixed = False
        if not any(name in os.environ for name in _ENV):
            mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the C library the process runs
            # Both are set: setting one alone turns off glibc's moving mmap threshold, which
            # would then stay at 128 KiB and map (and fault in) every larger tensor afresh.
            if mallopt is not None and mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES) == 1:
                _malloc_fixed = mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES) == 1
    return _malloc_fixed


@dataclass(eq=False)
class _Group:
    """Weights whose frontiers overlap, and the gradients their frontier nodes received."""

    weights: list[torch.Tensor] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightWork:
    """What a ``B`` leaves for its ``W``: the retained graph's frontier gradients, or the outputs."""

    groups: list[_Group]
    outputs: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    fallback: list[torch.Tensor] = field(default_factory=list)
    """Weights back-propagated to from the outputs (no frontier to start from)."""


def _node(t: torch.Tensor) -> Node | None:
    """The node gradients of ``t`` flow into: its grad_fn, or a leaf's gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # the accumulator is created lazily


def _consumers(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """For every node reachable from ``roots``, the nodes that take its output (edges reversed)."""
    consumers: dict[Node, list[Node]] = {r: [] for r in roots}
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in consumers:
                consumers[child] = []
                queue.append(child)
            consumers[child].append(node)
    return consumers


def _reach(starts: Sequence[Node], consumers: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``starts`` toward the outputs, not crossing ``stop``; and the ``stop``
    nodes met."""
    seen, met = set(), set()
    queue = deque(n for n in starts if n in consumers)
    seen.update(queue)
    while queue:
        for parent in consumers[queue.popleft()]:
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def _groups(roots: list[Node], inputs: list[Node], weights: list[torch.Tensor]) -> tuple[list[_Group], list]:
    consumers = _consumers(roots)
    # Nodes whose output depends on an input. An input made inside the graph (a non-leaf) is not:
    # what comes before it (an embedding's weight, say) is weight work reached through it.
    dependent, _ = _reach(inputs, consumers, set())
    dependent -= set(inputs)
    groups: list[_Group] = []
    group_of: dict[Node, _Group] = {}
    fallback = []
    for weight in weights:
        acc = _node(weight)
        if acc not in consumers:
            continue  # this micro-batch's graph does not use it
        _, frontier = _reach([acc], consumers, dependent)
        if not frontier:
            fallback.append(weight)
            continue
        merged = _Group([weight], sorted(frontier, key=id))
        for other in {id(g): g for n in frontier if (g := group_of.get(n)) is not None}.values():
            merged.weights += other.weights
            merged.nodes += [n for n in other.nodes if n not in frontier]
            groups = [g for g in groups if g is not other]
        for n in merged.nodes:
            group_of[n] = merged
        groups.append(merged)
    return groups, fallback


def backward_input(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightWork]:
    """Gradients of ``inputs`` (``None`` where unused) from ``outputs`` seeded with ``grads``
    (``None`` for a scalar loss); the graph stays alive for :func:`backward_weight`."""
    keep_freed_memory()
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    needing = [t for t in inputs if t.requires_grad]
    weights = [w for w in weights if w.requires_grad]
    if not needing:  # the first stage: nothing upstream waits, so W does the whole backward
        groups, fallback = [], weights
    else:
        roots = [n for o, _ in pairs if (n := _node(o)) is not None]
        groups, fallback = _groups(roots, [n for t in needing if (n := _node(t)) is not None], weights)
    work = WeightWork(groups, fallback=fallback)
    if fallback:
        work.outputs, work.grads = [o for o, _ in pairs], [g for _, g in pairs]
    handles = [node.register_prehook(_recorder(group, node)) for group in groups for node in group.nodes]
    try:
        found: tuple[torch.Tensor | None, ...] = ()
        if pairs and needing:
            found = torch.autograd.grad(
                [o for o, _ in pairs], needing, [g for _, g in pairs], retain_graph=True, allow_unused=True
            )
    finally:
        for handle in handles:
            handle.remove()
    by_id = {id(t): g for t, g in zip(needing, found, strict=True)}
    return [by_id.get(id(t)) for t in inputs], work


def _recorder(group: _Group, node: Node):
    def record(grad_outputs):
        group.grads[node] = tuple(grad_outputs)

    return record


def _clamp(saved: tuple[torch.Tensor | None, ...]):
    return lambda grad_outputs: saved


# torch.autograd.backward re-checks every seed against its node's metadata and turns its
# arguments into tuples on each call; W makes one call per group per micro-batch (about 30 for a
# stage of 4 transformer blocks), and its seeds are what the engine itself gave those nodes in B.
# So it calls the engine the way torch.autograd.backward ends, where that function exists.
_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)


def _accumulate(edges: list[GradientEdge], seeds: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
    """Back-propagate ``seeds`` from ``edges`` into the ``.grad`` of ``weights`` only."""
    if _engine_run_backward is None or has_torch_function((*seeds, *weights)):
        torch.autograd.backward(edges, seeds, retain_graph=True, inputs=weights)
        return
    _engine_run_backward(
        tuple(edges), tuple(seeds), True, False, tuple(weights), allow_unreachable=True, accumulate_grad=True
    )


def backward_weight(work: WeightWork, stored: MutableMapping[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Accumulate the weights' gradients of a micro-batch whose :func:`backward_input` has run.

    ``stored`` maps weights to gradients computed outside the graph (the linear layers' store,
    :mod:`._linear_split`): each is accumulated in the same engine call as the weight's other
    gradient where it has one here, so that its ``.grad`` hooks fire once per ``W``; the others a
    layer at a time where ``stored`` says its layers (``by_layer()``, as
    :class:`~._linear_split.WeightGrads`, which makes each gradient as it is taken, does), else one
    weight at a time, so that one layer's gradients are alive at once. ``stored`` is emptied.
    """
    stored = {} if stored is None else stored
    for group in work.groups:
        edges, seeds = [], []
        for node in group.nodes:
            for i, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        _add_stored(edges, seeds, group.weights, stored)
        if not edges:
            continue
        # A frontier node below another one would receive its gradient twice (its own seed and the
        # flow from above): it gets what it received in B, once.
        clamps = [
            node.register_prehook(_clamp(group.grads[node]))
            for node in group.nodes
            if len(group.nodes) > 1 and node in group.grads
        ]
        try:
            _accumulate(edges, seeds, group.weights)
        finally:
            for handle in clamps:
                handle.remove()
    if work.fallback and work.outputs:
        extra = [w for w in work.fallback if w in stored]
        outputs, grads = [*work.outputs, *extra], [*work.grads, *(stored.pop(w) for w in extra)]
        torch.autograd.backward(outputs, grads, retain_graph=True, inputs=work.fallback)
    # Weights with no other gradient here: their accumulators seeded directly, a layer at a time (a
    # weight and its bias), so that one layer's gradient is made and added at once, not the stage's.
    by_layer = getattr(stored, "by_layer", None)
    for weights in by_layer() if by_layer is not None else [[w] for w in list(stored)]:
        edges, seeds = [], []
        _add_stored(edges, seeds, weights, stored)
        _accumulate(edges, seeds, weights)
    work.groups, work.outputs, work.grads = [], [], []


def _add_stored(edges: list[GradientEdge], seeds: list, weights: list[torch.Tensor], stored: MutableMapping) -> None:
    """Seed the gradient accumulators of ``weights`` that have a stored gradient (taking it)."""
    for w in weights:
        if w in stored:
            edges.append(GradientEdge(_node(w), 0))
            seeds.append(stored.pop(w))
