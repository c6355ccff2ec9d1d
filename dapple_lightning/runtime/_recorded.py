"""A stage's traffic recorded, and a stage run again on its record, alone.

While training, :attr:`Pipeline.record <dapple_lightning.runtime.Pipeline>` sees every message a
rank sends (its link, destination, tensors); the strategy keeps those bound for a stage that has
no replica. After that stage's rank is lost, its replacement loads an older checkpoint and runs
the steps since then again, alone: :func:`replaying` serves its receives from the record, in the
order they were sent (the order every receive of a channel is matched in), drops its sends, and
opens no connection. The computation is the original one, op for op, so its results are too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["Message", "replaying"]

Message = tuple[list[torch.Tensor], bool]
"""A message's tensors and whether they travelled as a tuple."""


class _Served:
    def __init__(self, message: Message, device: torch.device) -> None:
        self.message = ([t.to(device) for t in message[0]], message[1])

    def wait(self) -> Message:
        return self.message


class _RecordedLink:
    """A link whose receives come from a record (by source, in order) and whose sends go nowhere."""

    def __init__(self, device: torch.device, inbox: Mapping[int, Sequence[Message]]) -> None:
        self.device = device
        self.inbox = {src: deque(messages) for src, messages in inbox.items()}

    def post(self, src: int, rows: int) -> _Served:
        queue = self.inbox.get(src)
        if not queue:
            raise RuntimeError(f"dapple replay: the record holds no further message from rank {src}")
        return _Served(queue.popleft(), self.device)

    def send(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextmanager
def replaying(pipeline: Any, inbox: Mapping[tuple[str, int], Sequence[Message]]) -> Iterator[None]:
    """Run ``pipeline``'s steps on ``inbox`` (by link ``"F"``/``"B"`` and source rank), with no
    collective: a stage with replicas or shared parameters (whose gradients are summed with other
    ranks) cannot run alone."""
    if pipeline.reducers:
        raise RuntimeError("dapple replay: only a stage without replicas or shared parameters can run alone")
    links, alone = pipeline.links, pipeline.alone
    pipeline.links = {
        kind: _RecordedLink(pipeline.device, {src: m for (k, src), m in inbox.items() if k == kind}) for kind in links
    }
    pipeline.alone = True
    try:
        yield
    finally:
        pipeline.links, pipeline.alone = links, alone
