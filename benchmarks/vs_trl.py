"""tearless against TRL's ``GRPOTrainer``, side by side: seconds per step and held-out accuracy.

Both frameworks get the same model files, prompts (in file order, no shuffling), reward function,
hyper-parameters, seed and torch thread count; each run is a fresh process, and the frameworks
alternate (tearless, TRL, tearless, TRL, …) so that a change in the machine's load hits both.
Every run trains ``--steps`` GRPO steps from the same starting model; its first step is a warm-up
and is left out of the timings. Accuracy is measured afterwards by one shared routine (tearless's
greedy decode loop and the task's scorer) on the first ``--eval-prompts`` held-out prompts.

    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --case small --steps 6 --rounds 3
    OMP_NUM_THREADS=1 python benchmarks/vs_trl.py --case medium --steps 3 --rounds 2

``--case`` also takes the diverging cases of ``cases.py`` (``diverge-L64-H256-C64``, …);
``vs_trl_axes.py`` runs the grid of them. Each run also reports its own rollouts' mean response
length and mean reward per step (tearless: ``response_length/mean`` and ``critic/score/mean``; TRL:
``completions/mean_length`` and ``reward`` of its log), and ``--eval-prompts 0`` skips the held-out
evaluation.

Settings shared by both (see BENCHMARKS.md for the mapping of every key): GRPO advantages
normalised by the group's std, token-mean loss (TRL ``loss_type="dapo"``), clip ε = 0.2, one
iteration per generation (on-policy: no old-log-prob pass in either), AdamW (β 0.9/0.999, weight
decay 0.01), constant lr, gradient-norm clip 1.0, the case's temperature (1, or 0.7 for the real
model), no top-k/top-p, float32, no
gradient checkpointing; the KL term (medium only) is k3 against the starting model, β = 0.04.
``--trl-bf16`` runs TRL with ``bf16=True`` (CPU autocast over float32 weights, TRL's default); with
``--tearless-set actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16`` both compute in bf16.
``--tearless-python`` and ``--trl-python`` run each framework's processes with another interpreter
(a virtualenv with vLLM for tearless's vLLM engine, one with TRL), e.g. on the real model::

    python benchmarks/vs_trl.py --case smollm2-L64 --steps 4 --rounds 3 --eval-prompts 0 \
        --trl-python /work/venvs/trl/bin/python --tearless-python /work/venvs/vllm/bin/python \
        --tearless-set actor_rollout_ref.rollout.name=vllm
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import Case, load_prompts, make_case


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: ``VmHWM`` where Linux has it, because
    ``ru_maxrss`` survives ``exec`` and would report the parent's peak at the fork when larger."""
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def score(case: Case, text: str, row: dict) -> dict:
    from tearless.rewards import compute_score

    out = compute_score(case.data_source, text, row["reward_model"]["ground_truth"], row["extra_info"])
    return out if isinstance(out, dict) else {"score": float(out), "acc": float(out >= 1.0)}


