"""Step time of the default run in one process vs on Ray workers with FSDP2 (CPU, gloo).

Each placement trains the same config (the default GRPO run on the embedded task: 16 prompts × 8
responses per step) for ``--steps`` steps, one after the other in this process's Ray session, and the
per-step timings logged in ``metrics.jsonl`` are summarised as medians over the steps after the first
(which pays for lazy initialisation): the step, generation and scoring (each the slowest rank's), the
actor update and the weight broadcast to separate rollout workers. Start-up (model loading, Ray
actors, process groups) is timed separately. The runs draw the same responses (keyed sampling) and
must agree: the largest relative difference of ``actor/pg_loss`` between a Ray run and the local run
is printed as a check.

    OMP_NUM_THREADS=1 TEARLESS_CACHE=<warm cache> python benchmarks/scale.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time

import torch

from tearless.config import load_config
from tearless.run.tracking import read_metrics
from tearless.trainers.rl import RLTrainer

PLACEMENTS = {
    "local (1 process)": ["trainer.placement=local"],
    "ray, 1 worker": ["trainer.placement=ray", "trainer.n_gpus_per_node=1"],
    "ray, 2 workers (hybrid)": ["trainer.placement=ray", "trainer.n_gpus_per_node=2"],
    "ray, 1 trainer + 1 rollout worker (split)": [
        "trainer.placement=ray",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    ],
}
TIMINGS = ("step", "gen", "reward", "update_actor", "update_weights")


def run(overrides: list[str]) -> tuple[float, list[dict]]:
    cfg = load_config(None, overrides)
    started = time.perf_counter()
    trainer = RLTrainer(cfg, log=lambda _: None)
    startup = time.perf_counter() - started
    trainer.fit()
    return startup, [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if r["step"] > 0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    results, losses = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in PLACEMENTS.items():
            overrides = [
                f"trainer.default_local_dir={tmp}/{len(results)}",
                f"trainer.total_training_steps={args.steps}",
                "trainer.num_threads=1",
                "trainer.val_before_train=false",
                "data.val_max_samples=16",
                "trainer.logger=[jsonl]",
                *extra,
            ]
            startup, records = run(overrides)
            later = records[1:]
            results[name] = {"startup_s": round(startup, 2)}
            for key in TIMINGS:
                values = [r[f"timing_s/{key}"] for r in later if f"timing_s/{key}" in r]
                if values:
                    results[name][f"{key}_s_median"] = round(statistics.median(values), 4)
            losses[name] = [(r["actor/pg_loss"], r["actor/grad_norm"]) for r in records]
    local = losses["local (1 process)"]
    for name, values in losses.items():
        # pg_loss of on-policy GRPO is a mean of advantages, near 0: its difference relative to the
        # run's largest |pg_loss|; the gradient norm relative to itself.
        scale = max(abs(a) for a, _ in local)
        pg = max(abs(a - b) for (a, _), (b, _) in zip(local, values, strict=True)) / scale
        gn = max(abs(a - b) / a for (_, a), (_, b) in zip(local, values, strict=True))
        results[name]["pg_loss_max_diff_vs_local"] = float(f"{pg:.2e}")
        results[name]["grad_norm_max_rel_diff_vs_local"] = float(f"{gn:.2e}")
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, ray {ray.__version__}",
        "steps": args.steps,
        "load_average_1min_at_end": round(os.getloadavg()[0], 2),
        "results": results,
    }
    ray.shutdown()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
