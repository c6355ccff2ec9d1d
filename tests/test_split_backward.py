"""The backward split into input gradients (B) and weight gradients (W) equals one plain backward;
and the split keeps freed memory in the process."""

from __future__ import annotations

import ast
import os
import platform
import subprocess
import sys

import pytest
import torch
from torch import nn

from dapple_lightning.runtime._split_backward import backward_input, backward_weight


class Tied(nn.Module):
    """A layer applied twice, a weight used after the last layer, and a weight never used."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.shared = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(3))
        self.unused = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.shared(torch.tanh(self.shared(torch.tanh(self.first(x)))))
        out = self.head(h) * self.scale + self.scale.pow(2)
        return out, h.detach()  # a second output without a gradient


def _grads(split: bool, input_grad: bool) -> tuple[torch.Tensor | None, dict[str, torch.Tensor | None]]:
    torch.manual_seed(0)
    model = Tied()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4, generator=g).requires_grad_(input_grad)
    seed = torch.randn(5, 3, generator=g)
    out, _ = model(x)
    if split:
        found, work = backward_input([out], [seed], [x], list(model.parameters()))
        assert all(p.grad is None for p in model.parameters()), "B must leave the weights alone"
        splits = (len(work.groups), len(work.fallback))
        backward_weight(work)
        x_grad = found[0]
        assert splits == ((4, 0) if input_grad else (0, 8))  # first, shared (both uses), head, scale
    else:
        out.backward(seed)
        x_grad = x.grad
    return x_grad, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("input_grad", [True, False])
def test_input_then_weights_equals_one_backward(input_grad: bool) -> None:
    want_x, want = _grads(split=False, input_grad=input_grad)
    got_x, got = _grads(split=True, input_grad=input_grad)
    if input_grad:
        torch.testing.assert_close(got_x, want_x)
    else:
        assert got_x is None
    assert got["unused"] is None and want["unused"] is None
    for name, grad in want.items():
        if grad is not None:
            torch.testing.assert_close(got[name], grad, msg=name)


def test_weights_fire_post_accumulate_hooks_in_w() -> None:
    # The gradient reducer learns from these hooks that a weight's gradient is final.
    layer = nn.Linear(3, 3)
    fired: list[str] = []
    for name, p in layer.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: fired.append(name))
    x = torch.randn(2, 3, requires_grad=True)
    found, work = backward_input([layer(x).sum()], [None], [x], list(layer.parameters()))
    assert found[0] is not None and fired == []
    backward_weight(work)
    assert sorted(fired) == ["bias", "weight"]


def test_an_input_made_inside_the_graph_leaves_what_made_it_to_w() -> None:
    # A stage whose input comes out of an embedding the stage also runs: the embedding's weight
    # gets its gradient in W, through the input.
    embed, layer = nn.Linear(3, 4), nn.Linear(4, 2)
    x = torch.randn(5, 3)
    hidden = embed(x)
    out = layer(torch.tanh(hidden))
    weights = [*embed.parameters(), *layer.parameters()]
    want = torch.autograd.grad(out.sum(), [hidden, *weights], retain_graph=True)
    found, work = backward_input([out], [torch.ones_like(out)], [hidden], weights)
    backward_weight(work)
    torch.testing.assert_close(found[0], want[0])
    for p, g in zip(weights, want[1:], strict=True):
        torch.testing.assert_close(p.grad, g)


_STASH = """
import resource, sys, torch
from dapple_lightning.runtime._split_backward import keep_freed_memory
print(keep_freed_memory())
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # A stash held across later work, as W's frontier gradients are held from B: 24 blocks of
    # 0.5-2 MiB, then 8 more allocated after them; all freed.
    held = [torch.ones(n << 17) for n in (1, 2, 3, 4) * 6]
    later = [torch.ones(1 << 18) for _ in range(8)]
    del held, later
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


def _stash_faults(env: dict[str, str]) -> tuple[bool, list[int]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | env
    out = subprocess.run([sys.executable, "-c", _STASH], env=env, capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split("\n")[:2]
    return kept == "True", ast.literal_eval(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc's malloc")
def test_freed_memory_stays_in_the_process_unless_malloc_is_tuned_by_the_user() -> None:
    # Left to itself, glibc hands such a freed stash back to the OS and faults it in again on
    # later steps (about as many pages as the first step here); kept, later steps reuse it. Kept,
    # the four later steps fault a few hundred pages at most (glibc now and then maps a block
    # afresh), untuned about four times the first step's: the bound sits far from both.
    kept, faults = _stash_faults({})
    assert kept and faults[0] > 5000
    assert sum(faults[1:]) < 0.2 * faults[0], faults
    kept, faults = _stash_faults({"MALLOC_TRIM_THRESHOLD_": str(1 << 20)})
    assert not kept
    assert sum(faults[1:]) > 2 * faults[0], faults
