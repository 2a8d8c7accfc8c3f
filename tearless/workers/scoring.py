"""Scoring a rollout where it was generated: decode each response and ask the reward manager.

Each generating rank scores its own responses (its reward processes, its reward model), and returns
per-response results; the trainer computes the batch's reward metrics once over all of them
(:func:`reward_metrics`), whatever the number of ranks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from tearless.rewards.steps import step_fields
from tearless.rollout.engine import RolloutOutput
from tearless.rollout.multiturn import Scores


def score_responses(tokenizer: Any, manager: Any, items: list[dict], out: RolloutOutput) -> Scores:
    """The :class:`~tearless.rollout.multiturn.Scores` of ``out``'s responses (one item per
    response): ``scores`` and ``correct`` (B,), ``texts`` and ``extras`` (each scorer's extra keys) per
    response, and the counts of failed samples and of reward processes lost while scoring; ``errors``
    groups the failures by message (:func:`distinct_errors`).

    The scorer reads the whole trajectory (tool output included). A sample is correct when its
    scorer's ``acc`` is true or, without one, its score is ≥ 1.
    """
    texts = [
        tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
        for ids, m in zip(out.response_ids, out.response_attention_mask, strict=True)
    ]
    requests = [
        {
            "data_source": it["data_source"],
            "solution_str": s,
            "ground_truth": it["ground_truth"],
            "extra_info": it["extra_info"],
            "response_length": int(m.sum()),
            "prompt": it["raw_prompt"],
        }
        for it, s, m in zip(items, texts, out.response_mask, strict=True)
    ]
    lost_before = manager.lost_workers
    results = manager.score(requests)
    return {
        "scores": torch.tensor([r.score for r in results], dtype=torch.float32),
        "correct": torch.tensor(
            [bool(r.extra["acc"]) if "acc" in r.extra else r.score >= 1.0 for r in results]
        ),
        "texts": texts,
        # Each response's components, and its step scores if the scorer gave any (tearless.rewards.steps).
        "extras": [{**{k: float(v) for k, v in r.extra.items()}, **step_fields(r.steps)} for r in results],
        "failures": sum(r.error is not None for r in results),
        "errors": distinct_errors(results),
        "lost_workers": manager.lost_workers - lost_before,
    }


def distinct_errors(results: list[Any]) -> dict[str, list]:
    """The failed samples' errors by message: ``{error: [count, traceback or the message]}``."""
    errors: dict[str, list] = {}
    for r in results:
        if r.error is not None:
            entry = errors.setdefault(r.error, [0, r.traceback or r.error])
            entry[0] += 1
    return errors


def reward_metrics(extras: list[dict[str, float]], failures: int, lost_workers: int) -> dict[str, float]:
    """``reward_extra/<key>/mean`` over the responses that report the key, ``reward/failures`` and
    ``reward/lost_workers`` (reward processes that died mid-sample; their samples were rescored)."""
    by_key: dict[str, list[float]] = defaultdict(list)
    for extra in extras:
        for k, v in extra.items():
            if k not in ("step_scores", "step_ends"):
                by_key[k].append(v)
    metrics = {f"reward_extra/{k}/mean": sum(v) / len(v) for k, v in by_key.items()}
    metrics["reward/failures"] = float(failures)
    metrics["reward/lost_workers"] = float(lost_workers)
    return metrics
