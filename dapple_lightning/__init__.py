"""DAPPLE synchronous pipeline + data parallel training for PyTorch Lightning.

``import dapple_lightning`` registers the strategy name ``"dapple"`` with Lightning, so
``Trainer(strategy="dapple")`` works after it. The import itself stays light: the pure rooms
(``dapple_lightning.plan``, ``.schedule``, ``.planner``) load without Lightning or
``torch.distributed``, and the strategy module is imported (and registered) the moment
Lightning's trainer package is, or when ``DappleStrategy`` is first asked for.
"""

from __future__ import annotations

import importlib
import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from typing import TYPE_CHECKING, Any

from dapple_lightning.plan import Plan, Stage
from dapple_lightning.schedule import Action, dapple_schedule, gpipe_schedule, zb_h1_schedule, zb_h2_schedule

if TYPE_CHECKING:
    from dapple_lightning.strategy import DappleStrategy

__all__ = [
    "Action",
    "DappleStrategy",
    "Plan",
    "Stage",
    "dapple_schedule",
    "gpipe_schedule",
    "zb_h1_schedule",
    "zb_h2_schedule",
]
__version__ = "0.1.0"

_STRATEGY = "dapple_lightning.strategy"
_LIGHTNING = "lightning.pytorch"


def __getattr__(name: str) -> Any:
    if name == "DappleStrategy":
        return importlib.import_module(_STRATEGY).DappleStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _RegisterWithLightning(MetaPathFinder):
    """Imports the strategy (which registers ``"dapple"``) right after ``lightning.pytorch`` loads.

    Lightning looks strategy names up when a ``Trainer`` is built, which needs
    ``lightning.pytorch``; registering as that package finishes loading is therefore always in
    time, and costs nothing to a process that never imports Lightning.
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)
        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            importlib.import_module(_STRATEGY)

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


if _LIGHTNING in sys.modules:
    importlib.import_module(_STRATEGY)
elif not any(isinstance(finder, _RegisterWithLightning) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWithLightning())
