"""SIGKILL a run at a chosen point, as a crash would: for the resume tests of regeneration and collection.

    python -m tests.data.kill_at MODULE:FUNCTION:N [specheads verb and overrides...]

runs ``specheads`` (``specheads.cli``) in this process with ``MODULE.FUNCTION`` (a dotted name inside the module:
``EngineTarget.forward_features``) wrapped so that its N-th call kills the run before it starts: every engine
process the run started (their process groups: vLLM's worker and its engine core) and then this process's own
group, all with SIGKILL, so nothing is flushed, closed or cleaned up. Start it in a session of its own
(``start_new_session=True``) so that its group is the run's alone. ``install`` does the same inside a script.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys

ENGINE_GROUPS: list[int] = []  # the pids (process-group leaders) of the engines this run started


def _die() -> None:
    for pid in ENGINE_GROUPS:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    os.killpg(os.getpgrp(), signal.SIGKILL)


def install(spec: str) -> None:
    """Wrap ``MODULE:FUNCTION:N``'s function so that its N-th call kills the run (module doc)."""
    module_name, name, n = spec.split(":")
    module = importlib.import_module(module_name)
    *owners, attr = name.split(".")
    owner = module
    for o in owners:
        owner = getattr(owner, o)
    real = getattr(owner, attr)
    calls = [0]

    @functools.wraps(real)
    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == int(n):
            _die()
        return real(*args, **kwargs)

    setattr(owner, attr, wrapped)

    from specheads.serving import engine

    start = engine.EngineProcess.__init__

    @functools.wraps(start)
    def tracked(self, *args, **kwargs):
        try:
            start(self, *args, **kwargs)
        finally:
            if getattr(self, "proc", None) is not None:
                ENGINE_GROUPS.append(self.proc.pid)  # a session leader: its group is the engine's

    engine.EngineProcess.__init__ = tracked


if __name__ == "__main__":
    install(sys.argv[1])
    from specheads.cli import main

    main(sys.argv[2:])
