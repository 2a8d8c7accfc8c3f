r"""Further policy losses of veRL 0.9's ``actor.policy_loss.loss_mode``, registered in ``POLICY_LOSSES``.

``geo_mean`` (GMPO), ``sapo``, ``dppo_tv`` and ``dppo_kl`` (DPPO), ``gpg`` and ``dro``: each is the
paper's objective as veRL 0.9's ``core_algos`` computes it (read, not copied); where the two differ, or
where this package normalises differently, the docstring says so. Conventions of
:mod:`tearless.algos.losses`: per-token tensors (B, T), mask m, Δ = logπ − logπ_old clamped to
[−20, 20] before ``exp``, ρ = exp(Δ), advantage A, stop-gradient sg[·], :math:`\ell_i = \sum_t m_{i,t}`.
Every function returns the (B, T) loss that :func:`~tearless.algos.policy_loss` aggregates, and its own
metrics; ``pg_clipfrac``, ``pg_clipfrac_lower`` (0 where a mode has none) and ``ppo_kl`` = mean(−Δ) are
always reported.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tearless.algos.losses import _log_ratio, _mean_or_zero, register_policy_loss
from tearless.algos.masked import masked_sum


def _per_sequence(x: Tensor, mask: Tensor) -> Tensor:
    """(B, 1) mean of x over each row's valid tokens (0 for an empty row)."""
    return masked_sum(x, mask, dim=-1).unsqueeze(-1) / mask.sum(-1, keepdim=True).clamp(min=1)


@register_policy_loss("geo_mean", agg_mode="seq-mean-token-mean")
def geo_mean_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): the geometric mean of the token
    ratios, each clipped in log space on the side that would increase the objective.

    .. math:: \tilde\Delta_t = s_t \min\big(s_t\Delta_t,\ s_t\,\mathrm{clip}(\Delta_t, -\epsilon_{low},
              \epsilon_{high})\big),\ s_t = \mathrm{sgn}(A_t), \qquad
              r_i = \exp\Big(\tfrac{1}{\ell_i}\sum_t \tilde\Delta_{i,t} m_{i,t}\Big), \qquad
              L_i = -\bar A_i\, r_i,\ \bar A_i = \tfrac{1}{\ell_i}\sum_t A_{i,t} m_{i,t}

    and the loss is the mean of :math:`L_i` over the non-empty sequences (veRL's GMPO example uses
    ε = 0.4). Each valid token of row i carries :math:`L_i` and the aggregation is
    ``seq-mean-token-mean``, so the value and gradient are those of :math:`\frac{1}{N_{seq}}\sum_i L_i`
    with the mini-batch's global sequence count. veRL takes ``torch.mean`` over the micro-batch's rows
    instead (empty rows counted, no global normaliser) and does not clamp Δ at ±20; it also ignores
    ``loss_agg_mode``. ``rollout_is_weights`` enter per sequence as their geometric mean
    :math:`\exp(\frac{1}{\ell_i}\sum_t \log(w_t + 10^{-10}))`, as in veRL. ``pg_clipfrac`` is the share of
    tokens with Δ outside [−ε_low, ε_high] and A > 0, ``pg_clipfrac_lower`` the same with A < 0.
    """
    log_ratio = _log_ratio(log_prob, old_log_prob)
    sign = torch.sign(advantages)
    clipped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clipped)
    ratio = torch.exp(_per_sequence(pessimistic, response_mask))
    loss = -_per_sequence(advantages, response_mask) * ratio
    if rollout_is_weights is not None:
        log_w = torch.log(rollout_is_weights + 1e-10)
        loss = loss * torch.exp(_per_sequence(log_w, response_mask))
    outside = log_ratio != clipped
    return loss.expand_as(log_prob), {
        "pg_clipfrac": _mean_or_zero(outside & (advantages > 0), response_mask),
        "pg_clipfrac_lower": _mean_or_zero(outside & (advantages < 0), response_mask),
    }


@register_policy_loss("sapo", agg_mode="seq-mean-token-mean")
def sapo_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""SAPO (arXiv 2511.20347): a smooth gate on the ratio instead of a hard clip.

    .. math:: L_t = -f_{\tau_t}(\rho_t)\,A_t, \qquad f_\tau(\rho) = \frac{4}{\tau}\,\sigma\big(\tau(\rho -
              1)\big), \qquad \tau_t = \tau_{pos} \text{ if } A_t > 0 \text{ else } \tau_{neg}

    :math:`f'_\tau(1) = 1`, so on-policy the gradient is exactly the policy gradient −A∇logπ; far
    from ρ = 1 the gate saturates and the gradient fades smoothly (faster for the larger τ_neg).
    Aggregated with ``seq-mean-token-mean``, which veRL 0.9 hard-codes for SAPO. τ are veRL's
    ``actor.tau_pos`` / ``actor.tau_neg`` (1.0 / 1.05, the paper's values); veRL's SAPO README writes
    them as ``policy_loss.tau_pos``, a key its code never reads. No clipping: ``pg_clipfrac`` is 0.
    """
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos} and {tau_neg}")
    ratio = torch.exp(_log_ratio(log_prob, old_log_prob))
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * advantages, {}


