"""Wall time of the README's main job (`tearless train`, the default GRPO run) on this machine.

Each repeat runs the CLI in a fresh process with a fresh task cache (so the data generation and the
supervised warm-up are included: the first-run cost a new user sees) and a fresh run directory, then
once more with the cache warm. Prints the medians and the held-out accuracy before/after.

    python benchmarks/default_run.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time


def run_once(cache: str, run_dir: str) -> tuple[float, dict[str, float]]:
    env = {**os.environ, "TEARLESS_CACHE": cache}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tearless.cli", "train", f"trainer.default_local_dir={run_dir}"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - start
    accs = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"(\S+/acc/\S+)\s+before ([\d.]+)\s+after ([\d.]+)", line)
        if m:
            accs[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return seconds, accs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    cold, warm, results = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            cache = os.path.join(tmp, f"cache{r}")
            seconds, accs = run_once(cache, os.path.join(tmp, f"run{r}a"))
            cold.append(seconds)
            results.append(accs)
            seconds, _ = run_once(cache, os.path.join(tmp, f"run{r}b"))
            warm.append(seconds)
            print(
                f"repeat {r}: fresh cache {cold[-1]:.1f} s, warm cache {warm[-1]:.1f} s, {accs}", flush=True
            )
    greedy = [a["val-core/arithmetic/acc/greedy"] for a in results]
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "fresh_cache_seconds_median": round(statistics.median(cold), 1),
        "warm_cache_seconds_median": round(statistics.median(warm), 1),
        "greedy_before_after": greedy,
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
