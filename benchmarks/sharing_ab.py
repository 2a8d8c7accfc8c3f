"""Paired A/B of the two sharing levers on a benchmark case, one process, variants alternated.

- Sampler: ``HFRollout.generate`` of an older ``tearless/rollout/hf.py`` (one model row per sample,
  e.g. ``git show 1e27875:tearless/rollout/hf.py > /tmp/hf_old.py``) against the current one (one
  model row per distinct token history), on the case's first step of prompts; seconds per rollout
  and row-steps forwarded (a forward pre-hook counts rows).
- Update (small case only, ``--update``): the trainer's actor update (``update_policy`` of its
  in-process worker group) on the last sampled batch with
  random advantages (every row has signal), with ``distinct_rows`` as is against the identity (every
  row forwarded).

    OMP_NUM_THREADS=1 python benchmarks/sharing_ab.py --case small --old-sampler /tmp/hf_old.py --update
    OMP_NUM_THREADS=1 python benchmarks/sharing_ab.py --case medium --old-sampler /tmp/hf_old.py --pairs 7
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import load_prompts, make_case
from vs_trl import actor_workers


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("old_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def medians(seconds: dict[str, list[float]]) -> dict[str, float]:
    return {k: round(statistics.median(v[1:]), 4) for k, v in seconds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=["small", "medium"], default="small")
    ap.add_argument("--old-sampler", required=True, help="path of an older tearless/rollout/hf.py")
    ap.add_argument("--pairs", type=int, default=12, help="alternations (the first is a warm-up)")
    ap.add_argument("--update", action="store_true", help="also A/B the update's distinct_rows")
    args = ap.parse_args()
    torch.set_num_threads(1)

    import tearless.models.logprobs as logprobs
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.rollout.hf import HFRollout
    from tearless.rollout.seeds import prompt_keys

    case = make_case(args.case)
    tok = load_tokenizer(case.model_dir)
    model = load_causal_lm(case.model_dir)
    prompts = [r["input_ids"] for r in load_prompts(case, tok)[: case.prompts_per_step]]
    kw = dict(eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    samplers = {"old": load_module(args.old_sampler).HFRollout(model, **kw), "new": HFRollout(model, **kw)}
    seconds, row_steps = {k: [] for k in samplers}, {}
    for pair in range(args.pairs):
        for name, sampler in samplers.items():
            rows: list[int] = []
            hook = model.register_forward_pre_hook(
                lambda m, a, k, rows=rows: rows.append(k["input_ids"].shape[0]), with_kwargs=True
            )
            start = time.perf_counter()
            out = sampler.generate(
                prompts,
                n=case.n,
                max_new_tokens=case.max_new_tokens,
                keys=prompt_keys(pair, 0, 0, len(prompts)),
            )
            seconds[name].append(time.perf_counter() - start)
            hook.remove()
            row_steps[name] = sum(rows[1:])
    print("rollout s per pair:", {k: [round(x, 3) for x in v] for k, v in seconds.items()})
    print("rollout s, median after the first:", medians(seconds))
    print("row-steps forwarded after the prefill (last pair):", row_steps)
    if not args.update:
        return
    from tensordict import TensorDict

    mask = out.response_mask
    advantages = torch.randn(len(mask), 1, generator=torch.Generator().manual_seed(0)) * mask
    batch = TensorDict(
        {
            "prompt_ids": out.prompt_ids,
            "prompt_mask": out.prompt_mask,
            "response_ids": out.response_ids,
            "response_mask": mask,
            "advantages": advantages,
            "uid_index": torch.arange(len(prompts)).repeat_interleave(case.n),  # a prompt's n rows adjacent
        },
        batch_size=[len(mask)],
    )
    actor = actor_workers(case, model)
    distinct = logprobs.distinct_rows

    def every_row(prompt_ids, *_):
        rows = torch.arange(len(prompt_ids), device=prompt_ids.device)
        return rows, rows

    count = len(distinct(out.prompt_ids, out.prompt_mask, out.response_ids, mask, mask.sum(-1))[0])
    print(f"distinct sequences: {count} of {len(mask)}")
    update = {"every row": [], "distinct": []}
    for _ in range(9):
        for name, fn in (("every row", every_row), ("distinct", distinct)):
            logprobs.distinct_rows = fn
            start = time.perf_counter()
            actor.update_policy(batch)
            update[name].append(time.perf_counter() - start)
    logprobs.distinct_rows = distinct
    print("update s, median after the first:", medians(update))


if __name__ == "__main__":
    main()
