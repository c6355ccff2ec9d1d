"""Files the search hands to others are replaced whole."""

from __future__ import annotations

import pytest

from dapple_lightning.search._files import write_atomic


def test_write_atomic_replaces_the_file_and_keeps_its_permissions(tmp_path):
    path = tmp_path / "best.yaml"
    path.write_text("old\n")
    path.chmod(0o640)
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n"
    assert path.stat().st_mode & 0o777 == 0o640
    assert list(tmp_path.iterdir()) == [path]


def test_a_write_that_fails_half_way_leaves_the_old_file_and_no_temporary_one(tmp_path):
    path = tmp_path / "best.yaml"
    path.write_text("old\n")
    with pytest.raises(UnicodeEncodeError):
        write_atomic(path, "new\n" * 10_000 + "\udcff")  # a lone surrogate: the text cannot be written
    assert path.read_text() == "old\n"
    assert list(tmp_path.iterdir()) == [path]
