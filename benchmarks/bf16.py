"""CPU mixed precision (issue 23): bf16 autocast against float32, speed ratios and log-prob mismatch.

``python benchmarks/bf16.py time [--pairs 5]``: for hidden 256 / 512 / 1024 (a 2-layer Llama, MLP
3× hidden, 4,096-token vocabulary, one thread):

- the log-prob pass's fwd+bwd (``response_logprobs`` with entropy, packed: ``use_remove_padding``), 16
  rows, prompts 8-30 tokens, responses 32 tokens;
- 16 decode steps of the built-in engine's model in one autocast region: 64 rows, one new token each
  step against a KV cache prefilled to 96 positions (under ``torch.inference_mode``),

float32 and bf16 (``set_compute_dtype``: the same fp32 weights under ``torch.autocast``) alternated
in one process, pairs of one of each; prints the median (min-max) of fp32 ÷ bf16 per pair and the
median times, and ``uptime`` (the load).

``python benchmarks/bf16.py mismatch [--task-dir DIR]``: the rollout-vs-trainer mismatch
(``rollout_corr/*``, :func:`tearless.rollout.correction.rollout_correction`) of the embedded task's
warmed-up model: 16 prompts × 8 samples drawn by the built-in engine in one precision, their log-probs
recomputed by the trainer's pass (``response_logprobs``, shared prompts) in another, for each of the
four (rollout, trainer) pairs of {fp32, bf16}.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import time

import torch

from tearless.models.compat import cache_kwargs
from tearless.models.logprobs import response_logprobs
from tearless.models.precision import autocast, cpu_has_native_bf16, set_compute_dtype

HIDDEN = (256, 512, 1024)
VOCAB = 4096


def tiny(hidden: int, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
        tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(rows: int, prompt_range: tuple[int, int], response: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(*prompt_range, (rows,), generator=g)
    width = int(plens.max())
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, p in enumerate(plens.tolist()):
        prompt_ids[i, width - p :] = torch.randint(1, VOCAB, (p,), generator=g)
        prompt_mask[i, width - p :] = 1
    response_ids = torch.randint(1, VOCAB, (rows, response), generator=g)
    return prompt_ids, prompt_mask, response_ids, torch.ones(rows, response, dtype=torch.long)


def logprob_step(model, data) -> float:
    start = time.perf_counter()
    lp, ent = response_logprobs(model, *data, with_entropy="grad", remove_padding=True)
    ((lp + 0.01 * ent) * data[3]).sum().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def decode_setup(model, rows: int = 64, context: int = 96):
    """A KV cache of ``context`` positions for ``rows`` rows (prefilled once) and one new token."""
    from transformers import DynamicCache

    ids = torch.randint(1, VOCAB, (rows, context), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode(), autocast("cpu", getattr(model, "tearless_compute_dtype", None)):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, logits_to_keep=1, **cache_kwargs(model, cache))
    return cache, ids[:, -1:], torch.full((rows, 1), context)


def decode_step(model, state, tokens: int = 16) -> float:
    """``tokens`` decode steps in one autocast region (as the engine's generate runs them), then the
    cache cropped back to its prefilled length."""
    cache, token, position = state
    dtype = getattr(model, "tearless_compute_dtype", None)
    start = time.perf_counter()
    with torch.inference_mode(), autocast("cpu", dtype):
        for t in range(tokens):
            model(input_ids=token, position_ids=position + t, **cache_kwargs(model, cache))
        cache.crop(-tokens)
    return time.perf_counter() - start


def time_ab(pairs: int) -> None:
    torch.set_num_threads(1)
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    threads = torch.get_num_threads()
    print(f"native bf16: {cpu_has_native_bf16()} | torch {torch.__version__} | threads {threads}")
    for hidden in HIDDEN:
        fp32 = tiny(hidden)
        bf16 = set_compute_dtype(copy.deepcopy(fp32), torch.bfloat16)
        data = batch(16, (8, 31), 32)
        states = {id(m): decode_setup(m) for m in (fp32, bf16)}
        cases = (
            ("log-prob fwd+bwd", logprob_step, {id(fp32): data, id(bf16): data}),
            ("16 decode steps", decode_step, states),
        )
        for name, run, args in cases:
            run(fp32, args[id(fp32)]), run(bf16, args[id(bf16)])  # warm-up
            t32, t16 = [], []
            for i in range(pairs):
                order = (fp32, bf16) if i % 2 == 0 else (bf16, fp32)
                for model in order:
                    (t32 if model is fp32 else t16).append(run(model, args[id(model)]))
            ratios = [a / b for a, b in zip(t32, t16, strict=True)]
            print(
                f"hidden {hidden:4d} {name:16s} fp32 {statistics.median(t32) * 1e3:8.1f} ms  "
                f"bf16 {statistics.median(t16) * 1e3:8.1f} ms  fp32/bf16 {statistics.median(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f})",
                flush=True,
            )


def mismatch(task_dir: str | None) -> None:
    import pyarrow.parquet as pq

    from tearless.data.prompts import render_prompt
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.rollout.correction import rollout_correction
    from tearless.rollout.hf import HFRollout
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    torch.set_num_threads(1)
    print("native bf16:", cpu_has_native_bf16())
    files = prepare_task(TaskSpec(), task_dir)  # the default run's task (cached)
    model = load_causal_lm(files.model_dir)
    tok = load_tokenizer(files.model_dir)
    rows = pq.read_table(files.val_file).to_pylist()[:16]
    prompts = [render_prompt(tok, row["prompt"]) for row in rows]
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for rollout_name, rollout_dtype in dtypes.items():
        engine = HFRollout(
            model,
            eos_token_ids=[tok.eos_token_id],
            pad_token_id=tok.pad_token_id,
            compute_dtype=rollout_dtype,
        )
        out = engine.generate(prompts, n=8, max_new_tokens=16, keys=list(range(len(prompts))))
        for trainer_name, trainer_dtype in dtypes.items():
            set_compute_dtype(model, trainer_dtype)
            with torch.inference_mode():
                lp, _ = response_logprobs(
                    model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask
                )
            set_compute_dtype(model, torch.float32)
            _, m = rollout_correction(lp, out.log_probs, out.response_mask)
            print(
                f"rollout {rollout_name} trainer {trainer_name}: "
                + "  ".join(f"{k.split('/')[1]} {v:.2e}" for k, v in m.items()),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("time", "mismatch"))
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--task-dir", default=None)
    args = parser.parse_args()
    if args.what == "time":
        time_ab(args.pairs)
    else:
        mismatch(args.task_dir)


if __name__ == "__main__":
    main()
