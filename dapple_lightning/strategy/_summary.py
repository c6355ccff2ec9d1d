"""Lightning's model summary of the whole model, as one device prints it.

After setup each rank holds its stage only: a stand-in replaces the pipelined containers, and
Lightning's ``ModelSummary`` callback, which summarises the module at ``on_fit_start``, would list
that stand-in and count this stage's parameters alone. :func:`summarize_whole` hands each such
callback a summary taken at setup with the containers whole (other stages' layers on the meta
device, where they have shapes and no values): its rows, parameter counts and totals are one
device's. The plan's table comes just before it (the strategy prints it at setup).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from typing_extensions import override

from dapple_lightning.strategy._lightning import Patches
from dapple_lightning.surgery import Cut

__all__ = ["WholeSummary", "summarize_whole"]


class WholeSummary(Summary):
    """Lightning's summary of ``module``, read at once while its containers are whole.

    Lightning reads parameters when it prints, after the containers are cut again, so the rows and
    totals are read here. ``example_input_array`` is not run: other stages' layers cannot compute
    on this rank, so the sizes read ``?``.
    """

    def __init__(self, module: Any, max_depth: int) -> None:
        super().__init__(module, max_depth=max_depth)
        self._totals = (super().total_parameters, super().trainable_parameters, super().total_training_modes)
        self._data = super()._get_summary_data()

    @override
    def _forward_example_input(self) -> None:
        return None

    @override
    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self._data

    @property
    @override
    def total_parameters(self) -> int:
        return self._totals[0]

    @property
    @override
    def trainable_parameters(self) -> int:
        return self._totals[1]

    @property
    @override
    def total_training_modes(self) -> dict[str, int]:
        return self._totals[2]


def summarize_whole(patches: Patches, callbacks: list[Any], module: Any, cut: Cut) -> None:
    """Every ``ModelSummary`` callback (``RichModelSummary`` too) among ``callbacks`` prints the whole
    model's summary, taken now, instead of summarising this rank's stage at ``on_fit_start``."""
    wanted = [c for c in callbacks if isinstance(c, ModelSummary) and c._max_depth]
    if not wanted:
        return
    with cut.whole():
        for callback in wanted:
            summary = WholeSummary(module, callback._max_depth)
            patches.set(callback, "_summary", lambda trainer, pl_module, _summary=summary: _summary)
