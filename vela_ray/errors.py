"""Errors of a vela-ray run: which worker failed, and a message that says how to fix it.

Every error raised inside an actor crosses a process boundary: Ray pickles it,
wraps it in a `RayTaskError` carrying the worker's traceback text, and re-raises
it on the caller as an instance of *both* `RayTaskError` and the original class.
So these classes keep their fields through pickling (`__reduce__`), and tests
can `pytest.raises(ExpertWorkerError, match="worker 2")` on the driver.
"""

from __future__ import annotations

import signal
import threading


def first_line(err: BaseException, innermost: bool = False) -> str:
    """The first line of an error's message, or its type's name when it has none: what reaches the user
    stays one line. `innermost`: of its deepest `__cause__`, for libraries that wrap the real error in a
    generic one (datasets' 'An error occurred while generating the dataset')."""
    while innermost and err.__cause__ is not None:
        err = err.__cause__
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


class VelaActorError(RuntimeError):
    """Base of all errors raised by vela-ray actors."""


class ExpertWorkerError(VelaActorError):
    """An ExpertManager failed; `worker` is its index in the placement table."""

    def __init__(self, worker: int, message: str):
        super().__init__(f"expert worker {worker}: {message}")
        self.worker = worker
        self.message = message

    def __reduce__(self):
        return (type(self), (self.worker, self.message))


class ClusterError(VelaActorError):
    """The cluster cannot host the requested actors (resources, nodes, placement groups)."""


class WorkerLostError(VelaActorError):
    """An ExpertManager process (`workers`), or one of the other data-parallel masters (`workers` empty),
    died mid-run; training stops and names the checkpoint to resume from (or recovers in place)."""

    def __init__(self, workers: list[int], message: str):
        super().__init__(message)
        self.workers = workers
        self.message = message

    def __reduce__(self):
        return (type(self), (self.workers, self.message))


class CheckpointWriteError(VelaActorError):
    """An asynchronous checkpoint (`checkpoint.asynchronous`) failed in the background; nothing of it was
    published. Raised where the run next waits for it, with the cause in one line."""

    def __init__(self, step: int, message: str):
        super().__init__(f"asynchronous checkpoint of step {step} failed: {message}")
        self.step = step
        self.message = message

    def __reduce__(self):
        return (type(self), (self.step, self.message))


class RunInterrupted(VelaActorError):
    """The run stopped between steps on request (Ctrl-C, SIGTERM, its driver gone), after a checkpoint."""

    def __init__(self, step: int | None, checkpoint: str | None, reason: str):
        where = f"stopped after step {step}" if step is not None else "stopped"
        resume = (f"continue from checkpoint {checkpoint} with `vela train --config ... --resume {checkpoint}`"
                  if checkpoint else "no checkpoint was written; set checkpoint.every to keep progress")
        super().__init__(f"{reason}: {where}; {resume}")
        self.step, self.checkpoint, self.reason = step, checkpoint, reason

    def __reduce__(self):
        return (type(self), (self.step, self.checkpoint, self.reason))


class StartupInterrupts:
    """Ctrl-C before the run can stop between steps: Python's handler raises KeyboardInterrupt wherever the main
    thread is, and there it can be lost (raised inside a finalizer or a weakref callback, Python prints it and goes
    on). `record` is the SIGINT handler `vela train` installs first: it remembers the signal, then raises as
    Python's does; `check` raises it again at the start-up's milestones if it was lost."""

    seen = threading.Event()

    @classmethod
    def record(cls, signum, frame) -> None:
        cls.seen.set()
        signal.default_int_handler(signum, frame)

    @classmethod
    def check(cls) -> None:
        if cls.seen.is_set():
            raise KeyboardInterrupt

    @classmethod
    def install(cls) -> None:
        """`record` as the SIGINT handler (from the main thread only: signals are delivered there)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, cls.record)
