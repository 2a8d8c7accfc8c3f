"""A step's scored rollout, with DAPO's dynamic sampling (``algorithm.filter_groups``)."""

from __future__ import annotations

from typing import Any

import torch

from tearless import faults
from tearless.algos import filter_groups
from tearless.rollout.hf import concat_rollouts, select_rows
from tearless.rollout.seeds import prompt_keys
from tearless.run.timer import Timer
from tearless.workers.group import Rollout


def select(rollout: Rollout, keep: torch.Tensor) -> Rollout:
    """The rollout's rows ``keep`` (an index tensor), in that order."""
    rows = keep.tolist()
    return Rollout(
        out=select_rows(rollout.out, keep),
        items=[rollout.items[i] for i in rows],
        scores=rollout.scores[keep],
        correct=rollout.correct[keep],
        texts=[rollout.texts[i] for i in rows],
        extras=[rollout.extras[i] for i in rows],
        metrics=rollout.metrics,
        seconds=rollout.seconds,
    )


def concat(parts: list[Rollout], pad_token_id: int) -> Rollout:
    """Rollouts one after the other (metrics of the last one)."""
    return Rollout(
        out=concat_rollouts([p.out for p in parts], pad_token_id),
        items=[i for p in parts for i in p.items],
        scores=torch.cat([p.scores for p in parts]),
        correct=torch.cat([p.correct for p in parts]),
        texts=[t for p in parts for t in p.texts],
        extras=[e for p in parts for e in p.extras],
        metrics=dict(parts[-1].metrics),
        seconds=parts[-1].seconds,
    )


def collect(trainer: Any, step: int, timer: Timer) -> tuple[Rollout, list[str], dict[str, float]]:
    """Generate and score one step's responses: (rollout, uid per response, metrics).

    The ``n`` responses of a prompt are adjacent and share a uid. Prompt i of generation round r of
    step s samples with the key (seed, s, round stream, i) (:mod:`tearless.rollout.seeds`), so the
    same responses come back in any placement and on resume. With ``algorithm.filter_groups.enable``
    (DAPO's dynamic sampling), groups whose scores are all equal carry no GRPO signal and are dropped,
    and more prompts are drawn until ``data.train_batch_size`` groups are kept or
    ``max_num_gen_batches`` rounds have run.
    """
    cfg = trainer.cfg
    arr, fg = cfg.actor_rollout_ref, cfg.algorithm.filter_groups
    n, target = arr.rollout.n, cfg.data.train_batch_size
    parts: list[tuple[Rollout, list[str]]] = []
    kept_prompts, rounds, drawn = 0, 0, 0
    while True:
        prompts = trainer._next_prompts()
        rounds += 1
        drawn += len(prompts)
        faults.point("rollout", step)
        keys = prompt_keys(cfg.trainer.seed, step, 0 if rounds == 1 else 10 + rounds, len(prompts))
        faults.point("reward", step)
        rollout = trainer.generate(
            prompts,
            keys=keys,
            n=n,
            temperature=arr.rollout.temperature,
            top_p=arr.rollout.top_p,
            top_k=arr.rollout.top_k,
        )
        for name, seconds in rollout.seconds.items():
            timer.seconds[name] += seconds
        uids = [f"{step}-{rounds}-{i // n}" for i in range(len(rollout.items))]
        if not fg.enable:
            return rollout, uids, dict(rollout.metrics)
        keep = filter_groups(rollout.scores, uids).nonzero().squeeze(-1)
        keep = keep[: (target - kept_prompts) * n]
        kept_prompts += len(keep) // n
        parts.append((select(rollout, keep), [uids[j] for j in keep.tolist()]))
        if kept_prompts >= target or (fg.max_num_gen_batches > 0 and rounds >= fg.max_num_gen_batches):
            break
    if kept_prompts == 0:
        raise RuntimeError(
            f"algorithm.filter_groups: every group of {drawn} prompts had equal scores after {rounds} "
            "generation rounds; raise algorithm.filter_groups.max_num_gen_batches or check the reward"
        )
    rollout = concat([p for p, _ in parts], trainer.tokenizer.pad_token_id)
    metrics = dict(rollout.metrics)
    metrics["train/num_gen_batches"] = float(rounds)
    metrics["train/kept_prompt_ratio"] = kept_prompts / drawn
    return rollout, [u for _, us in parts for u in us], metrics
