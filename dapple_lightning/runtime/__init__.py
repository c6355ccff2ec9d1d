"""The runtime: one rank's share of a plan, executed step by step.

- :class:`Pipeline` runs the rank's lowered program (see :func:`dapple_lightning.schedule.lower`)
  from a dispatch table: forwards, backwards, sends, receives and the gradient sum; all it asks
  of the step it runs is one :class:`UserStep` (the user's code per micro-batch, the context
  around it, the values the last stage's replicas sum), and it reports :class:`StepStats`;
  :meth:`Pipeline.record_sends` and :meth:`Pipeline.replay` record a rank's traffic and run a
  lost stage's steps again on that record, alone;
- :class:`StageModule` stands in for the user's container and takes one :class:`StageCall`
  per micro-batch from the executor (the hand-off between the user's step and the pipeline);
  :func:`stand_in_layers` spreads that hand-off over the layers the user's code calls one by one
  (the blocks of an ``nn.ModuleList`` it loops over, a chain of containers; other stages' layers
  become :class:`Placeholder` modules);
- :class:`GradientReducer` sums gradients over a group while backward still runs;
  :class:`ShardedReducer` does it for a stage whose replicas shard their state (``shard:``, FSDP2);
- :class:`Link` and :func:`share` move tensors and values between ranks, on the groups of
  :class:`P2PGroups`;
- :class:`Offloader` keeps an offloaded stage's layers on disk with a working window in memory;
- :func:`backward_input` and :func:`backward_weight` split a micro-batch's backward into its
  input gradients (a zero-bubble ``B``) and its weights' (``W``); :class:`LinearStore`,
  :class:`StoredGrads` and :func:`backward_stored` do it cheaper for linear layers (a
  weight-gradient store);
- :class:`Timeline` records spans for a Chrome trace;
- :func:`synchronize_batch_norms` and :func:`agree_buffers` keep a stage's replicas' batch
  statistics and buffers together.

No Lightning and no Optuna here.
"""

from dapple_lightning.runtime._batchnorm import agree_buffers, synchronize_batch_norms
from dapple_lightning.runtime._blocks import Placeholder, stand_in_layers
from dapple_lightning.runtime._comm import (
    Link,
    P2PGroups,
    Pending,
    Signature,
    broadcast,
    p2p_groups,
    share,
    stage_group,
)
from dapple_lightning.runtime._contract import StepStats, UserStep
from dapple_lightning.runtime._executor import Pipeline
from dapple_lightning.runtime._linear_split import LinearStore, StoredGrads, backward_stored, storable_linears
from dapple_lightning.runtime._offload import Offloader
from dapple_lightning.runtime._recorded import Message
from dapple_lightning.runtime._reducer import GradientReducer
from dapple_lightning.runtime._sharding import (
    ShardedReducer,
    follow_shards,
    full_value,
    local_part,
    shard_like,
    unshard_stage,
)
from dapple_lightning.runtime._split_backward import WeightWork, backward_input, backward_weight
from dapple_lightning.runtime._stage import StageCall, StageExit, StageModule
from dapple_lightning.runtime._timeline import DeviceEvent, Event, Timeline, bubble_fractions, write_chrome_trace

__all__ = [
    "DeviceEvent",
    "Event",
    "GradientReducer",
    "LinearStore",
    "Link",
    "Message",
    "Offloader",
    "P2PGroups",
    "Pending",
    "Pipeline",
    "Placeholder",
    "ShardedReducer",
    "Signature",
    "StageCall",
    "StageExit",
    "StageModule",
    "StepStats",
    "StoredGrads",
    "Timeline",
    "UserStep",
    "WeightWork",
    "agree_buffers",
    "backward_input",
    "backward_stored",
    "backward_weight",
    "broadcast",
    "bubble_fractions",
    "follow_shards",
    "full_value",
    "local_part",
    "p2p_groups",
    "shard_like",
    "share",
    "stage_group",
    "stand_in_layers",
    "storable_linears",
    "synchronize_batch_norms",
    "unshard_stage",
    "write_chrome_trace",
]
