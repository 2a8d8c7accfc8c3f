"""An LLM judge as the only reward: GRPO on the embedded arithmetic task scored by a judge model served
over HTTP by tearless's own OpenAI-compatible endpoint, the policy's true accuracy measured apart.

1. Judge examples: the warm-up model answers every training prompt ``--samples`` times (temperature
   1); each distinct answer becomes a chat row whose user message is :data:`TEMPLATE` filled with the
   prompt, the answer and the reference sum, and whose reply is the task scorer's verdict, "1" or "0".
   The held-out prompts give held-out examples the same way.
2. The judge: ``tearless sft`` from the warm-up model on those rows (``--judge-steps`` steps).
3. Served: :class:`tearless.envs.endpoint.Endpoint` in this process, greedy; the judge's held-out
   accuracy is measured through it with :class:`tearless.rewards.judge.Judge`, the class a run uses.
4. For each seed: ``tearless train`` from the warm-up model with ``reward_model.judge.enable=true``
   pointing at the endpoint and ``reward_model.rule_weight=0`` (the default: the task's scorer is not
   called), so the judge's verdict is the only reward. The run's own validation is scored by the judge
   too (its ``acc/greedy`` is the judge's view); the true held-out accuracy is ``tearless eval`` of
   the warm-up model and of the final checkpoint with the task's scorer. The judge's verdicts on the
   policy's own samples (``rollouts.jsonl.gz``) are checked against the task's scorer in the run's
   first and last tenth. With ``--baseline``, the same run on the task's exact-sum reward.

Writes a JSON (``--out``) and prints the numbers for BENCHMARKS.md.

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/judge_rl.py --seeds 1 2 --baseline
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median

# The judge's user message: the problem, the policy's answer and the reference sum ("85+11=5+1=6, 96
# |96"); it answers 1 (correct) or 0, read by parser=number with score_range [0, 1].
TEMPLATE = "{prompt}{response}|{ground_truth}"
GREEDY = "val-core/arithmetic/acc/greedy"


def judge_rows(model, tokenizer, rows: list[dict], samples: int, seed: int) -> list[dict]:
    """One SFT row per distinct (prompt, sampled answer): the filled template and the verdict."""
    from tearless.rewards.judge import prompt_text
    from tearless.tasks import arithmetic
    from tearless.tasks.preferences import sampled_answers

    texts = sampled_answers(
        model, tokenizer, rows, samples_per_prompt=samples, max_new_tokens=16, seed=seed, chunk=500
    )
    out = []
    for j, row in enumerate(rows):
        truth = row["reward_model"]["ground_truth"]
        for answer in dict.fromkeys(texts[j * samples : (j + 1) * samples]):
            verdict = "1" if arithmetic.compute_score(answer, truth) >= 1.0 else "0"
            content = TEMPLATE.format(prompt=prompt_text(row["prompt"]), response=answer, ground_truth=truth)
            out.append(
                {
                    "messages": [
                        {"role": "user", "content": content},
                        {"role": "assistant", "content": verdict},
                    ],
                    "prompt": row["prompt"],
                    "response": answer,
                    "ground_truth": truth,
                    "verdict": int(verdict),
                }
            )
    return out


def judge_accuracy(judge, rows: list[dict]) -> dict:
    """The judge's accuracy on held-out rows, overall and on the correct and the wrong answers."""
    items = [
        {"prompt": r["prompt"], "solution_str": r["response"], "ground_truth": r["ground_truth"]}
        for r in rows
    ]
    scores = judge.score(items)
    said = [s if isinstance(s, float) else None for s in scores]
    hits = [s is not None and round(s) == r["verdict"] for s, r in zip(said, rows, strict=True)]
    right = [h for h, r in zip(hits, rows, strict=True) if r["verdict"] == 1]
    wrong = [h for h, r in zip(hits, rows, strict=True) if r["verdict"] == 0]
    return {
        "examples": len(rows),
        "accuracy": sum(hits) / len(hits),
        "on_correct_answers": sum(right) / max(1, len(right)),
        "on_wrong_answers": sum(wrong) / max(1, len(wrong)),
        "unreadable": sum(s is None for s in said),
    }


