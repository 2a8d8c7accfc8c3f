"""Rollout-vs-trainer log-prob mismatch and truncated importance sampling (TIS).

The rollout engine samples from π_rollout (vLLM kernels, bf16, another batch layout) while the
trainer computes log-probs under π_θ_old; the two differ even with identical weights. With
Δ_t = log π_old(y_t) − log π_rollout(y_t) on valid tokens:

- ``rollout_corr/kl`` = mean_t(−Δ_t): the k1 estimate of KL(π_rollout ‖ π_old) on the sampled tokens;
- ``rollout_corr/k3_kl`` = mean_t(exp(Δ_t) − 1 − Δ_t) ≥ 0: the low-variance estimate of the same KL;
- ``rollout_corr/log_ppl_diff`` = mean over sequences of (−mean_t log π_old) − (−mean_t log π_rollout);
- ``rollout_corr/max_abs_log_ratio`` = max_t |Δ_t|.

Truncated importance sampling (``algorithm.rollout_correction.rollout_is``) re-weights each token's
policy loss by w = clip(ρ, L, C), detached, with ρ = exp(Δ_t) per token (``token``) or
ρ = exp(Σ_t Δ_t) per sequence (``sequence``), C = ``rollout_is_threshold`` and L =
``rollout_is_threshold_lower`` (none by default); ``rollout_corr/is_weight_mean``,
``rollout_corr/is_clip_frac`` (share of tokens with ρ > C) and ``rollout_corr/is_clip_frac_low``
are logged. Masked IS (``rollout_rs``) rejects tokens or responses whose ratio leaves a band
(:func:`rollout_rejection`). The formulas live in :mod:`tearless.algos.offpolicy`; in the
asynchronous loop the same maths corrects for policy lag (decoupled PPO, ``docs/async.md``).
"""

from __future__ import annotations

from typing import Any

import torch

from tearless.algos import masked_mean
from tearless.algos.offpolicy import rejection_mask, truncated_is_weights


def rollout_correction(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str | None = None,
    threshold: float = 2.0,
    lower: float | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(B, R) TIS weights clip(ρ, ``lower``, ``threshold``) (None when ``level`` is None) and the
    ``rollout_corr/*`` metrics."""
    mask = response_mask.bool()
    delta = torch.where(mask, old_log_prob.float() - rollout_log_prob.float(), 0.0).clamp(-20.0, 20.0)
    valid = mask.float()
    seq_len = valid.sum(-1).clamp(min=1)
    ppl_old = -(old_log_prob.float() * valid).sum(-1) / seq_len
    ppl_rollout = -(rollout_log_prob.float() * valid).sum(-1) / seq_len
    has_tokens = valid.sum(-1) > 0
    metrics = {
        "rollout_corr/kl": float(masked_mean(-delta, mask)),
        # expm1 in float64: e^Δ − 1 − Δ ≈ Δ²/2 is far below float32's rounding of e^Δ when the engines
        # agree (|Δ| ~ 1e-6), and the float32 form then came out negative.
        "rollout_corr/k3_kl": float(masked_mean(torch.expm1(delta.double()) - delta.double(), mask)),
        "rollout_corr/log_ppl_diff": float((ppl_old - ppl_rollout)[has_tokens].mean()),
        "rollout_corr/max_abs_log_ratio": float(delta.abs().max()),
    }
    if level is None:
        return None, metrics
    weights, is_metrics = truncated_is_weights(delta, mask, level=level, upper=threshold, lower=lower)
    metrics.update({f"rollout_corr/{k}": v for k, v in is_metrics.items()})
    return weights, metrics


def rollout_rejection(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str | None,
    threshold: float | None,
    lower: float | None = None,
    veto: float | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """(B, R) 0/1 keep-mask of masked IS and token veto (None when both are off), and the
    ``rollout_corr/rs_*`` and ``rollout_corr/veto_frac`` metrics
    (:func:`tearless.algos.offpolicy.rejection_mask`). Without ``level`` only the veto applies."""
    if level is None and veto is None:
        return None, {}
    mask = response_mask.bool()
    delta = torch.where(mask, old_log_prob.float() - rollout_log_prob.float(), 0.0)
    if level is None:  # veto only: a band that keeps every ratio
        keep, metrics = rejection_mask(delta, mask, level="token", upper=float("inf"), lower=0.0, veto=veto)
    else:
        keep, metrics = rejection_mask(delta, mask, level=level, upper=threshold, lower=lower, veto=veto)
    return keep, {f"rollout_corr/{k}": v for k, v in metrics.items()}


def correct_rollout(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, rc: Any
) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, float]]:
    """The TIS weights (:func:`rollout_correction`), the keep-mask (:func:`rollout_rejection`) and
    both's metrics, as ``rc`` (the ``algorithm.rollout_correction`` section) configures them."""
    weights, corr = rollout_correction(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        level=rc.rollout_is,
        threshold=rc.rollout_is_threshold,
        lower=rc.rollout_is_threshold_lower,
    )
    keep, rejected = rollout_rejection(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        level=rc.rollout_rs,
        threshold=rc.rollout_rs_threshold,
        lower=rc.rollout_rs_threshold_lower,
        veto=rc.rollout_token_veto_threshold,
    )
    return weights, keep, {**corr, **rejected}
