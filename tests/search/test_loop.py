"""Opening a study: what identifies it is recorded whole, or recorded again, never in part."""

from __future__ import annotations

import optuna
import pytest

from dapple_lightning.search import Fingerprint, PlanSpace, create_sampler
from dapple_lightning.search._loop import existing_study, open_study

FINGERPRINT = Fingerprint(6, "", 2, "cpu", 8)
IDENTITY = {"fingerprint", "space", "objectives", "model"}


class Died(BaseException):
    """The search process dying (an exception nothing in the search catches)."""


def open_search(storage: str, schedules: tuple[str, ...] = ("dapple", "gpipe")) -> optuna.Study:
    return open_study(
        storage,
        "s",
        fingerprint=FINGERPRINT,
        space=PlanSpace(6, 2, 8, schedules=schedules),
        directions=["maximize"],
        objectives=["samples_per_s"],
        sampler=lambda offset: create_sampler("random", offset),
        attrs={"model": {"factory": "m:f", "kwargs": {}}},
        existing=existing_study(storage, "s"),
        say=lambda line: None,
    )


@pytest.mark.parametrize("writes", [0, 1, 2, 3])
def test_a_search_that_dies_while_recording_its_study_leaves_none_half_checked(tmp_path, monkeypatch, writes):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    real = optuna.Study.set_user_attr
    done: list[str] = []

    def dying(self: optuna.Study, key: str, value: object) -> None:
        if len(done) == writes:
            raise Died
        done.append(key)
        real(self, key, value)

    monkeypatch.setattr(optuna.Study, "set_user_attr", dying)
    with pytest.raises(Died):
        open_search(storage)
    monkeypatch.undo()
    # The mark of a whole record (the fingerprint) is missing, so the next open records it again.
    assert "fingerprint" not in optuna.load_study(study_name="s", storage=storage).user_attrs
    assert set(open_search(storage).user_attrs) >= IDENTITY
    # ... and then the checks on resuming apply: another search space is refused.
    with pytest.raises(ValueError, match="searched other choices"):
        open_search(storage, schedules=("dapple",))
