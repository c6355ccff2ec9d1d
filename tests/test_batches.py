"""Batches as users hand them: how dapple_lightning.microbatch reads, cuts and joins them.

Each case is a batch, the rows dapple reads in it, and what the slice of rows [1, 3) holds.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dapple_lightning.microbatch import Rows, batch_size_of, concat_slices, even_split, slice_batch

from harness import assert_close_tree

X = torch.arange(24.0).reshape(6, 4)
Y = torch.arange(6)
PART = Rows(1, 3)
Pair = namedtuple("Pair", ["x", "y"])


class Features(UserDict):
    """A UserDict subclass with an attribute of its own."""

    def __init__(self, data=None, *, source: str = "?") -> None:
        super().__init__(data)
        self.source = source


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    name: list[str]
    scale: float = 1.0


def _per_sample(shapes):
    return [torch.full(shape, float(i)) for i, shape in enumerate(shapes)]


SEQS = _per_sample([(3,), (5,), (2,), (4,), (1,), (6,)])  # one tensor per row, of different lengths
SAME = _per_sample([(4,)] * 6)  # one tensor per row, all of shape (4,)
SHORT = _per_sample([(3,)] * 6)
NAMES = [f"s{i}" for i in range(6)]

CUT = [
    # (id, batch, rows, the slice of rows [1, 3))
    ("tensor", X, 6, X[1:3]),
    ("default_collate list of fields", [X, Y], 6, [X[1:3], Y[1:3]]),
    ("tuple of fields", (X, Y), 6, (X[1:3], Y[1:3])),
    ("namedtuple", Pair(X, Y), 6, Pair(X[1:3], Y[1:3])),
    ("dict", {"x": X, "y": Y}, 6, {"x": X[1:3], "y": Y[1:3]}),
    ("OrderedDict", OrderedDict(x=X, y=Y), 6, OrderedDict(x=X[1:3], y=Y[1:3])),
    ("nested", {"in": (X, {"y": Y})}, 6, {"in": (X[1:3], {"y": Y[1:3]})}),
    ("strings as default_collate gives them", {"x": X, "id": NAMES}, 6, {"x": X[1:3], "id": NAMES[1:3]}),
    ("numbers in a list", [X, [0.5, 1, 2, 3, 4, 5]], 6, [X[1:3], [1, 2]]),
    ("only strings", {"text": NAMES}, 6, {"text": NAMES[1:3]}),
    ("per-sample tensors of different lengths", {"seq": SEQS, "y": Y}, 6, {"seq": SEQS[1:3], "y": Y[1:3]}),
    ("per-sample tensors alone", SEQS, 6, SEQS[1:3]),
    ("per-sample tensors of one shape beside a tensor", (SAME, Y), 6, (SAME[1:3], Y[1:3])),
    (
        "two lists of per-sample tensors, each of one shape",  # as fields they would disagree: 4 and 3 rows
        {"a": SAME, "b": SHORT},
        6,
        {"a": SAME[1:3], "b": SHORT[1:3]},
    ),
    (
        "per-sample dicts (detection targets)",
        (X, [{"boxes": torch.zeros(i, 4), "label": i} for i in range(6)]),
        6,
        (X[1:3], [{"boxes": torch.zeros(i, 4), "label": i} for i in (1, 2)]),
    ),
    (
        "per-batch values outside lists",
        {"x": X, "lang": "en", "t": torch.tensor(0.5)},
        6,
        {"x": X[1:3], "lang": "en", "t": torch.tensor(0.5)},
    ),
    ("per-batch strings in a tuple", (X, ("en", "de")), 6, (X[1:3], ("en", "de"))),
    ("dataclass", Sample(X, NAMES, 2.0), 6, Sample(X[1:3], NAMES[1:3], 2.0)),
    ("numpy", {"x": X.numpy(), "y": Y}, 6, {"x": X.numpy()[1:3], "y": Y[1:3]}),
]


def _same(got, want) -> None:
    assert type(got) is type(want)
    if isinstance(want, np.ndarray):
        np.testing.assert_array_equal(got, want)
    elif dataclasses.is_dataclass(want):
        _same(dataclasses.asdict(got), dataclasses.asdict(want))
    elif isinstance(want, Mapping):
        assert list(got) == list(want)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    else:
        assert_close_tree(got, want)


@pytest.mark.parametrize(("batch", "rows", "part"), [c[1:] for c in CUT], ids=[c[0] for c in CUT])
def test_rows_and_slices(batch, rows, part):
    assert batch_size_of(batch) == rows
    _same(slice_batch(batch, PART), part)


def test_defaultdict_keeps_its_factory():
    batch = defaultdict(list, {"x": X, "id": NAMES})
    part = slice_batch(batch, PART)
    assert type(part) is defaultdict and part.default_factory is list
    _same(dict(part), {"x": X[1:3], "id": NAMES[1:3]})
    assert part["missing"] == []


def test_user_dict_keeps_its_type_and_attributes():
    part = slice_batch(Features({"x": X, "y": Y}, source="disk"), PART)
    assert type(part) is Features and part.source == "disk"
    _same(part.data, {"x": X[1:3], "y": Y[1:3]})


def test_hugging_face_batch_encoding_is_cut_with_its_encodings():
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[PAD]": 1, "a": 2, "b": 3, "c": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]")
    texts = ["a", "a b", "b c a", "c", "a a a a", "b"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")  # made in memory, nothing downloaded
    assert isinstance(batch, transformers.BatchEncoding) and batch_size_of(batch) == 6

    part = slice_batch(batch, PART)
    assert type(part) is transformers.BatchEncoding
    want = tokenizer(texts, padding=True, return_tensors="pt")
    torch.testing.assert_close(part.input_ids, want.input_ids[1:3])  # attribute access still works
    torch.testing.assert_close(part["attention_mask"], want["attention_mask"][1:3])
    assert [e.tokens for e in part.encodings] == [e.tokens for e in want.encodings[1:3]]
    assert part.word_ids(1) == want.word_ids(2)

    plain = transformers.BatchEncoding({"input_ids": X.long(), "labels": Y})  # as a data collator makes one
    _same(slice_batch(plain, PART), transformers.BatchEncoding({"input_ids": X.long()[1:3], "labels": Y[1:3]}))


def test_a_list_of_tensors_sharing_dim_0_is_read_as_fields_when_nothing_else_counts_the_rows():
    # Four per-sample tensors of shape (6,) look exactly like default_collate's four fields of
    # six rows; dapple reads fields, and the strategy refuses the step when the pipelined
    # Sequential then gets other rows than the slice's (tests/test_predict_log.py).
    same = _per_sample([(6,)] * 4)
    assert batch_size_of(same) == 6
    assert [t.shape for t in slice_batch(same, PART)] == [torch.Size([2])] * 4


REFUSED = [
    ("a tensor with another dim 0", {"x": X, "class_weights": torch.ones(3)}, r"batch\['class_weights'\]: 3"),
    ("a per-sample list of the wrong length", {"x": X, "id": NAMES[:4]}, r"batch\['id'\]: 4 \(the length of a list"),
    ("a tuple of per-sample tensors", (X, tuple(SEQS)), r"batch\[1\]\[1\]: 5"),
    ("per-sample tensors of one shape beside another count", (SAME[:4], Y), r"batch\[0\]: 4 as fields or 4 as samples"),
    (
        "two lists that read either way",
        {"a": _per_sample([(4,)] * 6), "b": _per_sample([(6,)] * 4)},
        r"batch\['a'\]: 4 as fields or 6 as samples",
    ),
    ("nothing with rows", {"text": "one string", "n": 3}, "holds no tensor with a batch dimension"),
    ("0-dim tensors only", (torch.tensor(1.0),), "holds no tensor with a batch dimension"),
]


@pytest.mark.parametrize(("batch", "match"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_batches_dapple_cannot_read_are_refused_with_where_and_why(batch, match):
    with pytest.raises(ValueError, match=match):
        batch_size_of(batch)
    with pytest.raises(ValueError, match=match):
        slice_batch(batch, PART)


class Record(Mapping):
    """A read-only Mapping whose constructor does not take a dict."""

    def __init__(self, name: str, items: dict) -> None:
        self.name, self._items = name, items

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def test_a_mapping_that_rebuilds_from_a_dict_keeps_its_type():
    part = slice_batch(MappingProxyType({"x": X}), PART)
    assert type(part) is MappingProxyType
    _same(dict(part), {"x": X[1:3]})


def test_a_mapping_that_cannot_be_rebuilt_is_refused():
    with pytest.raises(TypeError, match="cannot rebuild a Record from a dict"):
        slice_batch(Record("r", {"x": X}), PART)


JOINED = [
    # (id, outputs of slices of 3 and 2 rows, the joined output)
    ("tensors", [X[:3], X[3:5]], X[:5]),
    ("per-sample lists", [[1, 2, 3], [4, 5]], [1, 2, 3, 4, 5]),
    ("lists of fields", [[X[:3], Y[:3]], [X[3:5], Y[3:5]]], [X[:5], Y[:5]]),
    ("dict per key", [{"p": X[:3], "id": NAMES[:3]}, {"p": X[3:5], "id": NAMES[3:5]}], {"p": X[:5], "id": NAMES[:5]}),
    ("tuple per position", [(Y[:3], ["a"] * 3), (Y[3:5], ["b"] * 2)], (Y[:5], ["a", "a", "a", "b", "b"])),
    ("namedtuple", [Pair(X[:3], Y[:3]), Pair(X[3:5], Y[3:5])], Pair(X[:5], Y[:5])),
    ("per-sample tensors", [SEQS[:3], SEQS[3:5]], SEQS[:5]),
    ("a value every slice gives alike", [{"p": Y[:3], "step": 7}, {"p": Y[3:5], "step": 7}], {"p": Y[:5], "step": 7}),
]


@pytest.mark.parametrize(("pieces", "want"), [c[1:] for c in JOINED], ids=[c[0] for c in JOINED])
def test_outputs_of_slices_join_in_row_order(pieces, want):
    _same(concat_slices(pieces, [3, 2]), want)


NOT_JOINED = [
    ("a mean over the slice", [X[:3].mean(), X[3:5].mean()], "one row per row of the slice"),
    ("a tensor of another dim 0", [X[:2], X[:2]], r"shapes \[\(2, 4\), \(2, 4\)\] for slices of \[3, 2\] rows"),
    ("a value that differs", [{"n": 3}, {"n": 2}], r"output\['n'\] differs between slices"),
    ("a list of neither fields nor samples", [[1, 2], [3, 4]], "is a list of"),
    ("keys that differ", [{"a": Y[:3]}, {"b": Y[3:5]}], "has keys"),
]


@pytest.mark.parametrize(("pieces", "match"), [c[1:] for c in NOT_JOINED], ids=[c[0] for c in NOT_JOINED])
def test_outputs_that_are_not_per_row_are_refused(pieces, match):
    with pytest.raises(ValueError, match=match):
        concat_slices(pieces, [3, 2])


def _batch(rows: int, kind: int):
    x = torch.arange(rows * 3.0).reshape(rows, 3)
    names = [f"r{i}" for i in range(rows)]
    seqs = [torch.arange(float(i % 4 + 1)) for i in range(rows)]
    return [
        [x, x.sum(1)],
        {"x": x, "id": names, "seq": seqs},
        defaultdict(int, {"pair": Pair(x, names), "lang": "en"}),
        (seqs, x[:, 0].long()),
    ][kind]


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(2, 30), parts=st.integers(1, 8), kind=st.integers(0, 3))
def test_cutting_then_joining_gives_the_batch_back(rows, parts, kind):
    batch = _batch(rows, kind)
    split = even_split(rows, min(parts, rows))
    pieces = [slice_batch(batch, r) for r in split]
    assert [batch_size_of(p) for p in pieces] == [len(r) for r in split]
    _same(concat_slices(pieces, [len(r) for r in split]), batch)


@dataclasses.dataclass
class Normalised:
    """A batch whose ``__post_init__`` scales what it is given and derives a field of its own."""

    img: torch.Tensor
    total: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.img = self.img / 255
        self.total = self.img.sum(dim=1)


def test_a_dataclass_batch_is_cut_and_joined_without_being_built_again():
    batch = Normalised(torch.arange(24.0).reshape(6, 4) * 255)
    piece = slice_batch(batch, Rows(1, 3))
    assert type(piece) is Normalised
    torch.testing.assert_close(piece.img, batch.img[1:3])  # scaled once, when the loader built it
    torch.testing.assert_close(piece.total, batch.total[1:3])  # the derived field is cut too
    joined = concat_slices([slice_batch(batch, Rows(0, 3)), slice_batch(batch, Rows(3, 6))], [3, 3])
    torch.testing.assert_close(joined.img, batch.img)
    torch.testing.assert_close(joined.total, batch.total)
