"""Logging overhead of the default run: the time each step spends in ``Tracker.log`` (JSONL, progress
bar, the table every ``trainer.log_freq`` steps) and ``RLTrainer._dump_samples`` (the gzip rollout
records), as a share of the step's ``timing_s/step``. Target: a median under 2%.

Both run outside the step's timer, so wrapping them measures them without changing ``timing_s/step``.

    OMP_NUM_THREADS=1 python benchmarks/logging_overhead.py --steps 60
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable

from tearless.config import load_config
from tearless.run.tracking import Tracker
from tearless.trainers import rl


def timed(fn: Callable, seconds: list[float]) -> Callable:
    """``fn`` that appends its wall time to ``seconds`` on each call."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=1, help="trainer.num_threads")
    args = ap.parse_args()
    log_s: dict[int, float] = defaultdict(float)
    dump_s: list[float] = []
    step_s: dict[int, float] = {}
    original_log = Tracker.log

    def log(self: Tracker, metrics: dict, step: int) -> None:
        start = time.perf_counter()
        original_log(self, metrics, step)
        log_s[step] += time.perf_counter() - start
        if "timing_s/step" in metrics:
            step_s[step] = metrics["timing_s/step"]

    Tracker.log = log
    rl.RLTrainer._dump_samples = timed(rl.RLTrainer._dump_samples, dump_s)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            [
                f"trainer.default_local_dir={tmp}/run",
                f"trainer.total_training_steps={args.steps}",
                f"trainer.num_threads={args.threads}",
            ],
        )
        trainer = rl.RLTrainer(cfg, log=lambda _: None)
        # The progress bar and tables go to a buffer, as to a terminal, without cluttering the output.
        stderr = io.StringIO()
        original_init = Tracker.__init__
        Tracker.__init__ = lambda self, *a, **k: original_init(self, *a, **{**k, "stream": stderr})
        trainer.fit()
        rollouts_kb = os.path.getsize(f"{tmp}/run/rollouts.jsonl.gz") / 1024
    steps = sorted(step_s)
    overhead = [log_s[s] + dump_s[i] for i, s in enumerate(steps)]
    shares = [o / step_s[s] for o, s in zip(overhead, steps, strict=True)]
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "steps": len(steps),
        "step_seconds_median": round(statistics.median(step_s.values()), 3),
        "tracker_log_ms_median": round(1e3 * statistics.median(log_s[s] for s in steps), 3),
        "dump_samples_ms_median": round(1e3 * statistics.median(dump_s), 3),
        "overhead_share_median_pct": round(100 * statistics.median(shares), 3),
        "overhead_share_max_pct": round(100 * max(shares), 3),
        "rollouts_jsonl_gz_kib": round(rollouts_kb, 1),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
