"""Search-R1 on the embedded multi-hop QA task: greedy exact match before and after GRPO with the search
tool, and the same run without the tool (``multi_turn.enable=false``) as the control.

Each run trains in this process with one torch thread and in-process reward scoring, so its CPU time
(user + system, from ``getrusage``) is what the run costs whatever else shares the machine; wall time
is reported too. The task (data, corpus, warmed-up model) is built first, once, and cached.

    TEARLESS_CACHE=/tmp/tl-cache python benchmarks/search_r1.py --steps 20 --test-freq 5
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(name: str, run_dir: Path, steps: int, test_freq: int, seed: int, extra: list[str]) -> dict:
    from tearless import train
    from tearless.run.tracking import read_metrics

    overrides = [
        f"trainer.default_local_dir={run_dir}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        "trainer.num_threads=1",
        f"trainer.seed={seed}",
        "trainer.logger=[jsonl]",
        "reward_model.num_workers=0",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        *extra,
    ]
    cpu, wall = cpu_seconds(), time.perf_counter()
    summary = train(None, overrides, preset="search_r1", log=lambda _: None)
    cpu, wall = cpu_seconds() - cpu, time.perf_counter() - wall
    key = "val-core/searchR1_multihop/acc/greedy"
    curve = [
        (int(r.get("training/global_step", 0)), r[key])
        for r in read_metrics(run_dir / "metrics.jsonl")
        if key in r
    ]
    train_rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    last = train_rows[-5:]
    result = {
        "run": name,
        "before": summary["before"][key],
        "after": summary["after"][key],
        "curve": curve,
        "cpu_s": round(cpu, 1),
        "wall_s": round(wall, 1),
        "tool_calls_last5": sum(r.get("multi_turn/tool_calls/mean", 0.0) for r in last) / len(last),
        "train_reward_last5": sum(r["critic/score/mean"] for r in last) / len(last),
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--test-freq", type=int, default=5)
    ap.add_argument("--only", choices=["search", "control"], default=None)
    ap.add_argument("--seed", type=int, default=1, help="trainer.seed (the task and warm-up stay the same)")
    args = ap.parse_args()
    from tearless.config import load_config
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    cfg = load_config(None, preset="search_r1")
    started = time.perf_counter()
    files = prepare_task(TaskSpec.from_config(cfg.task), cfg.task.cache_dir)
    print(json.dumps({"task": files.info, "prepare_s": round(time.perf_counter() - started, 1)}), flush=True)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "search"):
            results.append(
                run("search tool", Path(tmp) / "search", args.steps, args.test_freq, args.seed, [])
            )
        if args.only in (None, "control"):
            control = ["actor_rollout_ref.rollout.multi_turn.enable=false"]
            results.append(
                run(
                    "no tool (control)", Path(tmp) / "control", args.steps, args.test_freq, args.seed, control
                )
            )
    print(f"\nmachine: {platform.machine()}, Python {sys.version.split()[0]}, one torch thread\n")
    print(
        "| run | greedy EM before → after | EM at steps | train reward (last 5) | tool calls / question "
        "| CPU s | wall s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        curve = ", ".join(f"{s}: {v:.2f}" for s, v in r["curve"])
        print(
            f"| {r['run']} | {r['before']:.3f} → **{r['after']:.3f}** | {curve} | "
            f"{r['train_reward_last5']:.2f} | {r['tool_calls_last5']:.2f} | "
            f"{r['cpu_s']:.0f} | {r['wall_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
