"""DAPPLE synchronous pipeline + data parallel training for PyTorch Lightning.

Importing the package registers the strategy name ``"dapple"`` with Lightning, so
``Trainer(strategy="dapple")`` works after ``import dapple_lightning``.
"""

from dapple_lightning.plan import Plan, Stage
from dapple_lightning.schedule import Action, dapple_schedule, gpipe_schedule
from dapple_lightning.strategy import DappleStrategy

__all__ = ["Action", "DappleStrategy", "Plan", "Stage", "dapple_schedule", "gpipe_schedule"]
__version__ = "0.1.0"
