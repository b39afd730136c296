"""Progress of long local work (the tiny model's pre-training, a profiling pass): steps, rate, time left.

    with Progress(total=500, desc="pre-train tiny mixtral", unit="step", tokens_per_step=2048) as progress:
        for batch in batches:
            ...
            progress.update(loss=f"{loss:.3f}")

On a terminal it is a tqdm bar. Anywhere else (`make demo > log`, CI, a pipe) a bar's
carriage returns show nothing until it closes, so it logs one line every `every` seconds
instead, and one at the end:

    pre-train tiny mixtral: 120/500 steps (24%), 2.3 steps/s, 4700 tokens/s, ~2m45s left, loss 5.104
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Callable

from tqdm.auto import tqdm

log = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Counts `total` units of work; a tqdm bar on a terminal, else a log line every `every` seconds.

    `bar` forces one or the other (default: a bar when stderr is a terminal); `clock` is for tests.
    """

    def __init__(self, total: int, desc: str, unit: str = "step", tokens_per_step: int | None = None,
                 every: float = 10.0, bar: bool | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.tokens_per_step = tokens_per_step
        self.every = every
        self.done = 0
        self.clock = clock
        self.start = clock()
        self.last_line = self.start
        self.postfix: dict[str, str] = {}
        self.closed = False
        use_bar = sys.stderr.isatty() if bar is None else bar
        self.bar = tqdm(total=total, desc=desc, unit=unit) if use_bar else None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1, **postfix: str) -> None:
        """Count `n` more units; `postfix` (e.g. ``loss="5.104"``) is shown after the rate."""
        self.done += n
        self.postfix = postfix
        if self.bar is not None:
            rate = self.bar.format_dict["rate"]
            tokens = {"tok/s": f"{rate * self.tokens_per_step:.0f}"} if rate and self.tokens_per_step else {}
            self.bar.set_postfix({**tokens, **postfix}, refresh=False)
            self.bar.update(n)
            return
        now = self.clock()
        if now - self.last_line >= self.every and self.done < self.total:  # the last line comes from close()
            self.last_line = now
            log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        """``desc: done/total units (pct), rate, tokens/s, time left or time taken, postfix``."""
        elapsed = max((self.clock() if now is None else now) - self.start, 1e-9)
        rate = self.done / elapsed
        parts = [f"{self.desc}: {self.done}/{self.total} {self.unit}s ({100 * self.done / max(self.total, 1):.0f}%)",
                 f"{rate:.2f} {self.unit}s/s"]
        if self.tokens_per_step:
            parts.append(f"{rate * self.tokens_per_step:.0f} tokens/s")
        if self.done < self.total and rate > 0:
            parts.append(f"~{_duration((self.total - self.done) / rate)} left")
        elif self.done >= self.total:
            parts.append(f"done in {_duration(elapsed)}")
        parts += [f"{k} {v}" for k, v in self.postfix.items()]
        return ", ".join(parts)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif self.done:
            log.info("%s", self.line())