def true_accuracy(model: Path, val_file: str, out: Path) -> float:
    """``tearless eval`` of ``model`` with the task's own scorer: held-out greedy accuracy."""
    from tearless.cli import main

    code = main(
        ["eval", str(model), f"data.val_files={val_file}", "trainer.num_threads=1", "--out", str(out)]
    )
    if code != 0:
        raise SystemExit(f"tearless eval {model} failed ({code})")
    return json.loads(out.read_text())["metrics"][GREEDY]


def grpo(task, run_dir: Path, args: argparse.Namespace, seed: int, *extra: str) -> list[dict]:
    """``tearless train`` from the warm-up model (the default run's batch, ``--steps`` steps); its
    metrics records."""
    from tearless import train
    from tearless.run.tracking import read_metrics

    train(
        None,
        [
            f"actor_rollout_ref.model.path={task.model_dir}",
            f"data.train_files={task.train_file}",
            f"data.val_files={task.val_file}",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.total_training_steps={args.steps}",
            f"trainer.save_freq={args.steps}",
            f"trainer.seed={seed}",
            f"data.train_batch_size={args.prompts}",
            f"actor_rollout_ref.rollout.n={args.n}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
            "trainer.logger=[jsonl]",
            "trainer.num_threads=1",
            *extra,
        ],
        log=lambda _: None,
    )
    return read_metrics(run_dir / "metrics.jsonl")


