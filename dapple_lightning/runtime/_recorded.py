"""A stage's traffic recorded, and a stage run again on its record, alone.

While training, :meth:`Pipeline.record_sends <dapple_lightning.runtime.Pipeline.record_sends>`
shows a recorder every message a rank sends (its link, destination, tensors); the strategy keeps
those bound for a stage that has no replica. After that stage's rank is lost, its replacement
loads an older checkpoint and runs the steps since then again, alone, under
:meth:`Pipeline.replay <dapple_lightning.runtime.Pipeline.replay>`, whose links are
:class:`RecordedLink`: they serve its receives from the record, in the order they were sent (the
order every receive of a channel is matched in), and drop its sends. The computation is the
original one, op for op, so its results are too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["Message", "RecordedLink", "recorded_links"]

Message = tuple[list[torch.Tensor], bool]
"""A message's tensors and whether they travelled as a tuple."""


class _Served:
    def __init__(self, message: Message, device: torch.device) -> None:
        self.message = ([t.to(device) for t in message[0]], message[1])

    def wait(self) -> Message:
        return self.message


class RecordedLink:
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


def recorded_links(
    device: torch.device, inbox: Mapping[tuple[str, int], Sequence[Message]], kinds: Sequence[str]
) -> dict[str, RecordedLink]:
    """One :class:`RecordedLink` per link in ``kinds`` (``"F"``, ``"B"``), serving ``inbox``'s messages
    (by link and source rank) on ``device``."""
    return {kind: RecordedLink(device, {src: m for (k, src), m in inbox.items() if k == kind}) for kind in kinds}