def _dppo_loss(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    valid: Tensor,
    clip_ratio_c: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO's masked, truncated-IS policy gradient −A·sg[min(ρ, c)]·logπ on the ``valid`` tokens."""
    if clip_ratio_c <= 0:
        raise ValueError(f"clip_ratio_c (the truncated IS cap of DPPO) must be > 0, got {clip_ratio_c}")
    ratio = torch.exp(_log_ratio(log_prob, old_log_prob)).detach()
    loss = -advantages * torch.clamp(ratio, max=clip_ratio_c) * log_prob * valid
    return loss, {
        "pg_clipfrac": _mean_or_zero(~valid, response_mask),
        "pg_clipfrac_lower": _mean_or_zero((ratio > clip_ratio_c) & valid, response_mask),
    }


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""DPPO-Binary-TV (Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning").

    The trust region is on the token's probability, not its ratio: with p = π(y_t), p_old = π_old(y_t),

    .. math:: v_t = \begin{cases} [\,p - p_{old} \le \delta_{high}\,] & A_t > 0 \\
              [\,p - p_{old} \ge -\delta_{low}\,] & A_t \le 0 \end{cases}, \qquad
              L_t = -A_t\,\mathrm{sg}[\min(\rho_t, c)]\,\log\pi_t\,v_t

    δ are ``clip_ratio_low`` / ``clip_ratio_high`` (veRL's DPPO example: 0.15), c = ``clip_ratio_c``
    truncates the importance weight instead of dual-clipping. veRL reads c with a fallback of 20 that
    never applies (its config always holds ``clip_ratio_c``, 3.0 by default), so the effective default
    is 3.0, as here; its DPPO example sets 10000. A token outside the region keeps no gradient.
    ``pg_clipfrac`` is the share outside the region, ``pg_clipfrac_lower`` the share inside it whose
    weight was truncated.
    """
    change = torch.exp(log_prob) - torch.exp(old_log_prob)
    valid = torch.where(advantages > 0, change <= clip_ratio_high, change >= -clip_ratio_low)
    return _dppo_loss(log_prob, old_log_prob, advantages, response_mask, valid, clip_ratio_c)


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""DPPO-Binary-KL (Qi et al. 2026): as :func:`dppo_tv_policy_loss` with the binary KL as divergence.

    .. math:: D_t = p_{old}\log\frac{p_{old}}{p} + (1 - p_{old})\log\frac{1 - p_{old} + 10^{-8}}
              {1 - p + 10^{-8}}, \qquad
              v_t = \begin{cases} [D_t \le \delta_{high}] \lor [p \le p_{old}] & A_t > 0 \\
              [D_t \le \delta_{low}] \lor [p \ge p_{old}] & A_t \le 0 \end{cases}

    so only a move in the direction the advantage pushes is bounded (veRL's DPPO example: δ = 0.05).
    Loss, c and metrics as for ``dppo_tv``.
    """
    p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
    divergence = p_old * (old_log_prob - log_prob) + (1.0 - p_old) * torch.log(
        (1.0 - p_old + 1e-8) / (1.0 - p + 1e-8)
    )
    bounded_up = (divergence <= clip_ratio_high) | (p <= p_old)
    bounded_down = (divergence <= clip_ratio_low) | (p >= p_old)
    valid = torch.where(advantages > 0, bounded_up, bounded_down)
    return _dppo_loss(log_prob, old_log_prob, advantages, response_mask, valid, clip_ratio_c)


@register_policy_loss("gpg")
def gpg_policy_loss(*, log_prob: Tensor, advantages: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    r"""GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline"): the plain
    policy gradient, no ratio, no clip.

    .. math:: L_t = -A_t \log\pi_t

    Meant with ``algorithm.adv_estimator=gpg`` (its corrected group advantage). Off-policy (more than
    one mini-batch or epoch) nothing bounds the update. No clipping: ``pg_clipfrac`` is 0.
    """
    return -advantages * log_prob, {}


@register_policy_loss("dro")
def dro_policy_loss(
    *, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, dro_beta: float
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""DRO as veRL 0.9 defines its ``dro`` loss mode (docs/algo/dro.md): the policy gradient with a
    quadratic penalty on the log-ratio to the old policy.

    .. math:: L_t = -\Big(A_t\log\pi_t - \frac{\beta}{2}\,(\log\pi_t - \log\pi_{old,t})^2\Big)

    β = ``dro_beta`` (veRL's ``policy_loss.dro_beta``) is required and > 0; the log-ratio is not
    clamped (the penalty is what pulls a large one back). The advantages are the estimator's, as in
    veRL, which leaves "advantages appropriate for its soft off-policy formulation" to the user
    (Richemond et al.'s DRO also learns a value function; this loss is only its policy term).
    """
    if dro_beta <= 0:
        raise ValueError(f"dro_beta must be > 0 for the dro policy loss, got {dro_beta}")
    return -(advantages * log_prob - 0.5 * dro_beta * (log_prob - old_log_prob).square()), {}