def agreement(samples: list[dict], steps: int) -> dict:
    """How the judge's verdicts on the policy's own training samples compare with the task's scorer, in
    the run's first and last tenth: agreement, and the share of wrong answers the judge passed (what a
    policy learning the judge's blind spots would raise)."""
    from tearless.tasks import arithmetic

    out = {}
    tenth = max(1, steps // 10)
    for name, lo, hi in (("first", 1, tenth), ("last", steps - tenth + 1, steps)):
        rows = [r for r in samples if lo <= r["step"] <= hi]
        truth = [arithmetic.compute_score(r["response"], r["ground_truth"]) for r in rows]
        said = [round(r["reward_extra"].get("judge_score", -1.0)) for r in rows]
        wrong = [s for s, t in zip(said, truth, strict=True) if t == 0.0]
        out[f"agreement_{name}_tenth"] = sum(s == t for s, t in zip(said, truth, strict=True)) / len(rows)
        out[f"true_acc_samples_{name}_tenth"] = sum(truth) / len(rows)
        out[f"wrong_passed_{name}_tenth"] = sum(s == 1 for s in wrong) / max(1, len(wrong))
        passed = Counter(
            f"{r['response']} (sum {r['ground_truth']})"
            for r, s, t in zip(rows, said, truth, strict=True)
            if s == 1 and t == 0.0
        )
        out[f"wrong_passed_{name}_tenth_examples"] = passed.most_common(5)
    return out


def main() -> None:
    from tearless.cli import main as cli
    from tearless.data import load_rows, write_parquet
    from tearless.envs.endpoint import Endpoint
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.rewards.judge import Judge
    from tearless.rollout.hf import HFRollout
    from tearless.tasks.bootstrap import TaskSpec, default_cache_dir
    from tearless.trainers.records import ROLLOUTS_FILE, read_records
    from tearless.trainers.warmup import prepare_task

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--samples", type=int, default=4, help="answers sampled per prompt for judge rows")
    ap.add_argument("--judge-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--baseline", action="store_true", help="also GRPO on the exact-sum reward, same budget")
    ap.add_argument("--out", default="judge_rl.json")
    args = ap.parse_args()

    task = prepare_task(TaskSpec(), default_cache_dir(), log=print)
    result: dict = {"machine": platform.processor() or platform.machine(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        start = time.time()
        warm, tok = load_causal_lm(task.model_dir), load_tokenizer(task.model_dir)
        examples = {}
        for name, source, seed in (("train", task.train_file, 11), ("test", task.val_file, 12)):
            rows = examples[name] = judge_rows(warm, tok, load_rows(source), args.samples, seed)
            write_parquet(rows, root / f"judge_{name}.parquet")
            result[f"judge_{name}_rows"] = len(rows)
            result[f"judge_{name}_correct_share"] = sum(r["verdict"] for r in rows) / len(rows)
        result["judge_data_seconds"] = round(time.time() - start, 1)
        print({k: v for k, v in result.items() if k.startswith("judge_")}, flush=True)

        start = time.time()
        judge_run = root / "judge-sft"
        code = cli(
            [
                "sft",
                f"model.path={task.model_dir}",
                f"data.train_files={root / 'judge_train.parquet'}",
                f"data.val_files={root / 'judge_test.parquet'}",
                f"trainer.total_training_steps={args.judge_steps}",
                f"trainer.default_local_dir={judge_run}",
                "trainer.logger=[jsonl]",
                "trainer.num_threads=1",
            ]
        )
        if code != 0:
            raise SystemExit(f"tearless sft of the judge failed ({code})")
        judge_dir = judge_run / f"global_step_{args.judge_steps}" / "actor"
        result["judge_sft_seconds"] = round(time.time() - start, 1)

        judge_model = load_causal_lm(judge_dir)
        judge_model.requires_grad_(False)
        engine = HFRollout(judge_model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
        server = Endpoint(engine, tok)
        try:
            url = server.session_url(server.open_session(0, 1 << 40, {"do_sample": False}))
            probe = Judge(
                base_url=url,
                model="judge",
                prompt_template=TEMPLATE,
                score_range=[0, 1],
                max_tokens=4,
                max_concurrency=128,
            )
            result["judge_heldout"] = judge_accuracy(probe, examples["test"])
            print("judge held-out:", result["judge_heldout"], flush=True)
            result["warmup_true_acc"] = true_accuracy(Path(task.model_dir), task.val_file, root / "warm.json")
            result["runs"] = {}
            judged = [
                "reward_model.judge.enable=true",
                f"reward_model.judge.base_url={url}",
                "reward_model.judge.model=judge",
                f"reward_model.judge.prompt_template='{TEMPLATE}'",
                "reward_model.judge.score_range=[0,1]",
                "reward_model.judge.max_tokens=4",
                f"reward_model.judge.max_concurrency={args.prompts * args.n}",  # a step's samples at once
                "reward_model.rule_weight=0",
            ]
            modes = {"judge": judged, **({"exact-sum": []} if args.baseline else {})}
            for seed in args.seeds:
                for mode, extra in modes.items():
                    start = time.time()
                    run_dir = root / f"{mode}-{seed}"
                    records = grpo(task, run_dir, args, seed, *extra)
                    final = run_dir / f"global_step_{args.steps}" / "actor"
                    vals = [r for r in records if GREEDY in r]
                    run = {
                        "true_acc_after": true_accuracy(final, task.val_file, root / f"{mode}-{seed}.json"),
                        "run_val_acc_before": vals[0][GREEDY],
                        "run_val_acc_after": vals[-1][GREEDY],
                        "failures": sum(r.get("reward/failures", 0) for r in records),
                        "step_seconds": median(r["timing_s/step"] for r in records if "timing_s/step" in r),
                        "reward_seconds": median(
                            r["timing_s/reward"] for r in records if "timing_s/reward" in r
                        ),
                        "seconds": round(time.time() - start, 1),
                    }
                    if mode == "judge":
                        run.update(agreement(read_records(run_dir / ROLLOUTS_FILE), args.steps))
                    result["runs"][f"{mode}-{seed}"] = run
                    print(mode, seed, run, flush=True)
        finally:
            server.shutdown()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
