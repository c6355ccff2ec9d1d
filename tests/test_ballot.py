"""The per-step vote of recovery (strategy/_ballot.py), on a real TCPStore with threads as ranks."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from dapple_lightning.strategy._ballot import ABORT, Ballot, Undecided


@pytest.fixture
def server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def client(server: dist.TCPStore, timeout_s: float = 30.0) -> dist.TCPStore:
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout, wait_for_workers=False)


def ballots(server: dist.TCPStore, n: int, world: int = 3) -> list[Ballot]:
    return [Ballot(dist.PrefixStore("fit0", client(server)), world) for _ in range(n)]


def test_every_rank_commits_when_all_vote(server: dist.TCPStore) -> None:
    first, second, last = ballots(server, 3)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(b.cast, 7) for b in (first, second)]
        assert last.cast(7) is True
        assert [w.result(timeout=30) for w in waiting] == [True, True]
    last.forget(7)
    assert not server.check(["fit0/votes/7"]) and not server.check(["fit0/decision/7"])


def test_an_abort_before_the_last_vote_stops_every_rank(server: dist.TCPStore) -> None:
    first, second, late, heartbeat = ballots(server, 4)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(b.cast, 3) for b in (first, second)]
        assert heartbeat.abort(3, learn=False) is False  # the first abort knows: votes are missing
        assert [w.result(timeout=30) for w in waiting] == [False, False]
    assert late.cast(3) is False  # a vote after the abort cannot complete the count


def test_an_abort_after_every_vote_does_not_undo_the_commit(server: dist.TCPStore) -> None:
    a, b, c, heartbeat, other = ballots(server, 5)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(x.cast, 4) for x in (a, b)]
        assert c.cast(4) is True
        assert [w.result(timeout=30) for w in waiting] == [True, True]
    assert heartbeat.abort(4) is True  # first abort, every vote before it: commit stands
    assert other.abort(4, learn=False) is None  # a second abort cannot tell by itself ...
    assert other.abort(4) is True  # ... and learns it from the decision key


def test_waiters_learn_the_commit_when_the_last_voter_died_before_writing_it(server: dist.TCPStore) -> None:
    first, second, heartbeat = ballots(server, 3)
    raw = client(server)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(b.cast, 5) for b in (first, second)]
        while raw.add("fit0/votes/5", 0) < 2:  # both waiters voted (add 0 reads the count)
            pass
        assert raw.add("fit0/votes/5", 1) == 3  # the last vote, then that rank died: no decision written
        assert heartbeat.abort(5) is True  # its peers' heartbeat abort finds every vote in: commit
        assert [w.result(timeout=30) for w in waiting] == [True, True]


def test_a_rank_that_cannot_learn_the_outcome_says_so(server: dist.TCPStore) -> None:
    raw = client(server)
    for _ in range(3):
        raw.add("fit0/votes/6", 1)  # every vote, the last voter died before writing the outcome
    raw.add("fit0/votes/6", ABORT)  # and so did the first aborter
    late = Ballot(dist.PrefixStore("fit0", client(server, timeout_s=1.0)), 3)
    with pytest.raises(Undecided, match="step 6"):
        late.abort(6)


def test_world_sizes_the_counter_cannot_tell_from_aborts_are_refused(server: dist.TCPStore) -> None:
    with pytest.raises(ValueError, match="at most"):
        Ballot(client(server), ABORT)
