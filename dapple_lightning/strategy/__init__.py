"""The Lightning glue: :class:`DappleStrategy`, registered with Lightning as ``"dapple"``.

The strategy keeps Lightning's lifecycle and hands the work to small modules: the micro-batch
step and its gradient set-aside (``_step``), checkpoints in the single-device layout,
full (``_checkpoint``, streamed by ``_stream``) or sharded (``_sharded``), ``plan="auto"``'s setup (``_auto``), the process groups (``_pipelines``),
the spawn launcher and every change to Lightning's and the user's objects (``_lightning``), and the heartbeat that ends every rank when one is lost (``_heartbeat``).
"""

from lightning.pytorch.strategies import StrategyRegistry

from dapple_lightning.strategy._lightning import FORKSERVER_PRELOAD
from dapple_lightning.strategy._refusals import check_before_start
from dapple_lightning.strategy._sharded import consolidate_checkpoint
from dapple_lightning.strategy._strategy import DappleStrategy

__all__ = ["FORKSERVER_PRELOAD", "DappleStrategy", "check_before_start", "consolidate_checkpoint"]

if "dapple" not in StrategyRegistry:
    StrategyRegistry.register(
        "dapple", DappleStrategy, description="DAPPLE synchronous pipeline + data parallel training (plan='auto')"
    )
