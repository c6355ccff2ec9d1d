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


def _judged(verdicts: list[str]) -> None:
    # The verdict comes within PEERS_END_WITHIN_S when the machine adds no delay; waiting ten times that,
    # only a heartbeat that never judges fails here, not a loaded machine.
    deadline = time.monotonic() + 10 * PEERS_END_WITHIN_S
    while not verdicts and time.monotonic() < deadline:
        time.sleep(INTERVAL_S)  # polling for the verdict with a deadline, not synchronisation


def test_a_rank_in_announced_long_host_work_is_not_lost_while_a_dead_rank_is() -> None:
    """A rank that holds the GIL (pickling a stage's state) beats no more; across machines its watchers
    cannot see it run. Inside announced work (``busy``) they grant it the lease's silence, while a rank
    that died outside any such work is judged within the usual bound."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    verdicts: list[str] = []
    ranks = [
        Heartbeat(r, 3, "127.0.0.1", store.port, "gloo", timedelta(seconds=60), namespace="b", on_lost=verdicts.append)
        for r in range(3)
    ]
    for rank in ranks:
        rank.start()
    with ranks[1].busy(600):
        # Silent first (its thread halted as a GIL-holding call starves it), so without the lease its
        # watchers would judge it first: rank 0 looks at rank 1 before rank 2.
        ranks[1]._stopped.set()
        ranks[1]._thread.join()
        ranks[2].stop(failed=True)  # killed, outside any announced work
        _judged(verdicts)
    ranks[0].stop(failed=False)
    assert len(verdicts) == 1 and verdicts[0].startswith("rank 2 sent no heartbeat"), verdicts


def test_a_rank_that_dies_inside_its_long_host_work_is_lost_when_the_lease_runs_out() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    verdicts: list[str] = []
    ranks = [
        Heartbeat(r, 2, "127.0.0.1", store.port, "gloo", timedelta(seconds=60), namespace="d", on_lost=verdicts.append)
        for r in range(2)
    ]
    for rank in ranks:
        rank.start()
    with ranks[1].busy(INTERVAL_S):  # a short lease; the rank dies inside it and never comes out
        ranks[1].stop(failed=True)
        _judged(verdicts)
    ranks[0].stop(failed=False)
    assert len(verdicts) == 1 and verdicts[0].startswith("rank 1 sent no heartbeat"), verdicts
