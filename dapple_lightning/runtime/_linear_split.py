"""A weight-gradient store for linear layers: the cheap way to split their backward.

Under a zero-bubble schedule a stage's backward is split into ``B`` (gradients of the stage's
inputs) and ``W`` (the weights'). The generic split (:mod:`._split_backward`) does it on the
autograd graph: ``W`` calls the engine once per group of weights, from the gradients recorded at
the graph's frontier, and runs some nodes (layer norms) twice. For linear layers, which hold most
of a model's weight work, this module does what zero-bubble implementations do instead (a "weight
gradient store"): during a split step's forwards each eligible ``nn.Linear`` runs through
:class:`_StoredLinear`, whose backward computes only the input's gradient and stores ``(input,
output gradient)``. :func:`backward_stored` (``B``) then makes one engine pass for the inputs'
gradients and, in the same pass, every other weight's (layer norms, embeddings, tied weights,
linear calls that are not an eligible layer's forward, such as ``nn.MultiheadAttention``'s
projections), kept in the store; the graph is freed there. ``W`` computes each stored weight's
gradient as one matmul (and the bias' as a sum) when it is taken (:class:`WeightGrads`) and
accumulates it from the parameter itself (:func:`~._split_backward.backward_weight`), a layer
(weight and bias) at a time, so that ``W`` holds one layer's gradient beyond ``.grad``, not the stage's; ``.grad``
accumulates and the post-accumulate hooks (the gradient reducer's) fire once per parameter per
``W``, as in a plain backward.

The Function takes the weight and bias detached: the graph has no edge from a stored layer to its
parameters, so a weight also used elsewhere gets that other gradient from ``B``'s pass and the
two are summed before ``W`` accumulates them, never counted twice. Eligible are layers whose
parameters the module tree holds once and that are not shared across stages.

Nothing the user keeps changes: a layer's ``forward`` is replaced by an instance attribute only
around a split step's forwards and ``B``'s (recomputed layers run their forward again inside
``B``), and removed after; the module's classes, parameters and ``state_dict`` stay as they are.
An instance attribute costs nothing on the other calls, where a ``TorchFunctionMode`` routing
``F.linear`` calls would see every call of the forward (docs/benchmarks.md compares the two).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dapple_lightning.runtime._split_backward import keep_freed_memory

__all__ = ["LinearStore", "StoredGrads", "WeightGrads", "backward_stored", "storable_linears"]


@dataclass(eq=False)
class StoredGrads:
    """One micro-batch's weight work from ``B`` to ``W``: per linear call ``((weight, bias or None),
    input, output gradient)``, and the other weights' gradients."""

    entries: list[tuple[tuple[nn.Parameter, nn.Parameter | None], torch.Tensor, torch.Tensor]] = field(
        default_factory=list
    )
    ready: dict[torch.Tensor, torch.Tensor] = field(default_factory=dict)
    """Gradients of the other weights, computed in ``B``."""

    def take(self) -> WeightGrads:
        """The parameters' gradients from the stored entries, each computed when ``W`` takes it
        (summed per parameter, in the parameters' dtype), emptying the store."""
        grads = WeightGrads(self.entries, self.ready)
        self.entries, self.ready = [], {}
        return grads


