"""vela_ray.progress: off a terminal, long work logs its steps, rate, tokens/s and time left every few seconds."""

from __future__ import annotations

import logging

from vela_ray.progress import Progress


def test_off_a_terminal_progress_logs_a_line_every_few_seconds_and_one_at_the_end(caplog):
    times = iter(float(t) for t in [0, 4, 11, 12, 25, 30])  # the start, each update, the close
    caplog.set_level(logging.INFO, logger="vela_ray.progress")
    with Progress(total=4, desc="pre-train", tokens_per_step=100, every=10.0, bar=False,
                  clock=lambda: next(times)) as bar:
        for loss in ("5.000", "4.000", "3.000", "2.000"):
            bar.update(loss=loss)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "pre-train: 2/4 steps (50%), 0.18 steps/s, 18 tokens/s, ~11s left, loss 4.000",
        "pre-train: 4/4 steps (100%), 0.13 steps/s, 13 tokens/s, done in 30s, loss 2.000",
    ]


def test_on_a_terminal_progress_is_a_tqdm_bar_and_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="vela_ray.progress")
    with Progress(total=3, desc="profile", unit="batch", bar=True) as bar:
        for _ in range(3):
            bar.update()
        assert bar.bar.n == 3
    assert caplog.records == []
