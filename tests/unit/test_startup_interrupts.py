"""A Ctrl-C during `vela train`'s start-up is never lost (`errors.StartupInterrupts`): Python raises it wherever the
main thread is, and inside a finalizer it only prints it and goes on; the start-up's milestones raise it again.
(The whole path, `vela train` interrupted as it starts: tests/ray/test_driver_signals.py.)"""

from __future__ import annotations

import gc
import threading

import pytest

from vela_ray.errors import StartupInterrupts


def test_a_ctrl_c_lost_in_a_finalizer_is_raised_at_the_next_milestone(monkeypatch):
    monkeypatch.setattr(StartupInterrupts, "seen", threading.Event())
    StartupInterrupts.check()  # nothing seen: nothing raised

    class Finalized:
        def __del__(self):
            StartupInterrupts.record(2, None)  # SIGINT's handler, run while a finalizer runs

    unraisable = []
    monkeypatch.setattr("sys.unraisablehook", unraisable.append)
    Finalized()
    gc.collect()
    assert [type(u.exc_value) for u in unraisable] == [KeyboardInterrupt]  # Python swallowed it ...
    with pytest.raises(KeyboardInterrupt):
        StartupInterrupts.check()  # ... the milestone does not
