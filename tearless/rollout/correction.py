"""Rollout-vs-trainer log-prob mismatch and truncated importance sampling (TIS).

The rollout engine samples from π_rollout (vLLM kernels, bf16, another batch layout) while the
trainer computes log-probs under π_θ_old; the two differ even with identical weights. With
Δ_t = log π_old(y_t) − log π_rollout(y_t) on valid tokens:

- ``rollout_corr/kl`` = mean_t(−Δ_t): the k1 estimate of KL(π_rollout ‖ π_old) on the sampled tokens;
- ``rollout_corr/k3_kl`` = mean_t(exp(Δ_t) − 1 − Δ_t) ≥ 0: the low-variance estimate of the same KL;
- ``rollout_corr/log_ppl_diff`` = mean over sequences of (−mean_t log π_old) − (−mean_t log π_rollout);
- ``rollout_corr/max_abs_log_ratio`` = max_t |Δ_t|.

Truncated importance sampling (``algorithm.rollout_correction.rollout_is``) re-weights each token's
policy loss by w = min(ρ, C), detached, with ρ = exp(Δ_t) per token (``token``) or
ρ = exp(Σ_t Δ_t) per sequence (``sequence``) and C = ``rollout_is_threshold``; ``rollout_corr/
is_weight_mean`` and ``rollout_corr/is_clip_frac`` (share of tokens with ρ > C) are logged.
"""

from __future__ import annotations

import torch

from tearless.algos import masked_mean

IS_LEVELS = ("token", "sequence")


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str | None = None,
    threshold: float = 2.0,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(B, R) TIS weights (None when ``level`` is None) and the ``rollout_corr/*`` metrics."""
    mask = response_mask.bool()
    delta = torch.where(mask, old_log_prob.float() - rollout_log_prob.float(), 0.0).clamp(-20.0, 20.0)
    valid = mask.float()
    seq_len = valid.sum(-1).clamp(min=1)
    ppl_old = -(old_log_prob.float() * valid).sum(-1) / seq_len
    ppl_rollout = -(rollout_log_prob.float() * valid).sum(-1) / seq_len
    has_tokens = valid.sum(-1) > 0
    metrics = {
        "rollout_corr/kl": float(masked_mean(-delta, mask)),
        "rollout_corr/k3_kl": float(masked_mean(delta.exp() - 1 - delta, mask)),
        "rollout_corr/log_ppl_diff": float((ppl_old - ppl_rollout)[has_tokens].mean()),
        "rollout_corr/max_abs_log_ratio": float(delta.abs().max()),
    }
    if level is None:
        return None, metrics
    if level not in IS_LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}: use token, sequence or null")
    log_ratio = delta if level == "token" else (delta * valid).sum(-1, keepdim=True).expand_as(delta)
    ratio = log_ratio.clamp(max=20.0).exp()
    weights = torch.where(mask, ratio.clamp(max=threshold), 0.0)
    metrics["rollout_corr/is_weight_mean"] = float(masked_mean(weights, mask))
    metrics["rollout_corr/is_clip_frac"] = float(masked_mean((ratio > threshold).float(), mask))
    return weights.detach(), metrics
