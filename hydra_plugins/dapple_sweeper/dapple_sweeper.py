"""The ``DappleSweeper`` Hydra plugin: a thin class over :func:`dapple_lightning.search.run_sweep`."""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class DappleSweeper(Sweeper):
    """Asks Optuna for DAPPLE plans, runs each as a Hydra job, tells Optuna the job's return value."""

    def __init__(self, space: Any, **settings: Any) -> None:
        super().__init__()
        # Hydra resolves interpolations (``${model.num_layers}``) while instantiating the plugin.
        self._space = _plain(space)
        self._settings = {k: _plain(v) for k, v in settings.items()}
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> Any:
        from dapple_lightning.search import SweepSettings, run_sweep

        return run_sweep(self, SweepSettings.from_config(self._space, **dict(self._settings)), arguments)


def _plain(value: Any) -> Any:
    from omegaconf import ListConfig

    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value
