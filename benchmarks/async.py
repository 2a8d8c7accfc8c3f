"""Asynchronous (one-step-off) against synchronous training, both in the split placement.

1 training worker + 1 rollout worker (Ray, one thread each) train the default GRPO run on the
embedded task (16 prompts × 8 responses a step, where generation and the update cost about the same)
for ``--steps`` steps, synchronously and with ``async_training.max_staleness=1`` (with token-level
TIS, which needs the trainer's π_old forward, without a correction, and without a correction with
partial rollouts), for each seed. The runs of a seed go one after the other, the order of the modes
reversed from seed to seed, so that load drifting over time hits all of them. Per run: steps per
second over the steps after the first (1 / median ``timing_s/step``, and the steps after the first
over their summed step time), the medians of the step's phases, and greedy held-out accuracy after
the last step (the same number of samples in both modes).

    OMP_NUM_THREADS=1 TEARLESS_CACHE=<warm cache> python benchmarks/async.py --steps 20 --seeds 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile

import torch

from tearless.config import load_config
from tearless.run.tracking import read_metrics
from tearless.trainers.rl import RLTrainer

SPLIT = [
    "trainer.placement=ray",
    "trainer.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.nnodes=1",
    "actor_rollout_ref.rollout.n_gpus_per_node=1",
]
MODES = {
    "sync": ["async_training.enable=false"],
    "async k=1 + TIS": [
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
    ],
    # Without a correction the trainer skips the π_old forward, as the synchronous run does.
    "async k=1": ["async_training.enable=true", "async_training.max_staleness=1"],
    # Partial rollouts: the weight sync does not wait for the generation call in flight.
    "async k=1 partial": [
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "async_training.partial_rollout=true",
    ],
}
TIMINGS = (
    "step",
    "gen",
    "reward",
    "old_log_prob",
    "update_actor",
    "update_weights",
    "train_idle",
    "gen_idle",
    "weight_swap",
)


def run(overrides: list[str]) -> dict:
    trainer = RLTrainer(load_config(None, overrides), log=lambda _: None)
    summary = trainer.fit()
    records = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if r["step"] > 0]
    later = records[1:]
    steps = [r["timing_s/step"] for r in later]
    result = {
        "steps_per_s_median": round(1 / statistics.median(steps), 3),
        "steps_per_s_total": round(len(steps) / sum(steps), 3),
        "val_acc_greedy": summary["after"]["val-core/arithmetic/acc/greedy"],
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in later),
        "partial_frac_mean": statistics.mean(r.get("async/partial_frac", 0.0) for r in later),
    }
    for key in TIMINGS:
        values = [r[f"timing_s/{key}"] for r in later if f"timing_s/{key}" in r]
        if values:
            result[f"{key}_s_median"] = round(statistics.median(values), 4)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            order = list(MODES) if seed % 2 else list(reversed(MODES))
            for mode in order:
                overrides = [
                    f"trainer.default_local_dir={tmp}/{mode.replace(' ', '_')}-{seed}",
                    f"trainer.total_training_steps={args.steps}",
                    f"trainer.seed={seed}",
                    "trainer.num_threads=1",
                    "trainer.val_before_train=false",
                    "trainer.logger=[jsonl]",
                    *SPLIT,
                    *MODES[mode],
                ]
                results[f"{mode}, seed {seed}"] = run(overrides)
                results[f"{mode}, seed {seed}"]["load_average_1min"] = round(os.getloadavg()[0], 2)
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, ray {ray.__version__}",
        "steps": args.steps,
        "results": results,
    }
    ray.shutdown()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
