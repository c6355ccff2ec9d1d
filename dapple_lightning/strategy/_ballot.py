"""The per-step vote of recovery: every rank updates its optimizer or none does.

One counter per step in the launcher's store orders everything: a rank that reached its update
adds 1 (:meth:`Ballot.cast`), a rank that learns of a lost peer adds :data:`ABORT`
(:meth:`Ballot.abort`). The step *commits* exactly when the counter reaches the world size before
any abort was added. Whoever's ``add`` reveals the outcome knows it from the value it got back:

- the rank whose vote brings the count to the world size: commit;
- a rank whose vote comes after an abort (the value is above :data:`ABORT`): abort;
- the first abort (one ``ABORT`` in the value): commit if every vote came before it, else abort;
- a later abort while votes are still missing: abort.

A rank that knows the outcome ``set``\\ s it under the step's decision key (all who know agree, so
the writes cannot conflict) and goes on without waiting; the others block in one ``get`` of that
key, which the store answers once it is set. Failure-free, the last rank to arrive makes one round
trip (its ``add``; a ``set`` needs no answer) and the others two, with no poll.

If every rank that knew the outcome died before writing it (a second failure during the first), a
rank waiting for it times out and cannot tell: :class:`Undecided`; it then keeps no state for
recovery, since it cannot know whether its peers updated.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ABORT", "COMMIT", "Ballot", "Undecided"]

COMMIT, _ABORTED = b"commit", b"abort"
ABORT = 1 << 20
"""What an abort adds to a step's counter: more than any world size, so the value tells aborts and votes apart."""


class Undecided(RuntimeError):
    """The outcome of a step's vote could not be learned (see the module docstring)."""


class Ballot:
    """Votes of ``world`` ranks through ``store`` (a client of the launcher's store, under this fit's prefix)."""

    def __init__(self, store: Any, world: int) -> None:
        if world >= ABORT:
            raise ValueError(f"the vote counts at most {ABORT - 1} ranks, got {world}")
        self.store, self.world = store, world

    def cast(self, step: int) -> bool:
        """This rank reached the update of ``step``: whether every rank updates (``True``) or none."""
        count = self.store.add(f"votes/{step}", 1)
        if count == self.world:
            return self._publish(step, True)
        if count > ABORT:
            return self._publish(step, False)
        return self._await(step)

    def abort(self, step: int, *, learn: bool = True) -> bool | None:
        """A peer is lost during ``step``: stop it unless every rank already voted. Returns the outcome;
        where this abort cannot tell it, waits for it, or with ``learn=False`` returns ``None`` (an abort
        made only to wake the ranks waiting for the outcome)."""
        aborts, votes = divmod(self.store.add(f"votes/{step}", ABORT), ABORT)
        if aborts == 1 or votes < self.world:
            return self._publish(step, aborts == 1 and votes == self.world)
        return self._await(step) if learn else None

    def forget(self, step: int) -> None:
        """``step``'s keys are no longer needed (every rank has voted on a later step)."""
        for key in (f"votes/{step}", f"decision/{step}"):
            self.store.delete_key(key)

    def _publish(self, step: int, commit: bool) -> bool:
        self.store.set(f"decision/{step}", COMMIT if commit else _ABORTED)
        return commit

    def _await(self, step: int) -> bool:
        """The outcome once someone who knows it wrote it: a store's ``get`` waits for its key (up to
        the client's timeout, which :func:`launcher_client` set to the process group's)."""
        try:
            return self.store.get(f"decision/{step}") == COMMIT
        except RuntimeError as error:  # the timeout (DistStoreError), or the store is gone
            raise Undecided(f"no outcome of the vote on step {step} came: {error}") from error
