"""The point-to-point protocol: receives posted ahead on remembered signatures, on real processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dapple_lightning import runtime as comm
from dapple_lightning.runtime._comm import NEW_SIGNATURE

from distributed import run_ranks


def messages() -> list[tuple[list[torch.Tensor], bool]]:
    """A sequence that walks every branch of the protocol, in order."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 3, 5, generator=g)
    return [
        ([a], False),  # first message with 4 rows: nothing remembered, header then payload
        ([a + 1], False),  # same signature: payload into the buffers posted ahead
        ([torch.randn(4, 7, 5, generator=g)], False),  # same rows, new sequence length: placeholders first
        ([torch.randn(4, 7, 5, generator=g)], False),  # the new signature is now the remembered one
        ([torch.randn(2, 7, 5, generator=g)], False),  # a short last batch: remembered apart
        ([torch.randn(4, 7, 5, generator=g), torch.arange(4)], True),  # a tuple with an int64 member
        ([torch.randn(4, 7, 5, generator=g).half()], False),  # dtype change, back to a single tensor
        ([torch.randn(4, 7, 5, generator=g).half()], False),
        ([], False),  # no floating inputs: an empty message
        ([torch.randn(4, 7, 5, generator=g)], True),  # a one-tensor tuple
        ([torch.randn(2, 7, 5, generator=g)], False),  # the short batch again, as remembered
        # dtypes NCCL cannot send: with headers apart (as on NCCL) they travel as their bytes
        ([torch.randint(-500, 500, (4, 3), generator=g, dtype=torch.int16)], False),
        ([torch.randint(-500, 500, (4, 3), generator=g, dtype=torch.int16)], False),
        ([torch.randn(4, 2, generator=g, dtype=torch.complex64), torch.arange(4)], True),
    ]


def exchange(rank: int, world_size: int, headers_apart: bool) -> list[tuple[list[torch.Tensor], bool, bool]]:
    # Apart: the headers on a group of their own, in host memory, as with an NCCL payload group.
    link = comm.Link(torch.device("cpu"), dist.new_group(), dist.new_group() if headers_apart else None)
    sequence = messages()
    rows = [len(t[0]) if t else 4 for t, _ in sequence]
    if rank == 0:
        pending = comm.Pending()
        for (tensors, as_tuple), n in zip(sequence, rows):
            link.send(tensors, 1, n, pending, as_tuple=as_tuple)
        pending.wait()
        return []
    received = []
    incoming = link.post(0, rows[0])
    for i in range(len(sequence)):
        predicted = incoming.expected is not None
        tensors, as_tuple = incoming.wait()
        if i + 1 < len(sequence):
            incoming = link.post(0, rows[i + 1])  # the next is posted as soon as this one is in
        received.append((tensors, as_tuple, predicted))
    return received


@pytest.mark.parametrize("headers_apart", [False, True], ids=["headers-with-payload", "headers-apart"])
def test_every_message_arrives_intact_with_receives_posted_ahead(headers_apart: bool) -> None:
    _, received = run_ranks(exchange, 2, headers_apart)
    sequence = messages()
    assert len(received) == len(sequence)
    for i, ((sent, sent_tuple), (got, got_tuple, _)) in enumerate(zip(sequence, received)):
        assert got_tuple == sent_tuple, i
        assert len(got) == len(sent), i
        for s, r in zip(sent, got):
            assert r.dtype == s.dtype and r.shape == s.shape, i
            assert torch.equal(r, s), i
    # Receives were posted on a remembered signature exactly when one was remembered.
    predicted = [p for _, _, p in received]
    assert predicted == [False, True, True, True, False, True, True, True, True, True, True, True, True, True]


def test_links_that_move_device_memory_only_send_int16_and_complex_as_bytes() -> None:
    nccl_like = comm.Link(torch.device("cpu"), None, header_group=object())  # type: ignore[arg-type]
    for t in (torch.arange(6, dtype=torch.int16).view(2, 3), torch.ones(3, dtype=torch.complex64), torch.tensor(1.0)):
        wired = nccl_like.wire(t)
        assert wired.data_ptr() == t.data_ptr() and wired.numel() * wired.element_size() == t.nbytes
        assert wired.dtype == (torch.uint8 if t.dtype in (torch.int16, torch.complex64) else t.dtype)
    assert comm.Link(torch.device("cpu")).wire(t16 := torch.zeros(2, dtype=torch.int16)) is t16


def test_signature_header_round_trips() -> None:
    tensors = [torch.zeros(3, 2, 1, 4), torch.zeros(3, dtype=torch.bool)]
    sig = comm.Signature.of(tensors, as_tuple=True)
    status, back = comm.Signature.decode(sig.encode(NEW_SIGNATURE).tolist())
    assert status == NEW_SIGNATURE
    assert back == sig
    assert [t.shape for t in back.empty(torch.device("cpu"))] == [t.shape for t in tensors]
