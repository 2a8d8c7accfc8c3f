"""Off-policy corrections: truncated and masked importance sampling, and decoupled PPO.

A sample was drawn from a behaviour policy μ (the rollout engine's weights, possibly several policy
versions old in the asynchronous loop) while the update's clip is taken around the proximal policy
π_old (the trainer's log-probs of the same tokens with the weights at the start of the step). With
valid tokens t of response i and

    Δ_{i,t} = log π_old(y_{i,t}) − log μ(y_{i,t})

the importance ratio is ρ at one of three levels (``level``):

- ``token``:     ρ_{i,t} = exp(Δ_{i,t});
- ``sequence``:  ρ_i = exp(Σ_t Δ_{i,t})  (the product of the token ratios; unbiased, high variance);
- ``geometric``: ρ_i = exp(mean_t Δ_{i,t})  (rejection only: a per-token-normalised sequence ratio).

The exponent is clamped to [−20, 20] before ``exp`` (veRL's safety bound).

**Truncated IS** (TIS, ``rollout_is``): each token's policy loss is multiplied by the detached weight
w = clip(ρ, L, U), U = ``rollout_is_threshold``, L = ``rollout_is_threshold_lower`` (no lower bound
when None, as in veRL).

**Masked IS / rejection** (``rollout_rs``): tokens (``token``) or whole responses (``sequence``,
``geometric``) whose ρ leaves [L, U] are rejected: they leave the loss mask, U =
``rollout_rs_threshold``, L = ``rollout_rs_threshold_lower`` (1/U when None, as veRL).
**Token veto** (``rollout_token_veto_threshold`` = τ): a response with any token ratio
exp(Δ_{i,t}) < τ is rejected whole.

**Decoupled PPO** (AReaL, Hilton et al. 2022 "Batch size-invariance for policy optimization"):
with r_t = π_θ(y_t)/π_old(y_t) and A_t the advantage,

    L(θ) = −Σ_t w_t · min(r_t A_t, clip(r_t, 1−ε_low, 1+ε_high) A_t)

the IS weight w_t = π_old/μ corrects for the behaviour policy, the clip keeps θ near the proximal
policy π_old. In tearless that is the vanilla policy loss (:func:`tearless.algos.policy_loss`, whose
``rollout_is_weights`` multiply each token's term) with π_old recomputed by the trainer
(``algorithm.rollout_correction.bypass_mode=false``) and w from :func:`truncated_is_weights`;
AReaL's own cap (tokens with w > U dropped rather than truncated) is :func:`rejection_mask` at the
token level with L = 0.
"""

from __future__ import annotations

import torch

from tearless.algos.masked import masked_mean

SAFETY_BOUND = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


def level_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """(B, T) log ρ at ``level``: Δ itself (token), or each response's Σ_t Δ (sequence) or mean_t Δ
    (geometric) on every position of it; clamped to ±20. Invalid positions of Δ count as 0."""
    valid = mask.float()
    delta = log_ratio.float() * valid
    if level == "token":
        out = delta
    elif level == "sequence":
        out = delta.sum(-1, keepdim=True).expand_as(delta)
    elif level == "geometric":
        out = (delta.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)).expand_as(delta)
    else:
        raise ValueError(f"importance-ratio level {level!r}: use one of {', '.join(RS_LEVELS)}")
    return out.clamp(-SAFETY_BOUND, SAFETY_BOUND)


def truncated_is_weights(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    upper: float,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) detached TIS weights w = clip(ρ, lower, upper), zero on invalid positions, and metrics:
    ``is_weight_mean`` (mean w over valid tokens), ``is_clip_frac`` (share of valid tokens with
    ρ > upper) and ``is_clip_frac_low`` (ρ < lower; 0 without a lower bound)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={level!r}: use one of {', '.join(IS_LEVELS)}")
    valid = mask.bool()
    ratio = level_log_ratio(log_ratio, mask, level).exp()
    weights = ratio.clamp(min=lower, max=upper) if lower is not None else ratio.clamp(max=upper)
    weights = torch.where(valid, weights, 0.0).detach()
    low = (ratio < lower).float() if lower is not None else torch.zeros_like(ratio)
    metrics = {
        "is_weight_mean": float(masked_mean(weights, valid)),
        "is_clip_frac": float(masked_mean((ratio > upper).float(), valid)),
        "is_clip_frac_low": float(masked_mean(low, valid)),
    }
    return weights, metrics


def rejection_mask(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    level: str,
    upper: float,
    lower: float | None = None,
    veto: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) 0/1 keep-mask of masked IS: 1 where ρ (at ``level``) lies in [lower, upper] (lower
    defaults to 1/upper) and the response has no token with exp(Δ_t) < ``veto``; and metrics:
    ``rs_masked_frac`` (share of valid tokens rejected), ``rs_seq_masked_frac`` (share of responses
    with at least one valid token rejected), ``veto_frac`` (share of responses vetoed)."""
    if level not in RS_LEVELS:
        raise ValueError(f"rollout_rs={level!r}: use one of {', '.join(RS_LEVELS)}")
    valid = mask.bool()
    lower = 1.0 / upper if lower is None else lower
    ratio = level_log_ratio(log_ratio, mask, level).exp()
    keep = (ratio >= lower) & (ratio <= upper)
    vetoed = torch.zeros(valid.shape[0], dtype=torch.bool)
    if veto is not None:
        token_ratio = level_log_ratio(log_ratio, mask, "token").exp()
        vetoed = ((token_ratio < veto) & valid).any(-1)
        keep &= ~vetoed.unsqueeze(-1)
    keep &= valid
    rejected = valid & ~keep
    has_tokens = valid.any(-1)
    metrics = {
        "rs_masked_frac": float(masked_mean(rejected.float(), valid)),
        "rs_seq_masked_frac": float(rejected.any(-1)[has_tokens].float().mean()) if has_tokens.any() else 0.0,
        "veto_frac": float(vetoed.float().mean()),
    }
    return keep.float(), metrics
