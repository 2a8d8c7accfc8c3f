"""The rollout engine's decode loop against bare KV-cache loops, every sample its own row.

For each case (rows × new tokens on a randomly initialised Llama of the given hidden size; the
task tokenizer's vocabulary, prompts of 8–12 random tokens, left-padded) one process alternates:

- ``tearless``: ``HFRollout.generate`` with every sample its own row (the prompts repeated, ``n=1``:
  no row sharing, the case of samples that diverge) and no EOS (every row decodes every step, so
  both sides do the same work);
- ``bare-dynamic``: ``ceiling.py``'s bare loop (prefill, then one forward per token for every row,
  the stock concatenating ``DynamicCache``, multinomial sampling, nothing else);
- ``bare-static``: the same loop over transformers' ``StaticCache`` (preallocated keys and values).

It prints tokens/s (rows × tokens / s), medians over the repeats after a warm-up, and tearless's
fraction of each bare loop (the median of the per-repeat ratios).

    OMP_NUM_THREADS=1 python benchmarks/decode.py
    OMP_NUM_THREADS=1 python benchmarks/decode.py --cases 64x16 256x64 --hidden 256 512 --repeats 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ceiling import bare_decode


@torch.inference_mode()
def bare_static(model, ids: torch.Tensor, attn: torch.Tensor, steps: int, generator: torch.Generator) -> int:
    """``bare_decode`` over a preallocated ``StaticCache`` of prompt + ``steps`` positions."""
    from transformers import StaticCache

    from tearless.models.compat import cache_kwargs

    rows, width = ids.shape
    cache = StaticCache(config=model.config, max_cache_len=width + steps)
    full = torch.cat([attn, attn.new_ones((rows, steps))], dim=1)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=full[:, :width], position_ids=positions, logits_to_keep=1,
                **cache_kwargs(model, cache))  # fmt: skip
    pos = positions[:, -1:]
    for t in range(steps - 1):
        tok = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1, generator=generator)
        pos = pos + 1
        out = model(input_ids=tok, attention_mask=full[:, : width + t + 1], position_ids=pos,
                    **cache_kwargs(model, cache))  # fmt: skip
    torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1, generator=generator)
    return rows * steps


def make_model(hidden: int, tok):
    from tearless.tasks.bootstrap import tokenizer_llama

    layers = {256: 4, 512: 8, 1024: 8}.get(hidden, 4)
    return tokenizer_llama(tok, hidden_size=hidden, num_layers=layers, seed=1, max_position_embeddings=512)


def run_case(model, tok, rows: int, steps: int, repeats: int, seed: int) -> dict[str, float]:
    from tearless.rollout.hf import HFRollout, left_pad
    from tearless.rollout.seeds import prompt_keys

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 13, (rows,), generator=gen).tolist()
    special = 8  # the char tokenizer's specials and role tokens come first
    prompts = [torch.randint(special, len(tok), (n,), generator=gen).tolist() for n in lengths]
    ids, attn = left_pad(prompts, tok.pad_token_id)
    # No EOS: every row decodes every step on both sides.
    rollout = HFRollout(model, eos_token_ids=[], pad_token_id=tok.pad_token_id)

    def ours(r: int) -> int:
        out = rollout.generate(prompts, n=1, max_new_tokens=steps, keys=prompt_keys(seed, r, 0, rows))
        return int(out.response_mask.sum())

    variants = {
        "tearless": ours,
        "bare-dynamic": lambda r: bare_decode(model, ids, attn, steps, torch.Generator().manual_seed(r)),
        "bare-static": lambda r: bare_static(model, ids, attn, steps, torch.Generator().manual_seed(r)),
    }
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(repeats + 1):  # the first round warms up and is dropped
        for name, fn in variants.items():
            start = time.perf_counter()
            tokens = fn(r)
            rate = tokens / (time.perf_counter() - start)
            if r:
                rates[name].append(rate)
    med = statistics.median
    result = {f"{k} tok/s": med(v) for k, v in rates.items()}
    for bare in ("bare-dynamic", "bare-static"):
        result[f"÷ {bare}"] = med(o / b for o, b in zip(rates["tearless"], rates[bare], strict=True))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["64x16", "256x64"], help="ROWSxTOKENS")
    ap.add_argument("--hidden", nargs="+", type=int, default=[256, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tearless.cpu import keep_freed_memory
    from tearless.tasks.tokenizer import build_char_tokenizer

    keep_freed_memory()  # as the trainers do by default (trainer.keep_freed_memory)

    tok = build_char_tokenizer()
    print(f"load average before: {os.getloadavg()[0]:.2f}; torch threads {args.threads}", flush=True)
    header = None
    for hidden in args.hidden:
        model = make_model(hidden, tok).eval()
        for case in args.cases:
            rows, steps = (int(x) for x in case.split("x"))
            result = run_case(model, tok, rows, steps, args.repeats, args.seed)
            if header is None:
                header = ["hidden", "rows x tokens", *result]
                print(" | ".join(header), flush=True)
            cells = [str(hidden), case, *(f"{v:,.0f}" if v > 10 else f"{v:.3f}" for v in result.values())]
            print(" | ".join(cells), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
