"""Every algorithm preset on the embedded task, same budget, same warm-up model, same seed.

Records held-out greedy and sampled accuracy before and after, and (for PPO) the critic's explained
variance early vs late in the run. One torch thread per run, so the numbers do not depend on what
else the machine is doing (the wall times do).

    python benchmarks/algorithms.py --steps 60
    python benchmarks/algorithms.py --steps 60 --presets dr_grpo --seeds 1 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import tearless
from tearless.config import presets
from tearless.run.tracking import read_metrics


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--presets", nargs="*", default=presets())
    ap.add_argument("--seeds", nargs="*", type=int, default=[1], help="trainer.seed of each run")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, seed in [(p, s) for p in args.presets for s in args.seeds]:
            start = time.perf_counter()
            run_dir = f"{tmp}/{name}-{seed}"
            summary = tearless.train(
                None,
                [
                    f"trainer.total_training_steps={args.steps}",
                    f"trainer.seed={seed}",
                    "trainer.num_threads=1",
                    f"trainer.default_local_dir={run_dir}",
                    "trainer.logger=[jsonl]",
                ],
                preset=name,
                log=lambda _: None,
            )
            seconds = time.perf_counter() - start
            b, a = summary["before"], summary["after"]
            row = {
                "preset": name,
                "seed": seed,
                "seconds": round(seconds, 1),
                "greedy_before": b["val-core/arithmetic/acc/greedy"],
                "greedy_after": a["val-core/arithmetic/acc/greedy"],
                "mean@4_before": b["val-core/arithmetic/acc/mean@4"],
                "mean@4_after": a["val-core/arithmetic/acc/mean@4"],
            }
            records = read_metrics(f"{run_dir}/metrics.jsonl")
            ev = [r["critic/vf_explained_var"] for r in records if "critic/vf_explained_var" in r]
            if ev:
                k = max(1, len(ev) // 5)
                row["explained_var_first_fifth"] = round(statistics.mean(ev[:k]), 3)
                row["explained_var_last_fifth"] = round(statistics.mean(ev[-k:]), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| preset | seed | greedy before → after | sampled mean@4 before → after | wall s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['seed']} | {r['greedy_before']:.3f} → {r['greedy_after']:.3f} | "
            f"{r['mean@4_before']:.3f} → {r['mean@4_after']:.3f} | {r['seconds']} |"
        )


if __name__ == "__main__":
    main()
