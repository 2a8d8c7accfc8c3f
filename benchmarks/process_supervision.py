"""Outcome vs process supervision on the chain_addition task, same budget, several seeds.

Every run starts from the task's warm-up model and trains `--steps` GRPO steps of 16 prompts × 8
responses (a fresh `tearless train` process each):

- outcome: `algorithm.adv_estimator=grpo`, the verifier's outcome only (`step_weight=0`);
- process: `algorithm.adv_estimator=grpo_process` (DeepSeekMath's process supervision) on the
  verifier's step scores only (`outcome_weight=0`);
- process-prm (with `--prm`): the same, with the task's tiny trained PRM scoring the steps instead of
  the verifier (its probabilities, not 0/1 labels); process-prm+outcome adds the verifier's outcome
  as the reward of a final step (`outcome_weight=1`);
- process-implicit (with `--implicit`): the same, with an implicit PRM (PRIME): the warm-up model
  trained on outcome labels only (`implicit_prm`), its log-ratio to the warm-up model summed per step;
  process-implicit+outcome adds the outcome as a final step's reward, as PRIME combines them.

Afterwards the final checkpoint answers the 200 held-out prompts greedily; recorded: accuracy (the
last line's sum is right) and step validity (share of the expected steps that are present and valid,
each judged on its own), next to the warm-up model's.

    OMP_NUM_THREADS=1 python benchmarks/process_supervision.py --seeds 1 2 --steps 100 --prm --implicit
    (--only process-implicit runs one mode)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

from tearless.tasks.chain_addition import WARMUP_STEPS


@torch.no_grad()
def evaluate(model_dir: str, rows: list[dict]) -> dict[str, float]:
    """Greedy accuracy and step validity of the model in ``model_dir`` on ``rows``."""
    from tearless.data import render_prompt
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.rollout.hf import HFRollout
    from tearless.tasks import chain_addition

    model, tok = load_causal_lm(model_dir), load_tokenizer(model_dir)
    rollout = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    out = rollout.generate(
        [render_prompt(tok, r["prompt"]) for r in rows],
        max_new_tokens=chain_addition.RESPONSE_TOKENS,
        do_sample=False,
    )
    results = [
        chain_addition.compute_score(
            tok.decode(ids[m.bool()], skip_special_tokens=True),
            r["reward_model"]["ground_truth"],
            r["extra_info"],
        )
        for r, ids, m in zip(rows, out.response_ids, out.response_mask, strict=True)
    ]
    return {
        "accuracy": sum(r["acc"] for r in results) / len(results),
        "step_validity": sum(r["step_validity"] for r in results) / len(results),
    }


def main() -> None:
    from tearless.data import load_rows
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prm", action="store_true", help="also train with the task's tiny PRM")
    ap.add_argument("--implicit", action="store_true", help="also train with an implicit PRM (PRIME)")
    ap.add_argument("--only", nargs="*", help="modes to run (default: all selected)")
    ap.add_argument("--cache", help="task cache directory (default: $TEARLESS_CACHE or ~/.cache/tearless)")
    args = ap.parse_args()
    spec = TaskSpec(name="chain_addition", warmup_steps=WARMUP_STEPS)
    files = prepare_task(spec, args.cache)
    rows = load_rows(files.val_file)
    modes = {
        "outcome": ["algorithm.adv_estimator=grpo", "reward_model.step_reward.step_weight=0"],
        "process": ["algorithm.adv_estimator=grpo_process", "reward_model.step_reward.outcome_weight=0"],
    }
    report: dict = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"python {platform.python_version()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '2')}",
        "warmup_model": evaluate(files.model_dir, rows),
        "runs": {},
    }
    if args.prm:
        from tearless.trainers.step_prm import prepare_prm

        prm = prepare_prm(spec, files, args.cache)
        report["prm"] = prm.info
        modes["process-prm"] = [
            *modes["process"],
            "reward_model.step_reward.prm.enable=true",
            f"reward_model.step_reward.prm.path={prm.model_dir}",
        ]
        modes["process-prm+outcome"] = [*modes["process-prm"], "reward_model.step_reward.outcome_weight=1"]
    if args.implicit:
        from tearless.trainers.step_prm import prepare_implicit_prm

        implicit = prepare_implicit_prm(spec, files, args.cache)
        report["implicit_prm"] = implicit.info
        modes["process-implicit"] = [
            *modes["process"],
            "reward_model.step_reward.prm.enable=true",
            "reward_model.step_reward.prm.kind=implicit",
            f"reward_model.step_reward.prm.path={implicit.model_dir}",
            f"reward_model.step_reward.prm.ref_path={files.model_dir}",
            f"reward_model.step_reward.prm.beta={implicit.info['settings']['beta']}",
        ]
        modes["process-implicit+outcome"] = [
            *modes["process-implicit"],
            "reward_model.step_reward.outcome_weight=1",
        ]
    if args.only:
        modes = {name: extra for name, extra in modes.items() if name in args.only}
    print(f"warm-up model: {report['warmup_model']}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    if args.cache:
        env["TEARLESS_CACHE"] = args.cache
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in modes.items():
            for seed in args.seeds:
                run_dir = f"{tmp}/{name}-{seed}"
                command = [
                    "train",
                    "task.name=chain_addition",
                    f"task.warmup_steps={WARMUP_STEPS}",
                    "data.max_response_length=32",
                    "data.train_batch_size=16",
                    "actor_rollout_ref.rollout.n=8",
                    "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                    f"trainer.total_training_steps={args.steps}",
                    f"trainer.seed={seed}",
                    "trainer.val_before_train=false",
                    "trainer.logger=[jsonl]",
                    f"trainer.default_local_dir={run_dir}",
                    *extra,
                ]
                started = time.perf_counter()
                subprocess.run(
                    [sys.executable, "-m", "tearless.cli", *command], env=env, check=True, capture_output=True
                )
                result = {
                    **evaluate(f"{run_dir}/global_step_{args.steps}/actor", rows),
                    "seconds": round(time.perf_counter() - started, 1),
                }
                report["runs"][f"{name} seed {seed}"] = result
                print(f"{name} seed {seed}: {result}", flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
