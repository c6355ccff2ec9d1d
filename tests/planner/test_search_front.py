"""A front of partial plans keeps those that fewer than ``top`` others beat in all numbers."""

from __future__ import annotations

from dapple_lightning.planner._search import _insert, _Suffix, _Top


def suffix(z: float, d: float, start: int = 1) -> _Suffix:
    return _Suffix(1, d, z, 0.0, 0.0, 0.0, start, 2, 1, False, None)


def test_a_suffix_leaves_once_top_others_beat_it() -> None:
    slow = suffix(3.0, 3.0)
    front = [slow]
    assert _insert(front, suffix(2.0, 2.0, 2), 2, None)
    assert slow in front and slow.beaten == 1  # one plan better than it: it may still be second
    assert _insert(front, suffix(1.0, 1.0, 3), 2, None)
    assert slow not in front and [s.z for s in front] == [1.0, 2.0]


def test_a_suffix_that_top_others_beat_is_not_kept() -> None:
    front = [suffix(1.0, 1.0), suffix(2.0, 2.0)]
    assert not _insert(front, suffix(3.0, 3.0), 2, None)
    # Beaten by one only, or better in D than both: it stays.
    assert _insert(front, suffix(1.5, 1.5), 2, None)
    assert _insert(front, suffix(4.0, 0.5), 2, None)
    assert [s.z for s in front] == [1.0, 1.5, 2.0, 4.0]


def test_a_suffix_goes_after_those_of_equal_z_that_stay() -> None:
    # Three of Z 1.0 and one of Z 2.0. A new one of Z 1.0 and D 1.0 beats the first and third
    # (D 2.0 and 3.0), which leave (top 1), not the second (D 0.5, but more passes), which does
    # not beat it either: it goes after the second, before the Z of 2.0.
    def fronts() -> tuple[list[_Suffix], _Suffix, _Suffix]:
        second, later = suffix(1.0, 0.5, 2), suffix(2.0, 0.1, 4)
        second.passes = 2.0
        return [suffix(1.0, 2.0, 1), second, suffix(1.0, 3.0, 3), later], second, later

    front, second, later = fronts()
    new = suffix(1.0, 1.0, 5)
    assert _insert(front, new, 1, None)
    assert front == [second, new, later]
    # Under a beam of 2 it stays too, the Z of 2.0 leaves.
    front, second, _ = fronts()
    new = suffix(1.0, 1.0, 5)
    assert _insert(front, new, 1, 2)
    assert front == [second, new]


def test_a_bound_from_elsewhere_holds_until_the_top_plans_beat_it() -> None:
    top = _Top(2)
    top.limit(5.0)
    top.offer(4.0, ("a",), None)
    top.offer(6.0, ("b",), None)  # above the bound: not kept
    assert top.bound == 5.0 and [z for z, _, _ in top.items] == [4.0]
    top.offer(4.5, ("c",), None)
    assert top.bound == 4.5 * (1 + 1e-12)
