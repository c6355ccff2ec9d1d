"""The heartbeat's verdicts, on a real store in one process: a rank that went silent is lost, one that
left cleanly is not. (Whole jobs with a killed and a stopped rank under torchrun: test_failures.py.)"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from dapple_lightning.strategy._heartbeat import INTERVAL_S, PEERS_END_WITHIN_S, Heartbeat


def test_a_silent_rank_is_lost_and_one_that_left_is_not() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    verdicts: list[str] = []
    ranks = [
        Heartbeat(r, 3, "127.0.0.1", store.port, "gloo", timedelta(seconds=60), namespace="t", on_lost=verdicts.append)
        for r in range(3)
    ]
    for rank in ranks:
        rank.start()
    ranks[1].stop(failed=False)  # left cleanly: its watchers stop watching it
    ranks[2].stop(failed=True)  # beats no more, as if killed: rank 0 watches it
    # The verdict comes within PEERS_END_WITHIN_S when the machine adds no delay; waiting ten times that,
    # only a heartbeat that never judges fails here, not a loaded machine.
    deadline = time.monotonic() + 10 * PEERS_END_WITHIN_S
    while not verdicts and time.monotonic() < deadline:
        time.sleep(INTERVAL_S)  # polling for the verdict with a deadline, not synchronisation
    ranks[0].stop(failed=False)
    assert len(verdicts) == 1 and verdicts[0].startswith("rank 2 sent no heartbeat"), verdicts
    assert ranks[0].lost == verdicts[0]
