"""A storage URL's password never leaves the search: not in messages, logs, hints or saved configs."""

from __future__ import annotations

import subprocess
import sys

import optuna
import password_dialect
import pytest
from optuna.trial import TrialState
from password_dialect import PASSWORD
from search_runs import HERE, MLP, cli, env, text_files

from dapple_lightning.search._redact import redact, spells_secret

pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

WRONG = "wrong-Pw9zR"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgresql://user:secret@host:5432/db", "postgresql://user:***@host:5432/db"),
        ("sqlite:///dapple_search.db", "sqlite:///dapple_search.db"),
        ("sqlite:////abs/path/search.db", "sqlite:////abs/path/search.db"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        ("postgresql://host:5432/db", "postgresql://host:5432/db"),
        ("optuna://postgresql://u:p%40ss@h/db?study=gpt", "optuna://postgresql://u:***@h/db?study=gpt"),
        # An unencoded "@" in the password: masked up to the last "@", no tail left visible.
        ("mysql+pymysql://u:p@ss@h/db", "mysql+pymysql://u:***@h/db"),
        (
            "postgresql://h/db?user=u&password=s3cret&sslmode=require",
            "postgresql://h/db?user=u&password=***&sslmode=require",
        ),
        (
            "cannot open storage 'postgresql://u:pw@h/db': refused",
            "cannot open storage 'postgresql://u:***@h/db': refused",
        ),
        ("postgresql://u:${oc.env:PW}@h/db", "postgresql://u:***@h/db"),
    ],
)
def test_redact_masks_every_password_of_a_text(text, shown):
    assert redact(text) == shown


def test_redact_masks_a_given_urls_password_wherever_it_is():
    storage = "postgresql://u:s3cr%25t@h/db"  # the password is s3cr%t, percent-encoded
    assert redact('FATAL: password "s3cr%t" rejected; s3cr%25t', storage) == 'FATAL: password "***" rejected; ***'


@pytest.mark.parametrize(
    ("url", "spelled"),
    [
        ("postgresql://u:pw@h/db", True),
        ("postgresql://h/db?password=pw", True),
        ("postgresql://u:${oc.env:PW}@h/db", False),
        ("postgresql://h/db?password=${oc.env:PW}", False),
        ("postgresql://u@h/db", False),
        ("sqlite:///x.db", False),
        ("${oc.env:DAPPLE_STORAGE}", False),
    ],
)
def test_spells_secret_tells_a_written_password_from_a_reference(url, spelled):
    assert spells_secret(url) is spelled


def test_no_output_or_file_of_a_search_shows_the_password(tmp_path):
    storage, wrong = password_dialect.url("search.db"), password_dialect.url("search.db", password=WRONG)
    temp = tmp_path / "temp"
    temp.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            cli(*args), cwd=tmp_path, env=env(TMPDIR=str(temp)), capture_output=True, text=True, timeout=300
        )

    search = ("run", "--model", MLP, "--devices", "2", "--batch-size", "8", "--micro-batches", "1,2")
    search += ("--trials", "2", "--planner-seeds", "0", "--steps", "1", "--keep-logs", "--study", "secret")
    done = run(*search, "--storage", storage)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = [
        done,
        run("trials", "--storage", storage, "--study", "secret"),
        run("best", "--storage", storage, "--study", "secret", "--export", "best.yaml"),
        run("plot", "--storage", storage, "--study", "secret", "--out", "plots"),
        run("best", "--storage", storage, "--study", "missing"),
        run("trials", "--storage", wrong, "--study", "secret"),
        run(*search, "--storage", wrong),
    ]
    assert [r.returncode for r in runs[1:3]] == [0, 0]
    # The errors name the storage, as they should, with its password masked.
    masked = "sqlite+password://dapple:***@localhost/search.db"
    assert runs[4].returncode == 2 and f"no study 'missing' in {masked}" in runs[4].stderr
    for refused in runs[5:]:
        assert refused.returncode == 2 and f"cannot open storage '{masked}'" in refused.stderr
        assert 'password authentication failed for user "dapple"' in refused.stderr
    study = optuna.load_study(study_name="secret", storage=password_dialect.url(str(tmp_path / "search.db")))
    searched = [t for t in study.trials if "confirms" not in t.user_attrs]  # not the confirmation round's
    assert [t.state for t in searched] == [TrialState.COMPLETE] * 2
    assert list(temp.glob("dapple-trial-*")), "the trials' kept logs are among the files searched"

    shown = {" ".join(r.args[3:5]): r.stdout + r.stderr for r in runs} | text_files(tmp_path)
    assert [where for where, text in shown.items() if PASSWORD in text or WRONG in text] == []


def test_no_output_or_saved_config_of_a_sweep_shows_the_password(tmp_path):
    by_reference = password_dialect.url("sweep.db", password=f"${{oc.env:{password_dialect.ENV}}}")

    def hydra(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(HERE / "sweep_app.py"), *args],
            cwd=tmp_path,
            env=env(**{password_dialect.ENV: PASSWORD}),
            capture_output=True,
            text=True,
            timeout=240,
        )

    sweep = ("-m", "hydra/sweeper=dapple", "hydra.sweeper.study_name=fake", "hydra.sweeper.n_trials=3")
    runs = [
        hydra(*sweep, f"hydra.sweeper.storage={by_reference}"),
        # A job that trains with the study's best plan, named in its config as examples/ do.
        hydra(f'plan="optuna://{by_reference}?study=fake"'),
        hydra(f'plan="optuna://{by_reference}?study=missing"'),
        # Written out, Hydra would save the password with the sweeper's config: refused.
        hydra(*sweep, f"hydra.sweeper.storage={password_dialect.url('sweep.db')}"),
    ]
    assert [r.returncode for r in runs[:2]] == [0, 0], runs[0].stderr[-3000:] + runs[1].stderr[-3000:]
    masked = "sqlite+password://dapple:***@localhost/sweep.db"
    assert runs[2].returncode == 1 and f"no study 'missing' in {masked}" in runs[2].stderr
    assert runs[3].returncode == 1 and f"hydra.sweeper.storage='{masked}' writes its password out" in runs[3].stderr
    study = optuna.load_study(study_name="fake", storage=password_dialect.url(str(tmp_path / "sweep.db")))
    assert len([t for t in study.trials if "confirms" not in t.user_attrs]) == 3
    saved = text_files(tmp_path)
    hydra_yaml = [text for path, text in saved.items() if path.name == "hydra.yaml"]
    assert hydra_yaml and all(by_reference in text for text in hydra_yaml)  # saved as written: by reference

    shown = {" ".join(r.args[2:]): r.stdout + r.stderr for r in runs} | saved
    assert [where for where, text in shown.items() if PASSWORD in text] == []
