"""Metric computations of the RL loop: batch statistics with veRL's names, pass@k (the step's timer is
:class:`tearless.run.timer.Timer`)."""

from __future__ import annotations

from collections import defaultdict
from math import comb

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): 1 − C(n−c, k)/C(n, k) for c correct of n samples."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    x = x.float()
    return {
        f"{prefix}/mean": float(x.mean()),
        f"{prefix}/max": float(x.max()),
        f"{prefix}/min": float(x.min()),
    }


def distill_metrics(
    teacher_log_prob: torch.Tensor, student_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    r"""On-policy distillation's fit, token-mean over the batch's valid tokens:
    ``distill/reverse_kl`` :math:`= \frac{1}{\sum m} \sum_{i,t} m_{i,t} (\log \pi_S - \log \pi_T)`,
    the one-sample estimate of :math:`\mathrm{KL}(\pi_S \Vert \pi_T)` per token at the student's own
    samples (Tinker's ``teacher_kl``), and the two log-probs' means."""
    mask = response_mask.bool()
    count = mask.sum().clamp(min=1)
    teacher = torch.where(mask, teacher_log_prob, 0.0).sum() / count
    student = torch.where(mask, student_log_prob, 0.0).sum() / count
    return {
        "distill/reverse_kl": float(student - teacher),
        "distill/teacher_log_prob": float(teacher),
        "distill/student_log_prob": float(student),
    }


def data_metrics(
    *,
    scores: torch.Tensor,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    prompt_mask: torch.Tensor,
    truncated: torch.Tensor,
    correct: torch.Tensor,
) -> dict[str, float]:
    """Per-step statistics: scores (before KL), rewards (after), advantages and returns over valid
    tokens, response/prompt lengths with the share of responses cut at the cap."""
    valid = response_mask.bool()
    lengths = response_mask.sum(-1)
    out = {}
    out.update(_stats("critic/score", scores))
    out.update(_stats("critic/rewards", rewards.sum(-1)))
    out.update(_stats("critic/advantages", advantages[valid]))
    out.update(_stats("critic/returns", returns[valid]))
    out.update(_stats("response_length", lengths))
    out["response_length/clip_ratio"] = float(truncated.float().mean())
    out.update(_stats("prompt_length", prompt_mask.sum(-1)))
    out["reward/accuracy"] = float(correct.float().mean())
    return out


def zero_variance_group_ratio(scores: torch.Tensor, uids: list[str]) -> float:
    """Share of prompt groups whose responses all got the same score: for GRPO-style estimators
    their advantages are zero, so they carry no learning signal."""
    groups: dict[str, list[float]] = defaultdict(list)
    for score, uid in zip(scores.tolist(), uids, strict=True):
        groups[uid].append(score)
    return sum(max(v) == min(v) for v in groups.values()) / max(1, len(groups))