class WeightGrads(MutableMapping):
    """One ``W``'s weight gradients by parameter, each made when it is taken (``pop``): a stored
    layer's gradient is one matmul over its calls' entries, whose inputs and output gradients are
    released once the layer's weight and bias are both taken. ``W`` taking one layer at a time thus
    holds one layer's gradient, never the stage's. Gradients set here, and those ``B`` computed
    (``ready``), are held as given."""

    def __init__(
        self,
        entries: Sequence[tuple[tuple[nn.Parameter, nn.Parameter | None], torch.Tensor, torch.Tensor]] = (),
        ready: dict[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        # Newest first: B stored them from the stage's last layer down, so the last stored are
        # the likeliest still in cache.
        self._calls: dict[torch.Tensor, list[tuple[bool, torch.Tensor, torch.Tensor]]] = {}
        self._layers = list(dict.fromkeys(params for params, _, _ in reversed(entries)))
        for (weight, bias), x, g in reversed(entries):
            self._calls.setdefault(weight, []).append((False, x, g))
            if bias is not None:
                self._calls.setdefault(bias, []).append((True, x, g))
        self._given = dict(ready or {})

    def _made(self, p: torch.Tensor) -> torch.Tensor | None:
        calls = self._calls.get(p)
        if calls is None:
            return None
        with torch.no_grad():  # a gradient, not a graph: nothing keeps the entries alive after it
            grad = self._summed(calls)
        # A layer called twice under autocast sums its calls' gradients in the autocast dtype,
        # as autocast's one cached copy of the weight does, then converts.
        return grad.to(p.dtype)

    @staticmethod
    def _summed(calls: list[tuple[bool, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        grad = None
        for is_bias, x, g in calls:
            g2 = g.reshape(-1, g.shape[-1])
            part = g2.sum(0) if is_bias else g2.t().mm(x.reshape(-1, x.shape[-1]))
            grad = part if grad is None else grad + part
        assert grad is not None
        return grad

    def by_layer(self) -> list[list[torch.Tensor]]:
        """The parameters still here, a stored layer's weight and bias together, the others alone."""
        grouped = [[p for p in layer if p is not None and p in self] for layer in self._layers]
        alone = {id(p) for layer in grouped for p in layer}
        return [layer for layer in grouped if layer] + [[p] for p in self if id(p) not in alone]

    def __getitem__(self, p: torch.Tensor) -> torch.Tensor:
        made, given = self._made(p), self._given.get(p)
        if made is None and given is None:
            raise KeyError(p)
        return given if made is None else made if given is None else made + given

    def __setitem__(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        self._calls.pop(p, None)
        self._given[p] = grad

    def __delitem__(self, p: torch.Tensor) -> None:
        if p not in self:
            raise KeyError(p)
        self._calls.pop(p, None)
        self._given.pop(p, None)

    def __contains__(self, p: object) -> bool:
        return p in self._calls or p in self._given

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(dict.fromkeys([*self._calls, *self._given]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*self._calls, *self._given]))


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


def _layer_forward(layer: nn.Linear, store: StoredGrads, x: torch.Tensor) -> torch.Tensor:
    weight, bias = layer.weight, layer.bias
    routed = torch.is_grad_enabled() and x.requires_grad and weight.requires_grad
    if routed and (bias is None or bias.requires_grad):
        return _stored_linear(store, x, weight, bias)
    return F.linear(x, weight, bias)  # nothing to split here: autograd as usual


def storable_linears(module: nn.Module, shared: Sequence[nn.Parameter] = ()) -> list[nn.Linear]:
    """The linear layers of ``module`` whose weight work may be stored: ``nn.Linear``s running
    ``nn.Linear``'s own forward (not a subclass' override, not one set on the instance) whose
    parameters the module tree holds once and which are not in ``shared`` (tied across modules or
    stages)."""
    uses: dict[int, int] = {}
    for p in (*(p for _, p in module.named_parameters(remove_duplicate=False)), *shared):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [
        m
        for m in dict.fromkeys(module.modules())
        if isinstance(m, nn.Linear)
        and type(m).forward is nn.Linear.forward
        and "forward" not in vars(m)
        and all(uses.get(id(p)) == 1 for p in m.parameters(recurse=False))
    ]


class LinearStore:
    """Routes a stage's linear layers through the store while a split step runs them."""

    def __init__(self, layers: Sequence[nn.Linear]) -> None:
        self.layers = list(layers)

    @contextmanager
    def storing(self, store: StoredGrads | None) -> Iterator[None]:
        """Inside, the layers store their weight work in ``store`` (their graph's backward adds to
        it); with ``None``, they run as usual. Each layer's ``forward`` is an instance attribute
        inside, removed on the way out."""
        if store is None or not self.layers:
            yield
            return
        for layer in self.layers:
            layer.forward = partial(_layer_forward, layer, store)
        try:
            yield
        finally:
            for layer in self.layers:
                vars(layer).pop("forward", None)


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
    keep_freed_memory()  # the store holds gradients from B to W, as the generic split does
    pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
    needing = [t for t in inputs if t.requires_grad]
    weights = [w for w in weights if w.requires_grad]
    if not pairs or not (needing or weights):
        return [None] * len(inputs)
    found = torch.autograd.grad([o for o, _ in pairs], [*needing, *weights], [g for _, g in pairs], allow_unused=True)
    for w, g in zip(weights, found[len(needing) :]):
        if g is not None:
            store.ready[w] = store.ready[w] + g if w in store.ready else g
    by_id = {id(t): g for t, g in zip(needing, found)}
    return [by_id.get(id(t)) for t in inputs]
