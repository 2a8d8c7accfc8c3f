"""Held-out validation of the RL trainer: greedy accuracy always, mean@n and pass@k when sampling."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tearless.rollout.batch import Rollout
from tearless.rollout.seeds import prompt_keys
from tearless.trainers.metrics import pass_at_k
from tearless.trainers.progress import Progress


def validate(
    val_set: Sequence[dict],
    generate: Callable[..., Rollout],
    val_kwargs: Any,
    *,
    seed: int,
    batch_size: int | None,
    log: Callable[[str], None],
) -> dict[str, float]:
    """``val-core/<data_source>/{acc,reward}/greedy`` and, with ``val_kwargs.do_sample``, ``mean@n``
    and unbiased ``pass@k`` for k = 1, 2, 4, … ≤ n, per data source.

    ``generate(prompts, keys=…, n=…, **sampling)`` is the trainer's scored generation;
    ``val_kwargs`` the ``actor_rollout_ref.rollout.val_kwargs`` section, ``batch_size``
    ``data.val_batch_size`` (None: one call). A sample is correct when its scorer's ``acc`` is true
    or, without one, its score is ≥ 1. The held-out prompts sample with keys of their own (step −1),
    the same at every validation, so two validations differ only by the policy.
    """
    vk = val_kwargs
    # Each held-out prompt's uid is its place in the set, given here where it is drawn.
    items = [{**val_set[i], "uid": f"val-{i}"} for i in range(len(val_set))]
    size = batch_size or len(items)
    metrics: dict[str, float] = {}
    greedy = _val_pass(generate, items, size, log, n=1, keys=None, do_sample=False)
    for src, vals in greedy.items():
        metrics[f"val-core/{src}/acc/greedy"] = sum(c for _, c in vals) / len(vals)
        metrics[f"val-core/{src}/reward/greedy"] = sum(m for m, _ in vals) / len(vals)
    if vk.do_sample:
        keys = prompt_keys(seed, -1, 2, len(items))
        sampling = dict(temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k)
        for src, vals in _val_pass(generate, items, size, log, n=vk.n, keys=keys, **sampling).items():
            metrics[f"val-core/{src}/reward/mean@{vk.n}"] = sum(m for m, _ in vals) / len(vals)
            metrics[f"val-core/{src}/acc/mean@{vk.n}"] = sum(c for _, c in vals) / (len(vals) * vk.n)
            k = 1
            while k <= vk.n:
                metrics[f"val-core/{src}/acc/pass@{k}"] = sum(pass_at_k(vk.n, c, k) for _, c in vals) / len(
                    vals
                )
                k *= 2
    return metrics


def _val_pass(
    generate: Callable[..., Rollout],
    items: list[dict],
    size: int,
    log: Callable[[str], None],
    *,
    n: int,
    keys: list[int] | None,
    **sampling: Any,
) -> dict[str, list[tuple[float, int]]]:
    """Generate ``n`` responses per item; per data_source, (mean score, number correct) per prompt,
    the responses matched to their prompt by uid."""
    per_source: dict[str, list[tuple[float, int]]] = defaultdict(list)
    kind = "greedy" if keys is None else f"sampled, n={n}"
    progress = Progress(log, f"validation ({kind})", len(items), "prompts")
    for start in range(0, len(items), size):
        chunk = items[start : start + size]
        chunk_keys = None if keys is None else keys[start : start + size]
        rollout = generate(chunk, keys=chunk_keys, n=n, **sampling)
        rows: dict[str, list[int]] = defaultdict(list)
        for row, uid in enumerate(rollout.uids):
            rows[uid].append(row)
        for it in chunk:
            mine = torch.tensor(rows[it["uid"]])
            scores, correct = rollout.scores[mine], rollout.correct[mine]
            per_source[it["data_source"]].append((float(scores.mean()), int(correct.sum())))
        progress.update(start + len(chunk))
    return per_source


def format_validation(title: str, metrics: dict[str, float]) -> str:
    lines = [f"held-out {title}:"] + [f"  {k:<40} {v:.4f}" for k, v in sorted(metrics.items())]
    return "\n".join(lines)
