"""What `tearless sft` and `tearless dpo` reach on the embedded task with their defaults.

SFT: `tearless sft` with no arguments trains a fresh tiny Llama on the flawed teacher's
demonstrations (the same run that builds the RL trainer's warm-up model); recorded: greedy held-out
accuracy, next to that of the cached warm-up model the RL runs start from, and wall time.

DPO: `tearless dpo` with no arguments, with a fresh task cache (so the wall time includes the
warm-up and the pair sampling a new user pays once) and again with the cache warm; recorded:
held-out preference accuracy and greedy task accuracy before/after, pair counts, wall times.
Each repeat uses another `trainer.seed` (the DPO shuffle; the task and pairs stay the same).

    python benchmarks/dpo_sft.py --repeats 3
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

LINE = re.compile(r"^(\S+)\s+before ([-\d.]+)\s+after ([-\d.]+)")
GREEDY = "val-core/arithmetic/acc/greedy"


def cli(*args: str, cache: str) -> tuple[float, dict[str, tuple[float, float]], str]:
    """Run `tearless <args>` in a fresh process; return its wall time, before/after metrics, output."""
    env = {**os.environ, "TEARLESS_CACHE": cache, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tearless.cli", *args], env=env, capture_output=True, text=True, check=True
    )
    seconds = time.perf_counter() - start
    metrics = {}
    for line in proc.stdout.splitlines():
        m = LINE.match(line)
        if m:
            metrics[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return seconds, metrics, proc.stdout + proc.stderr


def warmup_accuracy(cache: str) -> float:
    """Greedy held-out accuracy of the cached warm-up model of the default task."""
    from tearless.data import load_rows
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.offline import greedy_accuracy
    from tearless.trainers.warmup import prepare_task

    files = prepare_task(TaskSpec(), cache, log=lambda _: None)
    model, tok = load_causal_lm(files.model_dir), load_tokenizer(files.model_dir)
    return greedy_accuracy(model, tok, load_rows(files.val_file), max_new_tokens=16)[GREEDY]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    report: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '2')}",
    }
    with tempfile.TemporaryDirectory() as tmp:
        seconds, sft, _ = cli(
            "sft", f"trainer.default_local_dir={tmp}/sft", "trainer.logger=[]", cache=f"{tmp}/c0"
        )
        report["sft"] = {"seconds": round(seconds, 1), "greedy_before_after": sft[GREEDY]}
        print(f"sft: {seconds:.0f} s, greedy {sft[GREEDY]}", flush=True)
        dpo_runs = []
        for r in range(args.repeats):
            cache = f"{tmp}/c{r + 1}"
            common = ("dpo", f"trainer.seed={r + 1}", "trainer.logger=[console]")
            cold, metrics, output = cli(*common, f"trainer.default_local_dir={tmp}/dpo{r}a", cache=cache)
            warm, _, _ = cli(*common, f"trainer.default_local_dir={tmp}/dpo{r}b", cache=cache)
            pairs = re.search(r"(\d+) training, (\d+) held-out pairs", output)
            run = {
                "fresh_cache_seconds": round(cold, 1),
                "warm_cache_seconds": round(warm, 1),
                "pairs_train_heldout": [int(pairs.group(1)), int(pairs.group(2))] if pairs else None,
                "preference_accuracy_before_after": metrics["val/rewards/accuracies"],
                "greedy_before_after": metrics[GREEDY],
            }
            dpo_runs.append(run)
            print(f"dpo repeat {r}: {run}", flush=True)
        report["warmup_model_greedy"] = warmup_accuracy(f"{tmp}/c1")
    report["dpo"] = dpo_runs
    report["dpo_median"] = {
        "preference_accuracy_after": statistics.median(
            r["preference_accuracy_before_after"][1] for r in dpo_runs
        ),
        "greedy_after": statistics.median(r["greedy_before_after"][1] for r in dpo_runs),
        "warm_cache_seconds": statistics.median(r["warm_cache_seconds"] for r in dpo_runs),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
