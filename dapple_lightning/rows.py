"""Row arithmetic: how a global batch is cut into micro-batches and replica slices.

Micro-batch ``m`` of a global batch of ``B`` rows is the ``m``-th of ``M`` near-equal
contiguous chunks (sizes differ by at most one, larger first, as ``torch.tensor_split``).
Stage ``s`` cuts each micro-batch again into ``r_s`` near-equal slices, one per replica.
Between two stages with different replica counts a slice of the sender overlaps one or more
slices of the receiver: :func:`transfers` lists those overlaps (split-concat).

Pure integer arithmetic (no torch): the schedule's lowering, the runtime and the tests share it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Rows", "Transfer", "even_split", "transfers"]


@dataclass(frozen=True)
class Rows:
    """The half-open row range ``[start, stop)``."""

    start: int
    stop: int

    def __len__(self) -> int:
        return self.stop - self.start

    def shift(self, offset: int) -> Rows:
        return Rows(self.start + offset, self.stop + offset)


def even_split(total: int, parts: int, what: str = "rows") -> list[Rows]:
    """Cut ``total`` rows into ``parts`` contiguous, non-empty, near-equal ranges."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    if total < parts:
        raise ValueError(f"cannot split {total} {what} into {parts} non-empty parts")
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        out.append(Rows(start, stop))
        start = stop
    return out


@dataclass(frozen=True)
class Transfer:
    """Rows that sender replica ``src`` hands to receiver replica ``dst`` for one micro-batch.

    ``src_rows`` index the sender's slice, ``dst_rows`` the receiver's slice; both have the
    same length.
    """

    src: int
    dst: int
    src_rows: Rows
    dst_rows: Rows


def transfers(micro_batch_rows: int, src_replicas: int, dst_replicas: int) -> list[Transfer]:
    """Overlaps between a micro-batch split ``src_replicas`` ways and ``dst_replicas`` ways.

    Sorted by ``(dst, src)``, so a receiver concatenating its pieces in list order gets its
    rows in order.
    """
    src = even_split(micro_batch_rows, src_replicas, "micro-batch rows")
    dst = even_split(micro_batch_rows, dst_replicas, "micro-batch rows")
    out = []
    for k, d in enumerate(dst):
        for j, s in enumerate(src):
            lo, hi = max(s.start, d.start), min(s.stop, d.stop)
            if lo < hi:
                out.append(Transfer(j, k, Rows(lo - s.start, hi - s.start), Rows(lo - d.start, hi - d.start)))
    return out
