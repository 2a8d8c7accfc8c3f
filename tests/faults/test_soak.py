"""Soak: resident memory, file descriptors and reward processes stay flat over a long tiny run.

CI runs ``TEARLESS_SOAK_STEPS`` steps (default 40); RELIABILITY.md has the 500-step figures
(``benchmarks/reliability.py``). The bounds: after a warm-up of a tenth of the run, the trainer's
RSS may grow by at most 15 MiB (the median of the last 10 steps against the 10 after the warm-up;
a leak of one rollout batch per step, ~50 KiB here, would pass it within 300 steps, a leak of one
model copy at once), the workers' by 5 MiB, and the counts of open files and of reward worker
processes may not grow at all.
"""

from __future__ import annotations

import os

import pytest

from tests.faults.soak import growth, soak

pytestmark = pytest.mark.slow
STEPS = int(os.environ.get("TEARLESS_SOAK_STEPS", "40"))


@pytest.mark.timeout(600)
def test_a_long_run_does_not_grow(task, tmp_path):
    series = soak(task, tmp_path, STEPS)
    warmup = max(STEPS // 10, 5)
    assert len(series["rss_mb"]) == STEPS
    assert growth(series["rss_mb"], warmup) <= 15.0, series["rss_mb"]
    assert growth(series["workers_rss_mb"], warmup) <= 5.0, series["workers_rss_mb"]
    assert max(series["fds"][warmup:]) <= series["fds"][warmup], series["fds"]
    assert set(series["children"]) == {2.0}  # the two reward workers, never more, never replaced lost