def evaluate(case: Case, model: torch.nn.Module, tokenizer, num: int) -> dict[str, float]:
    """Greedy held-out accuracy and mean score of ``model`` on the case's first ``num`` test prompts."""
    from tearless.rollout.hf import HFRollout

    rows = load_prompts(case, tokenizer, split="test")[:num]
    rollout = HFRollout(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    prompts = [r["input_ids"] for r in rows]
    out = rollout.generate(prompts, max_new_tokens=case.max_new_tokens, do_sample=False)
    texts = [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(out.response_ids, out.response_mask, strict=True)
    ]
    results = [score(case, t, r) for t, r in zip(texts, rows, strict=True)]
    return {
        "acc": sum(r["acc"] for r in results) / len(results),
        "score": sum(r["score"] for r in results) / len(results),
    }


def tearless_overrides(case: Case, run_dir: str, steps: int, seed: int, threads: int) -> list[str]:
    kl = case.beta > 0
    return [
        f"actor_rollout_ref.model.path={case.model_dir}",
        f"data.train_files={case.train_file}",
        f"data.val_files={case.val_file}",
        f"trainer.default_local_dir={run_dir}",
        f"data.train_batch_size={case.prompts_per_step}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={case.prompts_per_step}",
        f"actor_rollout_ref.rollout.n={case.n}",
        f"data.max_response_length={case.max_new_tokens}",
        f"actor_rollout_ref.rollout.temperature={case.temperature}",
        f"actor_rollout_ref.actor.optim.lr={case.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.01",
        "actor_rollout_ref.actor.grad_clip=1.0",
        "actor_rollout_ref.actor.clip_ratio=0.2",
        "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.actor.use_kl_loss={str(kl).lower()}",
        f"actor_rollout_ref.actor.kl_loss_coef={case.beta}",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "data.shuffle=false",
        "reward_model.num_workers=0",
        "trainer.num_rollout_samples=0",
        "trainer.logger=[jsonl]",
        f"trainer.total_training_steps={steps}",
        f"trainer.seed={seed}",
        f"trainer.num_threads={threads}",
    ]


def actor_workers(case: Case, model: torch.nn.Module, *extra: str, seed: int = 0):
    """The trainer's in-process worker group (``make_workers``) whose actor is ``model`` as it is in
    memory, configured by :func:`tearless_overrides` (no KL loss: the benchmarks' batches carry no
    reference log-probs) and ``extra``: updates and forwards take the training step's route."""
    from tearless.config import load_config
    from tearless.models.loading import load_tokenizer
    from tearless.workers.placement import make_workers
    from tearless.workers.spec import RankSpec

    overrides = [
        "actor_rollout_ref.actor.use_kl_loss=false",
        # Building the group leaves the process as the benchmark set it: its torch threads (0: as
        # they are) and glibc's default malloc (keep_freed_memory is process-wide and permanent).
        "trainer.keep_freed_memory=false",
    ]
    with tempfile.TemporaryDirectory() as tmp:  # the run directory: nothing is written there
        cfg = load_config(None, [*tearless_overrides(case, tmp, 1, seed, 0), *overrides, *extra])
    spec = RankSpec(cfg, ("actor",), False, case.model_dir, 10**6, "cpu", models={"actor": model})
    return make_workers(spec, load_tokenizer(case.model_dir).pad_token_id)


def run_tearless(
    case: Case, steps: int, seed: int, threads: int, eval_prompts: int, extra: Sequence[str] = ()
) -> dict:
    from tearless.config import load_config
    from tearless.trainers.rl import RLTrainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [*tearless_overrides(case, tmp, steps, seed, threads), *extra])
        precision: list[str] = []  # what param_dtype=auto resolved to (a pretrained model), in its line

        def log(line: str) -> None:
            if "param_dtype=auto" in line:
                precision.append(line)

        trainer = RLTrainer(cfg, log=log)
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        times, rss, phases, lengths, rewards = [], [], [], [], []
        try:
            for step in range(1, steps + 1):
                start = time.perf_counter()
                metrics = trainer.train_step(step)
                times.append(time.perf_counter() - start)
                rss.append(peak_rss_mb())
                phases.append({k: v for k, v in metrics.items() if k.startswith("timing_s/")})
                lengths.append(metrics["response_length/mean"])
                rewards.append(metrics["critic/score/mean"])
        finally:
            trainer.workers.close()  # the reward processes; the actor's model stays usable
        model = trainer.workers.rank.roles["actor"].model  # world size 1: LocalWorkers' one rank
        result = evaluate(case, model, trainer.tokenizer, eval_prompts) if eval_prompts else {}
    return {
        "step_s": times,
        "peak_rss_mb": rss,
        "phases": phases,
        "response_length": lengths,
        "reward": rewards,
        "precision": precision,
        **result,
    }


