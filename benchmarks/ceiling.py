"""How close tearless gets to this machine's limit, and where a step's time goes.

For one case (``--case small|medium``, the models and batches of ``vs_trl.py``):

- rollout: tearless's sampler (``HFRollout.generate``) against a minimal hand-written KV-cache
  decode loop over the same model and batch (prefill the padded batch, then one forward per token
  for every row, multinomial sampling, nothing else), run for as many tokens as tearless's longest
  response. Throughput is tokens of real responses per second for tearless, and rows × steps per
  second for the bare loop (every row it decodes counts), so dropping finished rows can only help
  tearless if the saved work outweighs its bookkeeping.
- update: the trainer's actor update (``update_policy`` of its in-process worker group, the route of a
  training step) on the rollout against a bare step on the same padded tokens:
  one forward (logits at response positions), the policy-gradient loss
  :math:`-\\sum_t m_t A_t \\log\\pi(y_t)/\\sum_t m_t`, backward, gradient clip and AdamW; and
  the same update with its prompt sharing off and padding removed (``share_prompt_forward=false,
  use_remove_padding=true``), which forwards every valid token once and nothing else: the bare
  step's work less its padding (the fraction on equal work).
- log-probs (the π_old and reference passes): the group's ``compute_log_prob`` against one no-grad
  forward of the same padded tokens with the log-softmax at the response positions.
- orchestration: ``RLTrainer.train_step`` over ``--steps`` steps (the first left out), split into
  the trainer's own phase timers; the share outside rollout and update, and outside every model pass
  and the reward scoring.

``--case`` takes ``small``, ``medium``, ``smollm2-L{length}`` (the real model) or a
``diverge-L{length}-H{hidden}-C{completions}`` case of
``cases.py`` (the TRL grid's points); ``--dtype bfloat16`` runs every pass of both sides under CPU
autocast (the model marked with ``set_compute_dtype``, the engine's ``compute_dtype``, the bare loops
inside ``torch.autocast``), float32 weights and AdamW on both; ``--kernels-only`` skips the training
steps.

With ``--lora-memory``: peak RSS of ``--steps`` medium steps with full fine-tuning (and its second
model copy for the reference) against LoRA (rank 16, reference = adapters off), each in a fresh
process; ``--micro`` splits every pass into micro-batches of that many responses.

    OMP_NUM_THREADS=1 python benchmarks/ceiling.py --case small --repeats 5 --steps 6
    OMP_NUM_THREADS=1 python benchmarks/ceiling.py --case medium --repeats 3 --steps 3
    OMP_NUM_THREADS=1 python benchmarks/ceiling.py --case diverge-L256-H256-C64 --repeats 3 --kernels-only
    OMP_NUM_THREADS=1 python benchmarks/ceiling.py --lora-memory --steps 2
    OMP_NUM_THREADS=1 python benchmarks/ceiling.py --lora-memory --steps 1 --micro 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tensordict import TensorDict

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import Case, load_prompts, make_case
from vs_trl import actor_workers, tearless_overrides

from tearless.models.precision import autocast, cpu_has_native_bf16, set_compute_dtype


@torch.inference_mode()
def bare_decode(model, ids: torch.Tensor, attn: torch.Tensor, steps: int, generator: torch.Generator) -> int:
    """The practical ceiling of decoding: prefill, then ``steps`` one-token forwards of the whole batch."""
    from transformers import DynamicCache

    from tearless.models.compat import cache_kwargs

    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=1,
                **cache_kwargs(model, cache))  # fmt: skip
    pos = positions[:, -1:]
    for _ in range(steps - 1):
        tok = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1, generator=generator)
        attn = torch.cat([attn, torch.ones_like(tok)], dim=1)
        pos = pos + 1
        out = model(input_ids=tok, attention_mask=attn, position_ids=pos, **cache_kwargs(model, cache))
    torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1, generator=generator)
    return ids.shape[0] * steps


def bare_log_probs(model, td: TensorDict, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, R) log-probs of ``td``'s responses from one forward of its padded tokens (logits at the
    response positions only, upcast to float32 before the log-softmax), under CPU autocast to ``dtype``
    (None: float32)."""
    from tearless.algos import logprobs_from_logits

    ids = torch.cat([td["prompt_ids"], td["response_ids"]], 1)
    attn = torch.cat([td["prompt_mask"], td["response_mask"]], 1)
    width = td["response_ids"].shape[1]
    with autocast("cpu", dtype):
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                       logits_to_keep=width + 1).logits[:, :-1].float()  # fmt: skip
    return logprobs_from_logits(logits, td["response_ids"])


