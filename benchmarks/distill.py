"""On-policy distillation vs GRPO from the same start: held-out greedy accuracy per sample seen.

On the embedded arithmetic task (the package's default run: its warmed-up tiny Llama, which drops
carries):

1. the teacher: GRPO from the warm-up model for ``--teacher-steps`` steps of 32 prompts × 8
   responses (the default run's recipe); its final checkpoint's ``actor/`` directory;
2. for each seed, two students from the warm-up model, ``--steps`` steps of ``--prompts`` prompts ×
   ``--n`` responses each, validated greedily on the task's held-out prompts every ``--every`` steps:
   ``distill`` (``algorithm.adv_estimator=on_policy_distill`` with that teacher, no task reward) and
   ``grpo`` (the task's exact-sum reward), and with ``--mix α`` also ``distill+task`` (the teacher's
   signal plus α times the task reward's GRPO advantage); the same seed, batch, learning rate and
   sampling.

Samples seen = steps × prompts × n. Writes a JSON of the curves (``--out``) and prints a Markdown
table for BENCHMARKS.md.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/distill.py --seeds 1 2 3 4 --steps 40 --every 4 --mix 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

GREEDY = "val-core/arithmetic/acc/greedy"


def run(task, run_dir: Path, steps: int, every: int, *extra: str) -> list[dict]:
    """One ``tearless train`` in this process; its metrics records."""
    from tearless import train
    from tearless.run.tracking import read_metrics

    train(
        None,
        [
            f"actor_rollout_ref.model.path={task.model_dir}",
            f"data.train_files={task.train_file}",
            f"data.val_files={task.val_file}",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={steps}",
            f"trainer.test_freq={every}",
            "trainer.logger=[jsonl]",
            "trainer.num_threads=1",
            "reward_model.num_workers=0",
            *extra,
        ],
        log=lambda _: None,
    )
    return read_metrics(run_dir / "metrics.jsonl")


def curve(records: list[dict], samples_per_step: int) -> list[dict]:
    """(samples seen, held-out greedy accuracy, reverse KL to the teacher when logged) per validation."""
    kl = {r["step"]: r["distill/reverse_kl"] for r in records if "distill/reverse_kl" in r}
    return [
        {"samples": r["step"] * samples_per_step, "acc": r[GREEDY], "reverse_kl": kl.get(r["step"])}
        for r in records
        if GREEDY in r
    ]


def main() -> None:
    from tearless.cachedir import default_cache_dir
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--teacher-steps", type=int, default=40)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--mix", type=float, default=0.0, help="also run distill+task with this α (0: not run)")
    ap.add_argument("--out", default="distill.json")
    args = ap.parse_args()

    task = prepare_task(TaskSpec(), default_cache_dir(), log=print)
    batch = [
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
    ]
    result: dict = {"machine": platform.processor() or platform.machine(), "args": vars(args), "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        teacher_dir = Path(tmp) / "teacher"
        records = run(
            task,
            teacher_dir,
            args.teacher_steps,
            args.teacher_steps,
            "data.train_batch_size=32",
            "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=32",
            f"trainer.save_freq={args.teacher_steps}",
            "trainer.seed=2",
        )
        teacher = str(teacher_dir / f"global_step_{args.teacher_steps}" / "actor")
        result["warmup_acc"] = records[0][GREEDY]
        result["teacher_acc"] = records[-1][GREEDY]
        result["teacher_seconds"] = round(time.time() - start, 1)
        print(f"teacher: greedy {result['warmup_acc']:.3f} -> {result['teacher_acc']:.3f}", flush=True)
        modes = {
            "distill": [
                "algorithm.adv_estimator=on_policy_distill",
                f"actor_rollout_ref.teacher.model.path={teacher}",
            ],
            "grpo": ["algorithm.adv_estimator=grpo"],
        }
        if args.mix:
            modes["distill+task"] = [*modes["distill"], f"algorithm.distill_reward_coef={args.mix}"]
        for seed in args.seeds:
            for mode, extra in modes.items():
                start = time.time()
                run_dir = Path(tmp) / f"{mode}-{seed}"
                records = run(task, run_dir, args.steps, args.every, *batch, f"trainer.seed={seed}", *extra)
                points = curve(records, args.prompts * args.n)
                result["runs"][f"{mode}-{seed}"] = {"curve": points, "seconds": round(time.time() - start, 1)}
                print(mode, seed, [(p["samples"], round(p["acc"], 3)) for p in points], flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))


def table(result: dict) -> str:
    """The curves side by side: one row per validation, one column per run."""
    names = sorted(result["runs"])
    head = "| samples seen | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (len(names) + 1)]
    points = {name: result["runs"][name]["curve"] for name in names}
    for i, p in enumerate(points[names[0]]):
        cells = []
        for name in names:
            q = points[name][i]
            kl = "" if q["reverse_kl"] is None else f" (KL {q['reverse_kl']:.3f})"
            cells.append(f"{q['acc']:.3f}{kl}")
        lines.append(f"| {p['samples']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
