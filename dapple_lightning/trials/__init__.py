"""Trials: one candidate plan measured in fresh processes, apart from whatever chose it.

A trial trains one plan for a few steps and reports its throughput, or why it failed. It never
runs in the caller's process: a crash, hang or out-of-memory ends the trial, not the caller.
This room knows processes, not Optuna; the plan search (``dapple_lightning.search``) drives it::

    from dapple_lightning.trials import TrialConfig, run_trial

    result = run_trial("plan.yaml", TrialConfig("my_models:gpt", world_size=4, global_batch=64))
    print(result.status, result.samples_per_s)

Pieces, one module each:

- one measurement: :class:`TrialConfig`, :func:`run_trial`, :class:`TrialResult` (``_trial``),
  run by a rank (``_worker``) under PyTorch's elastic agent (``_leader``);
- starting the processes: ``exec`` a fresh interpreter or ``fork`` the template that imported
  torch once (``_launch``, ``_zygote``), each trial in its own session and process group
  (:func:`group_alive`), every child watching its parent (``_child``);
- devices: GPUs leased to one trial at a time across the host's searches (``_devices``);
- the user's model factory, ``module:function`` (``_factory``);
- the probe: the model built once in a child, its layers, :class:`Fingerprint` and profile
  (:func:`probe_model`, ``_probe``; ``_fingerprint``);
- liveness: who runs a trial and whether that process is gone (:func:`runner_info`,
  :func:`runner_dead`, ``_runner``).

Two mechanisms import torch once and then fork, for different needs. The strategy's fork server
(``FORKSERVER_PRELOAD`` in ``strategy/_lightning.py``) is Python's ``multiprocessing`` fork server
under Lightning's launcher: it forks the ranks of one ``fit`` that the user's process started and
hands them the model and trainer through ``multiprocessing``'s pickles, its children tied to that
launch. The trial template (``_zygote``) forks, for each trial, a leader that calls ``setsid`` so
that the whole trial is one process group to kill, gets a FIFO as stdout for step events and
answers its pid at once, none of which ``multiprocessing``'s fork server offers.
"""

from __future__ import annotations

from dapple_lightning.trials._factory import check_factory_spec, load_factory
from dapple_lightning.trials._fingerprint import Fingerprint, FingerprintMismatch, check_fingerprint
from dapple_lightning.trials._launch import group_alive
from dapple_lightning.trials._probe import ModelInfo, probe_model
from dapple_lightning.trials._runner import runner_dead, runner_info
from dapple_lightning.trials._trial import FailKind, TrialConfig, TrialResult, classify_failure, run_trial

__all__ = [
    "FailKind",
    "Fingerprint",
    "FingerprintMismatch",
    "ModelInfo",
    "TrialConfig",
    "TrialResult",
    "check_factory_spec",
    "check_fingerprint",
    "classify_failure",
    "group_alive",
    "load_factory",
    "probe_model",
    "run_trial",
    "runner_dead",
    "runner_info",
]
