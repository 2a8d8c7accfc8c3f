"""Every preference loss of `tearless dpo` on the embedded task's pairs, same budget and defaults.

Each loss type runs `tearless dpo algorithm.loss_type=X` (β = 2.0, the embedded default, 4 epochs
over the pairs made from the warm-up model's own answers; `exo_pair` with ε = 1e-3 as its paper, the
KTO family on the pairs read as unpaired examples) in a fresh process with the task cached. Recorded:
greedy held-out task accuracy before (the warm-up model) and after, and held-out preference accuracy
(`val/rewards/accuracies`; KTO logs none). `--seeds 1 2` repeats each run with another shuffle seed.

    OMP_NUM_THREADS=1 python benchmarks/preference_losses.py --seeds 1 2 --only kto orpo
    OMP_NUM_THREADS=1 python benchmarks/preference_losses.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile

from dpo_sft import GREEDY, cli

EXTRA = {"exo_pair": ("algorithm.label_smoothing=0.001",)}


def main() -> None:
    from tearless.algos import DPO_LOSSES, KTO_LOSSES

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1])
    ap.add_argument("--only", nargs="*", help="loss types to run (default: all)")
    ap.add_argument("--cache", help="task cache directory (default: a fresh temporary one)")
    args = ap.parse_args()
    kinds = args.only or sorted(DPO_LOSSES) + sorted(KTO_LOSSES)
    report: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '2')}",
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or f"{tmp}/cache"
        for kind in kinds:
            for seed in args.seeds:
                run_dir = f"{tmp}/{kind}-{seed}"
                seconds, metrics, _ = cli(
                    "dpo",
                    f"algorithm.loss_type={kind}",
                    *EXTRA.get(kind, ()),
                    f"trainer.seed={seed}",
                    "trainer.logger=[console]",
                    f"trainer.default_local_dir={run_dir}",
                    cache=cache,
                )
                row = {
                    "greedy_before_after": metrics[GREEDY],
                    "preference_accuracy_after": metrics.get("val/rewards/accuracies", (None, None))[1],
                    "seconds": round(seconds, 1),
                }
                report["runs"][f"{kind} seed {seed}"] = row
                print(f"{kind} seed {seed}: {row}", flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
