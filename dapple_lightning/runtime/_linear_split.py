"""A weight-gradient store for linear layers: the cheap way to split their backward.

Under a zero-bubble schedule a stage's backward is split into ``B`` (gradients of the stage's
inputs) and ``W`` (the weights'). The generic split (:mod:`._split_backward`) does it on the
autograd graph: ``W`` calls the engine once per group of weights, from the gradients recorded at
the graph's frontier, and runs some nodes (layer norms) twice. For linear layers, which hold most
of a model's weight work, this module does what zero-bubble implementations do instead (a "weight
gradient store"): during a split step's forwards each ``F.linear`` call whose weight is eligible
runs through :class:`_StoredLinear`, whose backward computes only the input's gradient and stores
``(input, output gradient)``. :func:`backward_stored` (``B``) then makes one engine pass for the
inputs' gradients and, in the same pass, every other weight's (layer norms, embeddings, weights
used in ways other than ``F.linear``: small next to the linear layers'), kept in the store; the
graph is freed there. ``W`` computes each stored weight's gradient as one matmul (and the bias' as
a sum) and accumulates everything with one engine call from the parameters themselves
(:func:`~._split_backward.backward_weight`), so ``.grad`` accumulates and the post-accumulate hooks
(the gradient reducer's) fire once per parameter per ``W``, as in a plain backward.

The Function takes the weight and bias detached: the graph has no edge from a linear call to its
parameters, so a weight also used elsewhere gets that other gradient from ``B``'s pass and the
two are summed before ``W`` accumulates them, never counted twice. Eligible are the parameters
the module tree holds once and that are not shared across stages (tied weights take the generic
path, ``B``'s pass).

Nothing the user sees changes: the linear calls are routed by a ``TorchFunctionMode`` entered
only around a split step's forwards and ``B``'s (recomputed layers run their forward again inside
``B``); the module's classes, parameters and ``state_dict`` stay as they are. A linear call inside
another overridable function (``F.multi_head_attention_forward``'s projections) is not seen by the
mode and takes the generic path.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["LinearStore", "StoredGrads", "backward_stored", "storable_params"]


@dataclass(eq=False)
class StoredGrads:
    """One micro-batch's weight work from ``B`` to ``W``: per linear call ``((weight, bias or None),
    input, output gradient)``, and the other weights' gradients."""

    entries: list[tuple[tuple[nn.Parameter, nn.Parameter | None], torch.Tensor, torch.Tensor]] = field(
        default_factory=list
    )
    ready: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    """Gradients of the other weights, computed in ``B``."""

    def take(self) -> dict[nn.Parameter, torch.Tensor]:
        """The parameters' gradients from the stored entries (summed per parameter, in the
        parameters' dtype), emptying the store."""
        stored: dict[torch.Tensor, torch.Tensor] = {}
        # Newest first: B stored them from the stage's last layer down, so the last stored are
        # the likeliest still in cache.
        for (weight, bias), x, g in reversed(self.entries):
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            pairs = [(weight, g2.t().mm(x2))]
            if bias is not None:
                pairs.append((bias, g2.sum(0)))
            for p, grad in pairs:
                stored[p] = stored[p] + grad if p in stored else grad
        # A layer called twice under autocast sums its calls' gradients in the autocast dtype,
        # as autocast's one cached copy of the weight does, then converts.
        grads, self.ready = self.ready, {}
        for p, grad in stored.items():
            grad = grad.to(p.dtype)
            grads[p] = grads[p] + grad if p in grads else grad
        self.entries = []
        return grads


class _StoredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input's gradient and stores the weights' work."""

    @staticmethod
    def forward(ctx, x, weight, bias, store: StoredGrads, params):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.params = store, params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        ctx.store.entries.append((ctx.params, x, grad_out))
        return grad_out.matmul(weight), None, None, None, None


def _stored_linear(store: StoredGrads, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None):
    w, b = weight.detach(), None if bias is None else bias.detach()
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # As autocast runs a linear layer: inputs in its dtype (x's cast stays in the graph, so
        # its gradient goes back in x's dtype), and the weights' gradients in that dtype too,
        # converted to the parameters' when W accumulates them.
        dtype = torch.get_autocast_dtype(device)
        x, w = x.to(dtype), w.to(dtype)
        b = None if b is None else b.to(dtype)
        with torch.autocast(device, enabled=False):
            return _StoredLinear.apply(x, w, b, store, (weight, bias))
    return _StoredLinear.apply(x, w, b, store, (weight, bias))


class _Routing(TorchFunctionMode):
    """Sends ``F.linear`` calls on eligible parameters through the store; everything else as is."""

    def __init__(self, eligible: set[int], store: StoredGrads) -> None:
        super().__init__()
        self.eligible, self.store = eligible, store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, bias = _linear_args(*args, **kwargs)
            if (
                id(weight) in self.eligible
                and (bias is None or (id(bias) in self.eligible and bias.requires_grad == weight.requires_grad))
                and x.requires_grad
                and weight.requires_grad
            ):
                return _stored_linear(self.store, x, weight, bias)
        return func(*args, **kwargs)


def _linear_args(input, weight, bias=None):
    return input, weight, bias


def storable_params(module: nn.Module, shared: Sequence[nn.Parameter] = ()) -> list[nn.Parameter]:
    """The parameters of ``module`` whose linear work may be stored: those the module tree holds
    once and that are not in ``shared`` (parameters tied across modules or stages are not)."""
    uses: dict[int, int] = {}
    for p in (*(p for _, p in module.named_parameters(remove_duplicate=False)), *shared):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return list({id(p): p for p in module.parameters() if uses[id(p)] == 1}.values())


class LinearStore:
    """Routes a stage's linear calls on ``params`` through the store while a split step runs them."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self._eligible = {id(p) for p in self.params}

    def storing(self, store: StoredGrads | None) -> AbstractContextManager:
        """Inside, eligible linear calls store their weight work in ``store`` (their graph's
        backward adds to it); with ``None`` or no parameters, everything runs as usual."""
        if store is None or not self._eligible:
            return nullcontext()
        return _Routing(self._eligible, store)


_run_engine = getattr(torch.autograd.graph, "_engine_run_backward", None) or (
    torch.autograd.variable.Variable._execution_engine.run_backward
)


def backward_stored(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    store: StoredGrads,
) -> list[torch.Tensor | None]:
    """``B`` where the linear layers stored their work: one engine pass gives the gradients of
    ``inputs`` (returned, ``None`` where unused) and of the ``weights`` the store does not cover
    (kept in ``store.ready`` for ``W``); the linear calls' backwards add their entries to ``store``.
    The graph is freed."""
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    needing = [t for t in inputs if t.requires_grad]
    weights = [w for w in weights if w.requires_grad]
    if not pairs or not (needing or weights):
        return [None] * len(inputs)
    # The engine is called directly: torch.autograd.grad is itself an overridable function, and
    # the routing mode would be off while it runs (a mode is popped while it handles a call), so
    # layers recomputed inside B would not be routed as their forward was.
    seeds = [torch.ones_like(o) if g is None else g for o, g in pairs]
    found = _run_engine(
        tuple(o for o, _ in pairs),
        tuple(seeds),
        False,
        False,
        (*needing, *weights),
        allow_unreachable=True,
        accumulate_grad=False,
    )
    for w, g in zip(weights, found[len(needing) :]):
        if g is not None:
            store.ready[w] = store.ready[w] + g if w in store.ready else g
    by_id = {id(t): g for t, g in zip(needing, found)}
    return [by_id.get(id(t)) for t in inputs]
