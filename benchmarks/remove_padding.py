"""Padding-free forwards and chunked vocabulary (issue 23): time ratios and peak memory.

``python benchmarks/remove_padding.py time``: fwd+bwd of the actor's log-prob pass (the update's
forward) on one micro-batch of 64 rows, padded (``share_prompt_forward=false``, the plain pass) against
packed (``use_remove_padding``), interleaved A/B pairs; prompts of 8-30 tokens, responses of uniform
random length in [1, R] with random tokens (samples that diverge: nothing to share), for R = 16, 64,
256 and hidden 128 / 512. Prints the median and min/max of padded ÷ packed per pair, and ``uptime``.

``python benchmarks/remove_padding.py memory``: peak resident memory of one fwd+bwd of the packed
log-prob pass with and without ``use_fused_kernels`` (and the padded pass) on a tiny Llama with a
151,936-token vocabulary (Qwen's), 2 rows × 1,024-token responses, each in a fresh process
(``ru_maxrss`` minus the resident size before the pass).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from tearless.models.logprobs import response_logprobs


def tiny(vocab, hidden, layers=2, positions=2048):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=positions,
        tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(rows, vocab, prompt_range, response_max, seed=0, fixed=False):
    g = torch.Generator().manual_seed(seed)
    plens = torch.randint(*prompt_range, (rows,), generator=g)
    rlens = (
        torch.full((rows,), response_max)
        if fixed
        else torch.randint(1, response_max + 1, (rows,), generator=g)
    )
    width = int(plens.max())
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    response_ids = torch.zeros(rows, response_max, dtype=torch.long)
    response_mask = torch.zeros(rows, response_max, dtype=torch.long)
    for i in range(rows):
        p, r = int(plens[i]), int(rlens[i])
        prompt_ids[i, width - p :] = torch.randint(1, vocab, (p,), generator=g)
        prompt_mask[i, width - p :] = 1
        response_ids[i, :r] = torch.randint(1, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


def step(model, data, **kw):
    lp, ent = response_logprobs(model, *data, with_entropy="grad", share_prompts=False, **kw)
    ((lp + 0.01 * ent) * data[3]).sum().backward()
    model.zero_grad(set_to_none=True)


def time_ab(pairs=3):
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    for hidden in (128, 512):
        model = tiny(512, hidden)
        for r in (16, 64, 256):
            data = batch(64, 512, (8, 31), r)
            step(model, data)
            step(model, data, remove_padding=True)
            ratios = []
            for _ in range(pairs):
                t0 = time.perf_counter()
                step(model, data)
                t1 = time.perf_counter()
                step(model, data, remove_padding=True)
                t2 = time.perf_counter()
                ratios.append((t1 - t0) / (t2 - t1))
            tokens = int(data[1].sum() + data[3].sum())
            padded = data[1].shape[0] * (data[1].shape[1] + data[3].shape[1])
            print(
                f"hidden {hidden} R {r}: padded/packed median {statistics.median(ratios):.2f} "
                f"(min {min(ratios):.2f}, max {max(ratios):.2f}); valid tokens {tokens} of {padded} padded"
            )
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


def memory_one(variant):
    model = tiny(151936, 64, layers=2)
    data = batch(2, 151936, (16, 17), 1024, fixed=True)
    kw = {
        "padded": {},
        "packed": dict(remove_padding=True),
        "fused": dict(remove_padding=True, fused_kernels=True),
    }
    before = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    step(model, data, **kw[variant])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"variant": variant, "peak_over_start_mib": (peak - before) / 2**20}))


def memory():
    tokens, vocab = 2 * 1024, 151936
    print(
        f"{tokens} response tokens x {vocab} vocab: "
        f"one float32 logits tensor = {tokens * vocab * 4 / 2**20:.0f} MiB"
    )
    for variant in ("padded", "packed", "fused"):
        out = subprocess.run(
            [sys.executable, __file__, "memory-one", variant], capture_output=True, text=True, check=True
        )
        print(out.stdout.strip())


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    what = sys.argv[1] if len(sys.argv) > 1 else "time"
    if what == "memory-one":
        memory_one(sys.argv[2])
    elif what == "memory":
        memory()
    else:
        time_ab()
