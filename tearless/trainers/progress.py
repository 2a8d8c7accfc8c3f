"""What a run says as it goes: progress lines for long phases (validation, the DPO reference pass),
silent while a phase is quick, and the run's tracker (:func:`run_tracker`).

A phase reports ``done/total`` at most every ``every_s`` seconds, so the embedded task's one-second
validation prints nothing while a real model's minutes of generation say how far they are.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from tearless.config import to_dict
from tearless.run.tracking import Tracker


def run_tracker(run_dir: str | os.PathLike, cfg: Any, *, total_steps: int, **kwargs: Any) -> Tracker:
    """The run's :class:`~tearless.run.tracking.Tracker`, as every trainer (RL, offline, flow) makes it:
    its config's ``trainer`` loggers, project, experiment and log frequency, the whole config recorded;
    ``kwargs`` (``key_metrics``, ``callbacks``) go to the tracker."""
    t = cfg.trainer
    return Tracker(
        run_dir,
        list(t.logger),
        total_steps=total_steps,
        config=to_dict(cfg),
        project=t.project_name,
        experiment=t.experiment_name,
        log_freq=t.log_freq,
        **kwargs,
    )


def say_if_complete(tracker: Tracker, run_dir: Any, start_step: int, total_steps: int, again: str) -> None:
    """A resumed run with no step left says so (and how to train ``again``) instead of ending silently."""
    if start_step >= total_steps:
        done = f"the run in {run_dir} is already complete ({start_step} steps)"
        tracker.write(f"{done}; {again} to train again")


class Progress:
    """``Progress(log, "validation, greedy", total, "prompts")``; call :meth:`update` after each batch."""

    def __init__(
        self, log: Callable[[str], None], what: str, total: int, unit: str, *, every_s: float = 10.0
    ) -> None:
        self.log, self.what, self.total, self.unit, self.every_s = log, what, total, unit, every_s
        self.start = self.last = time.perf_counter()
        self.spoke = False

    def update(self, done: int) -> None:
        """Say ``done/total`` if ``every_s`` passed since the start or the last line (and at the end, once
        something was said)."""
        now = time.perf_counter()
        if now - self.last >= self.every_s or (self.spoke and done >= self.total):
            self.spoke, self.last = True, now
            self.log(f"{self.what}: {done}/{self.total} {self.unit} ({now - self.start:.0f} s)")
