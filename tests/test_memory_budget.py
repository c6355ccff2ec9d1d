"""``memory_limit``: read as bytes or text, never exceeded by plan="auto", warned about for a plan
given by hand (with the stage and the numbers)."""

from __future__ import annotations

import inspect
import time

import pytest
import torch

from dapple_lightning import Plan
from dapple_lightning.autoplan import choose_plan
from dapple_lightning.planner import format_bytes, over_budget, parse_memory, stage_memory_lines
from dapple_lightning.strategy._memory import predicted_memory
from dapple_lightning.surgery import find_chain

import models
from harness import fit

TWO_STAGES = Plan.coerce({"micro_batches": 2, "stages": [{"layers": [0, 5]}, {"layers": [5, 7]}]})


@pytest.mark.parametrize(
    ("text", "expected"),
    [("6GiB", 6 * 2**30), ("512 MB", 512e6), ("1.5gb", 1.5e9), ("2048", 2048.0), (4096, 4096.0), (1e9, 1e9)],
)
def test_memory_limits_read_as_bytes(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("6 parsecs", ValueError, r"memory_limit='6 parsecs' is not a size; .* e\.g\. '6GiB'"),
        ("GiB", ValueError, "is not a size"),
        (0, ValueError, "finite number of bytes > 0, got 0"),
        (float("inf"), ValueError, "finite number of bytes > 0"),
        (True, TypeError, "bytes .* or text like '6GiB', got True"),
        ([6], TypeError, "got \\[6\\]"),
    ],
)
def test_bad_memory_limits_are_refused_with_the_value(value, error, match):
    with pytest.raises(error, match=match):
        parse_memory(value)


def test_the_strategy_refuses_a_bad_limit_up_front():
    from dapple_lightning import DappleStrategy

    with pytest.raises(ValueError, match="memory_limit='lots'"):
        DappleStrategy(Plan.straight(7, 2), memory_limit="lots")


def test_auto_never_chooses_a_plan_over_the_limit():
    layers = models.MLP().layers
    x = torch.randn(8, models.IN)
    roomy = choose_plan(layers, x, torch.device("cpu"), global_batch=8, memory_limit=2**30)
    peak = max(roomy.stage_memory_bytes)
    assert 0 < peak <= 2**30
    assert "predicted peak memory per rank (budget 1.00 GiB):" in roomy.report()
    assert "stage 0 (layers 0-6, 1 replica):" in roomy.report()
    # Below what the only plan of one rank needs, even recomputing or offloaded: refused, naming the least need.
    with pytest.raises(ValueError, match=r"no plan fits in .* the least memory any plan needs is .* neither recomp"):
        choose_plan(layers, x, torch.device("cpu"), global_batch=8, memory_limit=peak / 2)


def test_a_given_plan_is_priced_per_stage_and_the_stages_over_the_limit_are_named():
    module = models.MLP()
    x, y = next(iter(models.loader()))
    plan = TWO_STAGES
    peaks = predicted_memory(module, find_chain(module), plan, (x, y))
    # Stage 0 holds 3 of the 4 Linear layers and keeps 2 micro-batches: the larger.
    assert peaks[0] > peaks[1] > 0
    assert all(p.grad is None for p in module.parameters())  # the module is left as it was
    limit = (peaks[0] + peaks[1]) / 2
    message = over_budget(plan, peaks, limit)
    assert message is not None and "stage 0 (layers 0-4)" in message and "stage 1" not in message
    assert format_bytes(peaks[0]) in message and "more micro-batches" in message
    assert over_budget(plan, peaks, peaks[0]) is None


