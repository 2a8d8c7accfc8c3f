"""Rollout throughput, vLLM vs the built-in engine, on the same model and prompts, alternated.

    python benchmarks/vllm_rollout.py                      # the embedded task's tiny model
    python benchmarks/vllm_rollout.py --model DIR          # any save_pretrained directory

Each round generates the same batch (``--prompts`` prompts × ``--n`` samples, at most ``--tokens``
new tokens, temperature 1, the same sampling keys) with the built-in engine (``HFRollout``) and with
vLLM (``VLLMRollout``, float32 on CPU), in alternating order; the report gives each engine's median
response tokens per second and the per-round ratio. Needs vLLM (CI's vLLM virtualenv,
``constraints-vllm.txt``); run with ``PYTHONPATH=.`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

import torch

from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.rollout.hf import HFRollout
from tearless.rollout.seeds import prompt_keys
from tearless.rollout.vllm import VLLMRollout


def prompts_for(tok, count: int) -> list[list[int]]:
    """``count`` arithmetic prompts, chat-formatted when the tokenizer has a template."""
    texts = [f"What is {17 * i % 89} + {31 * i % 97}? Answer with the number." for i in range(count)]
    if getattr(tok, "chat_template", None):
        return [
            list(
                tok.apply_chat_template(
                    [{"role": "user", "content": t}],
                    add_generation_prompt=True,
                    tokenize=True,
                    return_dict=False,
                )
            )
            for t in texts
        ]
    return [tok(f"{17 * i % 89}+{31 * i % 97}=")["input_ids"] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="save_pretrained directory (default: the embedded task's model)")
    parser.add_argument("--task-cache", help="where the embedded task is cached (default: tearless's)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the per-round figures here as JSON")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from tearless.tasks.bootstrap import TaskSpec
        from tearless.trainers.warmup import prepare_task

        model_dir = str(prepare_task(TaskSpec(), args.task_cache, log=print).model_dir)
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, dtype="float32")
    model.requires_grad_(False)
    eos = sorted(
        {tok.eos_token_id, *([model.generation_config.eos_token_id] if model.generation_config else [])}
        - {None}
    )
    builtin = HFRollout(model, eos_token_ids=eos, pad_token_id=tok.pad_token_id)
    cfg = SimpleNamespace(
        gpu_memory_utilization=0.3,
        tensor_model_parallel_size=1,
        free_cache_engine=False,
        weight_sync_timeout_s=600.0,
    )
    prompts = prompts_for(tok, args.prompts)
    context = max(map(len, prompts)) + args.tokens
    vllm = VLLMRollout(
        model_dir,
        cfg,
        dtype="float32",
        eos_token_ids=eos,
        pad_token_id=tok.pad_token_id,
        seed=0,
        device="cpu",
        kv_tokens=len(prompts) * args.n * context,
    )
    engines = {"builtin": builtin, "vllm": vllm}
    rounds = []
    for r in range(args.rounds):
        keys = prompt_keys(0, r, 0, len(prompts))
        order = ["builtin", "vllm"] if r % 2 == 0 else ["vllm", "builtin"]
        row = {}
        for name in order:
            start = time.perf_counter()
            out = engines[name].generate(prompts, n=args.n, max_new_tokens=args.tokens, keys=keys)
            seconds = time.perf_counter() - start
            tokens = int(out.response_mask.sum())
            row[name] = {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}
        row["ratio"] = row["vllm"]["tokens_per_s"] / row["builtin"]["tokens_per_s"]
        rounds.append(row)
        print(json.dumps({"round": r, **row}))
    for name in engines:
        median = statistics.median(x[name]["tokens_per_s"] for x in rounds)
        print(f"{name}: median {median:.0f} response tokens/s")
    print(f"vllm / builtin: median ratio {statistics.median(x['ratio'] for x in rounds):.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "threads": torch.get_num_threads(), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
