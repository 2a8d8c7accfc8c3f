"""On-policy distillation vs GRPO on the real model: SmolLM2-135M-Instruct, word problems.

The real-model recipe (``--preset word_problems``, docs/real-model.md), offline as
``benchmarks/real_model.py`` prepares it. Per seed, two runs from the same pretrained start, the same
batch (8 prompts × 8 samples a step), learning rate, sampling and seed, validated greedily on the
held-out word problems every ``--every`` steps:

- ``grpo``: the recipe as it is (the task's exact-answer reward);
- ``distill``: ``algorithm.adv_estimator=on_policy_distill`` with no task reward, the teacher being the
  final checkpoint of the first seed's ``grpo`` run (a word-problems-trained SmolLM2, as the issue
  asks); its per-token signal is ``log π_T − log π_S`` on the student's own samples.

So the ``grpo`` curve of the first seed ends at the teacher's accuracy by construction, and the
question is how many samples each student needs to get there. Samples seen = steps × 64. Writes a
JSON (``--out``) and prints a Markdown table.

    python benchmarks/distill_real.py --seeds 1 2 --work /tmp/real-model --every 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from distill import table
from real_model import GREEDY, cli, offline_work

SAMPLES_PER_STEP = 8 * 8  # the preset's data.train_batch_size × rollout.n


def run(work: Path, name: str, seed: int, steps: int, every: int, env: dict, *extra: str) -> dict:
    """One ``tearless train --preset word_problems`` in a fresh process; its curve and wall time."""
    run_dir = work / name
    command = [
        "train", "--preset", "word_problems", f"data.train_files={work / 'wp' / 'train.parquet'}",
        f"data.val_files={work / 'wp' / 'test.parquet'}", f"trainer.seed={seed}",
        f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable",
        f"trainer.total_training_steps={steps}", f"trainer.test_freq={every}", f"trainer.save_freq={steps}",
        *extra,
    ]  # fmt: skip
    start = time.perf_counter()
    done = cli(*command, env=env)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kl = {r["step"]: r["distill/reverse_kl"] for r in records if "distill/reverse_kl" in r}
    points = [
        {"samples": r["step"] * SAMPLES_PER_STEP, "acc": r[GREEDY], "reverse_kl": kl.get(r["step"])}
        for r in records
        if GREEDY in r
    ]
    return {
        "command": "tearless " + " ".join(command),
        "curve": points,
        "wall_s": round(time.perf_counter() - start, 1),
        "checkpoint": str(run_dir / f"global_step_{steps}" / "actor"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=16, help="the recipe's 16 steps")
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--work", default="/tmp/tearless-real-model")
    ap.add_argument("--out", default="distill_real.json")
    args = ap.parse_args()
    work, env = offline_work(args.work)
    result: dict = {"args": vars(args), "runs": {}}
    teacher = None
    for seed in args.seeds:
        grpo = run(work, f"grpo-{seed}", seed, args.steps, args.every, env)
        result["runs"][f"grpo-{seed}"] = grpo
        print(f"grpo-{seed}", [(p["samples"], p["acc"]) for p in grpo["curve"]], flush=True)
        teacher = teacher or grpo["checkpoint"]
        result["teacher"] = teacher
        distill = run(
            work, f"distill-{seed}", seed, args.steps, args.every, env,
            "algorithm.adv_estimator=on_policy_distill", f"actor_rollout_ref.teacher.model.path={teacher}",
        )  # fmt: skip
        result["runs"][f"distill-{seed}"] = distill
        print(f"distill-{seed}", [(p["samples"], p["acc"]) for p in distill["curve"]], flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
