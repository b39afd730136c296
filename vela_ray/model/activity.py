"""When the master is idle: the seconds in which every micro-batch it runs waits on the experts.

With one micro-batch at a time this is the master's whole wait on the data plane; with several in flight
(`training.overlap`) a wait is idle only while no other micro-batch computes, so the sum of the round trips (which
overlap each other and the master's compute) would overstate it. The dispatcher times its transport calls in
`waiting()`, the step runs each micro-batch in `running()` (`training.step.forward_backward`):

    activity = MasterActivity()
    with activity.running():          # a micro-batch's forward and backward, on its thread
        with activity.waiting():      # inside a broker's transport call
            ...
    activity.idle_s                   # seconds so far in which every running micro-batch waited

Outside a step (eval, the placement's profile) nothing runs a micro-batch: a wait counts as idle.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator


class MasterActivity:
    """Counts the master's micro-batches running and waiting (from any thread) and the idle seconds."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._waiting = 0
        self._idle_since: float | None = None
        self._idle_s = 0.0

    @property
    def idle_s(self) -> float:
        """Seconds so far in which every running micro-batch waited on the experts (an idle spell still going
        counts up to now)."""
        with self._lock:
            ongoing = 0.0 if self._idle_since is None else time.perf_counter() - self._idle_since
            return self._idle_s + ongoing

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """One micro-batch's forward and backward."""
        self._change(running=1)
        try:
            yield
        finally:
            self._change(running=-1)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """One transport call: this micro-batch waits on the experts."""
        self._change(waiting=1)
        try:
            yield
        finally:
            self._change(waiting=-1)

    def _change(self, running: int = 0, waiting: int = 0) -> None:
        with self._lock:
            now = time.perf_counter()
            self._running += running
            self._waiting += waiting
            idle = self._waiting > 0 and self._waiting >= max(self._running, 1)
            if idle and self._idle_since is None:
                self._idle_since = now
            elif not idle and self._idle_since is not None:
                self._idle_s += now - self._idle_since
                self._idle_since = None
