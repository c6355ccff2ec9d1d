"""The trial template: a process that imports torch, Lightning and dapple_lightning once, then forks trials.

Starting a rank costs seconds of CPU in imports (torch and Lightning), more than a trial of a
small model takes to train (docs/benchmarks.md, "Search: trial launchers"). The template pays the
imports once per search; each trial's leader is forked from it, calls ``setsid`` (its own session
and process group, as with the ``exec`` launcher), and PyTorch's elastic agent in it forks the
ranks (``_leader``).

A trial started this way is still a fresh set of processes: the template has only imported
modules. It never builds a model, runs an operation, starts a thread or touches a device, so
nothing of one trial reaches another, and forking is safe (no OpenMP pool or CUDA context is
inherited). The user's factory module is imported in each trial's ranks, after the fork.

Protocol, one line each way per child: the search writes ``["KIND", "SPEC_PATH", "EVENTS_PATH"]``
(a JSON list: paths may hold spaces; ``KIND``: ``trial`` or ``probe``), the template answers the
leader's pid once the leader leads its own session. ``EVENTS_PATH`` is a FIFO the search reads; the leader's stdout (and so rank 0's) writes
to it. The leader writes its exit code to ``leader_exit`` next to the spec. When the search closes
the template's stdin (or dies), the template exits; orphaned leaders kill their own groups.
"""

from __future__ import annotations

import json
import os
import signal
import sys

__all__ = ["main"]


def _leader(kind: str, spec_path: str, events_path: str, ready_w: int) -> int:
    """In the forked child: become a session leader, wire up stdio, tell the template, supervise."""
    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the leader reaps its own ranks
    out_dir = os.path.dirname(spec_path)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # never read the template's command pipe
    os.dup2(os.open(events_path, os.O_WRONLY), 1)
    os.dup2(os.open(os.path.join(out_dir, "supervisor.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)
    os.write(ready_w, b"1")
    os.close(ready_w)
    if kind == "probe":
        from dapple_lightning.trials._probe import main as probe

        return probe(spec_path)
    from dapple_lightning.trials._leader import lead

    return lead(spec_path, fork=True)


def main() -> int:
    # The expensive part, once per search.
    import lightning.pytorch  # noqa: F401
    import torch
    import torch.distributed.launcher.api  # noqa: F401

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # leaders are reaped by the kernel
    control = sys.stdout
    control.write("ready\n")
    control.flush()
    for line in sys.stdin:  # EOF: the search is done with us (or dead)
        kind, spec_path, events_path = json.loads(line)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            code = 1
            try:
                code = _leader(kind, spec_path, events_path, ready_w)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    with open(os.path.join(os.path.dirname(spec_path), "leader_exit"), "w") as f:
                        f.write(str(code))
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        os.close(ready_w)
        os.read(ready_r, 1)  # the leader leads its group now: the search may signal it
        os.close(ready_r)
        control.write(f"{pid}\n")
        control.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
