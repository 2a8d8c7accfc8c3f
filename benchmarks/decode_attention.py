"""The decode step's attention: float32 matmul attention over (B, H, capacity, D) float32 buffers
against ``scaled_dot_product_attention`` over the (B, capacity, H, D) buffers the engine had before.

``python benchmarks/decode_attention.py micro``: the attention op alone, one query per row against
T cached positions (hidden = heads × 64), float32 and bf16 caches, medians of 30 calls after 5.

``python benchmarks/decode_attention.py ab --old-sampler /tmp/hf_old.py --case diverge-L256-H256-C64
[--dtype bfloat16] [--pairs 4]``: whole rollouts of the case's first prompts (its n samples each, up
to its length cap), an older ``tearless/rollout/hf.py`` (e.g. ``git show 721bcd9:tearless/rollout/hf.py
> /tmp/hf_old.py``, transformers' sdpa and (B, capacity, H, D) buffers) on one copy of the model
against the current engine on another, alternated in one process; the median of the per-pair
ratios and the median seconds, and whether both drew the same tokens.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import load_prompts, make_case
from sharing_ab import load_module

from tearless.models.packing import decode_attention


def median_ms(fn, calls: int = 30) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


SHAPES = [(64, 79, 4), (64, 143, 4), (64, 270, 4), (256, 79, 4), (64, 79, 8), (64, 79, 16)]


def micro() -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    print("rows, positions, heads | sdpa, old layout: fp32 / bf16 cache | decode_attention | ms per call")
    for rows, length, heads in SHAPES:
        gen = torch.Generator().manual_seed(0)
        cap, dim = length + 16, 64
        q = torch.randn(rows, heads, 1, dim, generator=gen)
        mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
        mask[..., :3] = False  # left padding
        old = [torch.randn(rows, cap, heads, dim, generator=gen)[:, :length].transpose(1, 2) for _ in "kv"]
        old16 = [t.bfloat16() for t in old]
        new = [torch.randn(rows, heads, cap, dim, generator=gen)[:, :, :length] for _ in "kv"]
        t32 = median_ms(functools.partial(sdpa, q, *old, attn_mask=mask))
        t16 = median_ms(functools.partial(sdpa, q.bfloat16(), *old16, attn_mask=mask))
        tnew = median_ms(functools.partial(decode_attention, q, *new, mask))
        print(
            f"{rows:4d} {length:4d} {heads:3d} | {t32:6.2f} / {t16:6.2f} | {tnew:6.2f} | "
            f"{t32 / tnew:.2f}x / {t16 / tnew:.2f}x",
            flush=True,
        )


def ab(old_sampler: str, case_name: str, dtype: torch.dtype, pairs: int) -> None:
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.models.precision import cpu_has_native_bf16
    from tearless.rollout.hf import HFRollout
    from tearless.rollout.seeds import prompt_keys

    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        sys.exit("--dtype bfloat16 needs a CPU with AVX-512 BF16 or AMX")
    case = make_case(case_name)
    tok = load_tokenizer(case.model_dir)
    new_model = load_causal_lm(case.model_dir)
    old_model = copy.deepcopy(new_model)
    prompts = [r["input_ids"] for r in load_prompts(case, tok)[: case.prompts_per_step]]
    kw = {"eos_token_ids": [tok.eos_token_id], "pad_token_id": tok.pad_token_id, "compute_dtype": dtype}
    engines = {"old": load_module(old_sampler).HFRollout(old_model, **kw), "new": HFRollout(new_model, **kw)}
    assert old_model.config._attn_implementation == "sdpa", "the old engine must keep transformers' sdpa"
    times: dict[str, list[float]] = {"old": [], "new": []}
    same = []
    for i in range(pairs + 1):  # the first pair warms up
        outs = {}
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            start = time.perf_counter()
            outs[name] = engines[name].generate(
                prompts, n=case.n, max_new_tokens=case.max_new_tokens, keys=prompt_keys(1, i, 0, len(prompts))
            )
            if i:
                times[name].append(time.perf_counter() - start)
        same.append(torch.equal(outs["old"].response_ids, outs["new"].response_ids))
    ratios = [o / n for o, n in zip(times["old"], times["new"], strict=True)]
    print(
        f"{case_name} {str(dtype).removeprefix('torch.')}: old {statistics.median(times['old']):.3f} s, "
        f"new {statistics.median(times['new']):.3f} s, old/new {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}, {pairs} pairs); "
        f"same tokens in {sum(same)} of {len(same)} rollouts",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("micro", "ab"))
    ap.add_argument("--old-sampler", help="path of an older tearless/rollout/hf.py (ab)")
    ap.add_argument("--case", default="diverge-L256-H256-C64")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--pairs", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.what == "micro":
        micro()
    elif not args.old_sampler:
        sys.exit("ab needs --old-sampler PATH (an older tearless/rollout/hf.py)")
    else:
        ab(args.old_sampler, args.case, getattr(torch, args.dtype), args.pairs)


if __name__ == "__main__":
    main()