def test_a_given_plan_with_offload_is_priced_at_its_window_and_refused_only_when_even_that_is_over():
    module = models.DeepMLP()
    batch = next(iter(models.loader()))

    def priced(offload):
        plan = Plan.coerce({"micro_batches": 3, "stages": [{"layers": [0, 6], "offload": offload}, {"layers": [6, 8]}]})
        return plan, predicted_memory(module, find_chain(module), plan, batch)

    (whole_plan, whole), (one_plan, one), (auto_plan, auto) = priced(None), priced(1), priced("auto")
    # Window 1 holds 2 of the 6 layers' parameters + gradients; auto is priced at its widest window.
    assert one[0] < auto[0] < whole[0] and one[1] == auto[1] == whole[1]
    roomy = (auto[0] + whole[0]) / 2
    assert over_budget(one_plan, one, roomy) is None and over_budget(auto_plan, auto, roomy) is None
    assert "stage 0 (layers 0-5)" in over_budget(whole_plan, whole, roomy)
    assert "offload: 1 or 'auto'" in over_budget(whole_plan, whole, roomy)
    assert "offloaded, window 1" in stage_memory_lines(one_plan, one, roomy)[0]
    # Over the limit even offloaded: named like any stage.
    message = over_budget(one_plan, one, one[0] * 0.9)
    assert message is not None and f"stage 0 (layers 0-5) {format_bytes(one[0])}" in message


PRICING_TIMEOUT_S = 10
"""The process group's timeout in the test below: short, so that pricing outlasts it quickly, but long
enough that no rendezvous or collective of a loaded machine hits it."""


class SlowToProfile(models.MLP):
    """Rank 0 prices a given plan against memory_limit alone; here that takes longer than the process
    group's timeout (a large model would), while training itself is quick."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[1] = _SlowWhilePriced()


class _SlowWhilePriced(torch.nn.Tanh):
    slept = False

    def forward(self, x):
        if not self.slept and any(frame.function == "predicted_memory" for frame in inspect.stack(0)):
            self.slept = True
            time.sleep(PRICING_TIMEOUT_S + 1)  # stands for a large layer's work, not for synchronisation
        return super().forward(x)


def test_the_other_ranks_wait_past_the_timeout_while_rank_0_prices_a_given_plan(tmp_path):
    kwargs = {"memory_limit": "1GiB", "timeout": PRICING_TIMEOUT_S}
    metrics, _ = fit(SlowToProfile, tmp_path, plan=TWO_STAGES, strategy_kwargs=kwargs)
    assert len(metrics["train_loss"]) == 4  # both ranks trained past rank 0's pricing


def test_a_given_plan_is_profiled_on_the_ranks_device_not_where_the_module_waits(monkeypatch):
    from types import SimpleNamespace

    from lightning.pytorch.trainer.states import TrainerFn

    from dapple_lightning.strategy import _memory

    module = models.MLP()
    batch = next(iter(models.loader()))
    plan_device = torch.device("cuda", 0)  # a device object only: the profile itself is stubbed out here
    seen = []
    monkeypatch.setattr(_memory, "draw_batch", lambda loader: batch)
    monkeypatch.setattr(_memory, "training_loader", lambda trainer: None)
    monkeypatch.setattr(_memory, "move_data_to_device", lambda data, device: seen.append(("batch", device)) or data)
    monkeypatch.setattr(_memory, "predicted_memory", lambda *args: seen.append(("profile", args[-1])) or (1.0, 1.0))
    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=plan_device), state=SimpleNamespace(fn=TrainerFn.FITTING), global_rank=0
    )
    _memory.warn_if_over_budget(module, find_chain(module), TWO_STAGES, trainer, 2.0)
    assert seen == [("batch", plan_device), ("profile", plan_device)]
    assert next(module.parameters()).device.type == "cpu"


def test_a_profile_on_the_modules_own_device_is_the_same_as_before_and_leaves_it_there():
    module = models.MLP()
    x, y = next(iter(models.loader()))
    chain = find_chain(module)
    assert predicted_memory(module, chain, TWO_STAGES, (x, y), torch.device("cpu")) == predicted_memory(
        module, chain, TWO_STAGES, (x, y)
    )
    assert all(p.device.type == "cpu" and p.grad is None for p in module.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_given_plan_is_profiled_on_the_gpu_a_window_at_a_time_and_the_module_goes_back():
    module = models.MLP()
    x, y = next(iter(models.loader()))
    gpu = torch.device("cuda", 0)
    peaks = predicted_memory(module, find_chain(module), TWO_STAGES, (x.to(gpu), y.to(gpu)), gpu)
    assert all(p > 0 for p in peaks)
    assert all(t.device.type == "cpu" for t in [*module.parameters(), *module.buffers()])