def bare_update(model, optimizer, td: TensorDict, dtype: torch.dtype | None = None) -> None:
    """Forward, policy-gradient loss, backward, clip and AdamW on ``td``'s padded tokens."""
    mask = td["response_mask"]
    loss = -(bare_log_probs(model, td, dtype) * td["advantages"] * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def measure_kernels(case: Case, repeats: int, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.rollout.hf import HFRollout, left_pad
    from tearless.rollout.seeds import prompt_keys

    tok = load_tokenizer(case.model_dir)
    model = set_compute_dtype(load_causal_lm(case.model_dir), dtype)
    prompts = [r["input_ids"] for r in load_prompts(case, tok)[: case.prompts_per_step]]
    rollout = HFRollout(
        model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, compute_dtype=dtype
    )
    # The trainer's update route (its worker group over `model`), each with its own AdamW on `model`.
    actor = actor_workers(case, model, seed=seed)
    # Every valid token forwarded once, nothing shared and no padding: the bare step's work less its padding.
    equal = actor_workers(
        case,
        model,
        "actor_rollout_ref.model.share_prompt_forward=false",
        "actor_rollout_ref.model.use_remove_padding=true",
        seed=seed,
    )
    bare_opt = torch.optim.AdamW(model.parameters(), lr=case.lr, weight_decay=0.01)
    ours_gen, bare_gen, ours_upd, bare_upd, equal_upd, padding = [], [], [], [], [], []
    ours_lp, bare_lp = [], []
    seconds: dict[str, list[float]] = {"rollout": [], "bare_decode": [], "update": [], "bare_update": []}
    for r in range(repeats + 1):  # the first repeat warms up and is dropped
        gen = torch.Generator().manual_seed(seed + r)
        start = time.perf_counter()
        keys = prompt_keys(seed + r, 0, 0, len(prompts))
        out = rollout.generate(prompts, n=case.n, max_new_tokens=case.max_new_tokens, keys=keys)
        t_ours = time.perf_counter() - start
        useful = int(out.response_mask.sum())
        ids, attn = left_pad([p for p in prompts for _ in range(case.n)], tok.pad_token_id)
        start = time.perf_counter()
        with autocast("cpu", dtype):
            bare_tokens = bare_decode(model, ids, attn, out.response_ids.shape[1], gen)
        t_bare = time.perf_counter() - start
        mask = out.response_mask
        adv = torch.randn(mask.shape[0], 1, generator=gen).expand_as(mask) * mask
        td = TensorDict(
            {"prompt_ids": out.prompt_ids, "prompt_mask": out.prompt_mask, "response_ids": out.response_ids,
             "response_mask": mask, "advantages": adv,
             "uid_index": torch.arange(len(prompts)).repeat_interleave(case.n)},  # a prompt's n rows adjacent
            batch_size=[mask.shape[0]],
        )  # fmt: skip
        tokens = td["prompt_ids"].numel() + td["response_ids"].numel()
        start = time.perf_counter()
        actor.compute_log_prob("actor", td)
        t_lp = time.perf_counter() - start
        start = time.perf_counter()
        with torch.no_grad():  # the ceiling of a log-prob pass (π_old, the reference)
            bare_log_probs(model, td, dtype)
        t_bare_lp = time.perf_counter() - start
        start = time.perf_counter()
        actor.update_policy(td)
        t_upd = time.perf_counter() - start
        start = time.perf_counter()
        bare_update(model, bare_opt, td, dtype)
        t_bare_upd = time.perf_counter() - start
        start = time.perf_counter()
        equal.update_policy(td)
        t_equal = time.perf_counter() - start
        if r > 0:
            ours_gen.append(useful / t_ours)
            bare_gen.append(bare_tokens / t_bare)
            ours_upd.append(tokens / t_upd)
            bare_upd.append(tokens / t_bare_upd)
            equal_upd.append(tokens / t_equal)
            ours_lp.append(tokens / t_lp)
            bare_lp.append(tokens / t_bare_lp)
            padding.append(1 - (int(td["prompt_mask"].sum()) + useful) / tokens)
            for key, t in zip(seconds, (t_ours, t_bare, t_upd, t_bare_upd), strict=True):
                seconds[key].append(t)
        print(
            f"repeat {r}: rollout {useful / t_ours:.0f} tok/s vs bare {bare_tokens / t_bare:.0f}; "
            f"update {tokens / t_upd:.0f} tok/s, without sharing {tokens / t_equal:.0f}, "
            f"vs bare {tokens / t_bare_upd:.0f} (padded tokens per second; {t_upd:.2f} / {t_equal:.2f} / "
            f"{t_bare_upd:.2f} s); log-probs {tokens / t_lp:.0f} tok/s vs bare {tokens / t_bare_lp:.0f}",
            flush=True,
        )
    med = statistics.median
    return {
        "rollout_tok_s": med(ours_gen),
        "bare_decode_tok_s": med(bare_gen),
        "rollout_fraction_of_ceiling": med(o / b for o, b in zip(ours_gen, bare_gen, strict=True)),
        "update_tok_s": med(ours_upd),
        "bare_update_tok_s": med(bare_upd),
        "update_fraction_of_bare": med(o / b for o, b in zip(ours_upd, bare_upd, strict=True)),
        "update_unshared_tok_s": med(equal_upd),
        "update_unshared_fraction_of_bare": med(o / b for o, b in zip(equal_upd, bare_upd, strict=True)),
        "padding_share_of_bare_tokens": med(padding),
        "log_prob_tok_s": med(ours_lp),
        "bare_log_prob_tok_s": med(bare_lp),
        "log_prob_fraction_of_bare": med(o / b for o, b in zip(ours_lp, bare_lp, strict=True)),
        "median_s": {k: med(v) for k, v in seconds.items()},
    }


def measure_steps(
    case: Case, steps: int, seed: int, threads: int, lora_rank: int = 0, micro: int | None = None
) -> dict:
    from tearless.config import load_config
    from tearless.trainers.rl import RLTrainer

    with tempfile.TemporaryDirectory() as tmp:
        overrides = tearless_overrides(case, tmp, steps, seed, threads)
        if lora_rank:
            overrides += [f"actor_rollout_ref.model.lora_rank={lora_rank}",
                          f"actor_rollout_ref.model.lora_alpha={2 * lora_rank}"]  # fmt: skip
        if micro:
            overrides += [f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
                          f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
                          f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}"]  # fmt: skip
        trainer = RLTrainer(load_config(None, overrides), log=lambda _: None)
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        rss_loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        phases, rss = [], []
        try:
            for step in range(1, steps + 1):
                metrics = trainer.train_step(step)
                phases.append(
                    {k[len("timing_s/") :]: v for k, v in metrics.items() if k.startswith("timing_s/")}
                )
                rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        finally:
            trainer.workers.close()
    steady = phases[1:] or phases
    model_passes = ("gen", "update_actor", "ref", "old_log_prob")

    def share(names) -> float:
        return statistics.median(1 - sum(p.get(n, 0.0) for n in names) / p["step"] for p in steady)

    return {
        "step_s": statistics.median(p["step"] for p in steady),
        "phases_median_s": {k: statistics.median(p.get(k, 0.0) for p in steady) for k in steady[0]},
        "share_outside_rollout_and_update": share(("gen", "update_actor")),
        "share_outside_model_passes_and_reward": share((*model_passes, "reward")),
        "peak_rss_mb_after_load": rss_loaded,
        "peak_rss_mb_per_step": rss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--case", default="small", help="small, medium, smollm2-L<length> or diverge-L<length>-H<hidden>-C<n>"
    )
    ap.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="compute dtype, both sides"
    )
    ap.add_argument("--kernels-only", action="store_true", help="rollout and update only, no training steps")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lora-memory", action="store_true")
    ap.add_argument("--micro", type=int, default=None, help="responses per micro-batch (memory runs)")
    ap.add_argument("--lora-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--steps-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.steps_only:
        case = make_case(args.case)
        result = measure_steps(case, args.steps, args.seed, args.threads, args.lora_rank, args.micro)
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.lora_memory:
        make_case("medium")
        report = {}
        for rank in (0, 16):
            cmd = [sys.executable, __file__, "--steps-only", "--case", "medium", "--steps", str(args.steps),
                   "--threads", str(args.threads), "--lora-rank", str(rank)]  # fmt: skip
            cmd += ["--micro", str(args.micro)] if args.micro else []
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ})
            if proc.returncode:
                sys.exit(proc.stderr[-4000:])
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
            report["full" if rank == 0 else f"lora_r{rank}"] = json.loads(line[len("RESULT ") :])
            print(json.dumps(report, indent=1), flush=True)
        return
    try:
        case = make_case(args.case)
    except ValueError as e:
        sys.exit(f"--case: {e}")
    dtype = getattr(torch, args.dtype)
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        sys.exit("--dtype bfloat16: this CPU has neither AVX-512 BF16 nor AMX; bf16 would be emulated")
    load = os.getloadavg()[0]
    report = {"case": args.case, "dtype": args.dtype, "threads": args.threads, "load_before": load}
    report.update(measure_kernels(case, args.repeats, args.seed, dtype))
    if not args.kernels_only:
        report.update(measure_steps(case, args.steps, args.seed, args.threads))
    report["load_after"] = os.getloadavg()[0]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