def run_trl(
    case: Case, steps: int, seed: int, threads: int, eval_prompts: int, bf16: bool = False, vllm: bool = False
) -> dict:
    """TRL's ``GRPOTrainer`` on ``case``; ``bf16``: its mixed precision on (accelerate's CPU autocast
    over float32 master weights, TRL's own default), else float32 throughout; ``vllm``: its colocated
    vLLM engine generates (``use_vllm=True, vllm_mode="colocate"``; needs vLLM in TRL's environment)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tearless.data import load_many
    from tearless.models.loading import load_tokenizer

    tokenizer = load_tokenizer(case.model_dir)
    rows = load_many(case.train_file)[: steps * case.prompts_per_step]
    dataset = Dataset.from_list(
        [
            {
                "prompt": r["prompt"],
                "ground_truth": r["reward_model"]["ground_truth"],
                "extra_info": json.dumps(r["extra_info"]),
            }
            for r in rows
        ]
    )

    def reward(prompts, completions, ground_truth, extra_info, **_):
        return [
            score(case, c[0]["content"], {"reward_model": {"ground_truth": g}, "extra_info": json.loads(e)})[
                "score"
            ]
            for c, g, e in zip(completions, ground_truth, extra_info, strict=True)
        ]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.rss: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.start)
            self.rss.append(peak_rss_mb())

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=case.prompts_per_step * case.n,
            gradient_accumulation_steps=1,
            num_generations=case.n,
            max_completion_length=case.max_new_tokens,
            temperature=case.temperature,
            top_p=1.0,
            top_k=0,
            learning_rate=case.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.01,
            adam_beta1=0.9,
            adam_beta2=0.999,
            max_grad_norm=1.0,
            beta=case.beta,
            loss_type="dapo",  # token-mean over the whole batch, as tearless's token-mean
            scale_rewards="group",
            epsilon=0.2,
            num_iterations=1,
            use_vllm=vllm,
            vllm_mode="colocate",
            gradient_checkpointing=False,
            bf16=bf16,
            fp16=False,
            use_cpu=True,
            max_steps=steps,
            shuffle_dataset=False,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            seed=seed,
            dataloader_num_workers=0,
            disable_dropout=True,
            model_init_kwargs={"dtype": "float32"},
        )
        torch.set_num_threads(threads)
        trainer = GRPOTrainer(
            model=case.model_dir,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        torch.set_num_threads(threads)
        trainer.train()
        result = evaluate(case, trainer.model, tokenizer, eval_prompts) if eval_prompts else {}
        logged = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    return {
        "step_s": timer.times,
        "peak_rss_mb": timer.rss,
        "response_length": [h["completions/mean_length"] for h in logged],
        "reward": [h["reward"] for h in logged],
        **result,
    }


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    case = make_case(args.case)
    common = (case, args.steps, args.seed, args.threads, args.eval_prompts)
    if args.worker == "tearless":
        result = run_tearless(*common, args.tearless_set)
    else:
        result = run_trl(*common, bf16=args.trl_bf16, vllm=args.trl_vllm)
    print("RESULT " + json.dumps(result), flush=True)


SET_HELP = "an extra tearless override (repeatable): a lever against the same TRL runs"
TRL_BF16_HELP = (
    "TRL with bf16=True (its own default: CPU autocast over float32 weights) instead of float32; pair with "
    "--tearless-set actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16 for equal precision"
)


def load_average() -> float:
    return os.getloadavg()[0]


def run_fresh(
    name: str,
    case: str,
    steps: int,
    threads: int,
    seed: int,
    eval_prompts: int,
    tearless_set: Sequence[str] = (),
    trl_bf16: bool = False,
    python: str = sys.executable,
    trl_vllm: bool = False,
) -> dict:
    """One run of framework ``name`` ("tearless" or "trl") on ``case`` in a fresh process, with the
    1-minute load average before and after it and the process's wall time; ``tearless_set``: extra
    ``key=value`` overrides for tearless (a lever to compare, e.g. ``…model.use_remove_padding=true``);
    ``trl_bf16``: TRL with ``bf16=True``; ``python``: the interpreter of the process."""
    load, start = load_average(), time.perf_counter()
    cmd = [python, __file__, "--worker", name, "--case", case]
    cmd += ["--steps", str(steps), "--threads", str(threads), "--seed", str(seed)]
    cmd += ["--eval-prompts", str(eval_prompts)]
    cmd += [f"--tearless-set={kv}" for kv in tearless_set if name == "tearless"]
    cmd += ["--trl-bf16"] if trl_bf16 and name == "trl" else []
    cmd += ["--trl-vllm"] if trl_vllm and name == "trl" else []
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} run on {case} failed:\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT ") :])
    return {
        **result,
        "load_before": load,
        "load_after": load_average(),
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--case", default="small", help="small, medium, diverge-L<length>-H<hidden>-C<n> or smollm2-L<length>"
    )
    ap.add_argument("--steps", type=int, default=6, help="GRPO steps per run (the first is a warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of tearless and TRL")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--seed-per-round",
        action="store_true",
        help="round r (from 0) runs both frameworks with seed + r: the held-out accuracies become one "
        "sample per seed instead of one number repeated",
    )
    ap.add_argument("--eval-prompts", type=int, default=100)
    ap.add_argument("--tearless-set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    ap.add_argument("--trl-bf16", action="store_true", help=TRL_BF16_HELP)
    ap.add_argument("--trl-vllm", action="store_true", help="TRL generates with its colocated vLLM engine")
    ap.add_argument("--tearless-python", default=sys.executable, help="interpreter of tearless's runs")
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter of TRL's runs")
    ap.add_argument("--worker", choices=["tearless", "trl"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    make_case(args.case)  # build the files once, outside the timed runs
    runs: dict[str, list[dict]] = {"tearless": [], "trl": []}
    for r in range(args.rounds):
        for name in ("tearless", "trl"):
            result = run_fresh(
                name,
                args.case,
                args.steps,
                args.threads,
                args.seed + r if args.seed_per_round else args.seed,
                args.eval_prompts,
                args.tearless_set,
                args.trl_bf16,
                args.tearless_python if name == "tearless" else args.trl_python,
                args.trl_vllm,
            )
            load = result["load_before"]
            runs[name].append(result)
            steady = result["step_s"][1:]
            each = ", ".join(f"{t:.2f}" for t in result["step_s"])
            held = ""
            if "acc" in result:
                held = f"held-out acc {result['acc']:.3f} score {result['score']:.3f}, "
            length = statistics.mean(result["response_length"])
            print(
                f"round {r + 1} {name:8s}: median {statistics.median(steady):.3f} s/step "
                f"(steps {each}), {held}mean response length {length:.1f}, "
                f"peak RSS {max(result['peak_rss_mb']):.0f} MiB, "
                f"load {load:.2f} -> {result['load_after']:.2f}",
                flush=True,
            )
    med = {k: statistics.median(t for run in v for t in run["step_s"][1:]) for k, v in runs.items()}
    report = {
        "case": args.case,
        "seeds": [args.seed + r if args.seed_per_round else args.seed for r in range(args.rounds)],
        "tearless_set": args.tearless_set,
        "trl_bf16": args.trl_bf16,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {args.threads} thread(s)",
        "median_s_per_step": med,
        "ratio_trl_over_tearless": med["trl"] / med["tearless"],
        # Each round's two runs ran back to back under about the same load: their ratio is the
        # fairer comparison when the load drifts between rounds.
        "ratio_per_round": [
            statistics.median(b["step_s"][1:]) / statistics.median(a["step_s"][1:])
            for a, b in zip(runs["tearless"], runs["trl"], strict=True)
        ],
        "held_out_acc": {k: [run.get("acc") for run in v] for k, v in runs.items()},
        "held_out_score": {k: [run.get("score") for run in v] for k, v in runs.items()},
        "mean_response_length": {
            k: [statistics.mean(run["response_length"]) for run in v] for k, v in runs.items()
        },
        "peak_rss_mb": {k: max(max(run["peak_rss_mb"]) for run in v) for k, v in runs.items()},
        # Where tearless's steady steps go (its phase timers), medians over every run's steps.
        "tearless_phase_s": {
            phase: statistics.median(
                p[phase] for run in runs["tearless"] for p in run["phases"][1:] if phase in p
            )
            for phase in runs["tearless"][0]["phases"][-1]
        },
        "load_average": [run["load_before"] for v in runs.values() for run in v],
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
