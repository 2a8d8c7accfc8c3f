r"""Policy losses, the value loss, and entropy / log-probs from logits.

Per-token tensors are (B, T) with a ``response_mask`` (B, T) whose zeros mark padding or tokens that are
not trained on (prompt, tool output). Δ = logπ − logπ_old is the per-token log-ratio, clamped to
[−20, 20] before ``exp`` so that one wild token cannot overflow; ρ = exp(Δ); A is the advantage; sg[·] is
stop-gradient.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from tearless.algos._registry import accepted_names, call_accepted, lookup, registrar
from tearless.algos.aggregation import AGG_MODES, agg_loss
from tearless.algos.masked import masked_sum, zero_masked

POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {}
# Modes whose maths defines its own aggregation (veRL pins the same ones): loss_agg_mode must be None
# (their own mode is used) or equal to it.
FIXED_AGG_MODES: dict[str, str] = {}
# Modes whose per-token loss is A_t times a factor: a zero advantage gives a zero loss and gradient, so
# the actor may leave responses whose advantages are all zero out of an on-policy update.
LINEAR_IN_ADVANTAGE: set[str] = set()

_AGG_KWARGS = ("global_num_tokens", "global_num_seqs", "loss_scale_factor")


def register_policy_loss(
    name: str, *, agg_mode: str | None = None, linear_in_advantage: bool = False
) -> Callable[[Callable], Callable]:
    """Register ``fn(*, old_log_prob, log_prob, advantages, response_mask, ...) -> (loss_mat, metrics)``.

    :func:`policy_loss` calls ``fn`` with a bool ``response_mask``, inputs already zeroed outside it, and
    only the knobs ``fn`` names; it aggregates the (B, T) ``loss_mat`` itself. ``agg_mode`` pins the
    aggregation for a loss whose definition includes it (GSPO, SAPO, GMPO). A ``fn`` that names
    ``rollout_is_weights`` applies them itself (GMPO's are per sequence); otherwise they multiply
    ``loss_mat`` token by token. ``linear_in_advantage`` declares ``loss_mat`` = A_t × a factor (zero
    loss and gradient where A_t = 0; :data:`LINEAR_IN_ADVANTAGE`): the actor's ``skip_zero_adv_rows``
    then applies to the mode.
    """

    def decorate(fn: Callable) -> Callable:
        registrar(POLICY_LOSSES, "policy loss")(name)(fn)
        if agg_mode is not None:
            FIXED_AGG_MODES[name] = agg_mode
        if linear_in_advantage:
            LINEAR_IN_ADVANTAGE.add(name)
        return fn

    return decorate


def policy_loss(
    mode: str,
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str | None = None,
    rollout_is_weights: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Scalar policy loss and metrics for the mode registered as ``mode``.

    ``loss_agg_mode`` (:func:`agg_loss`) aggregates the per-token loss; None means the mode's own
    (:data:`FIXED_AGG_MODES`: ``seq-mean-token-mean`` for ``sapo`` and ``geo_mean``) or else
    ``token-mean``, veRL's default. Those two modes define their aggregation (veRL 0.9.1 hard-codes it
    too), so any other explicit ``loss_agg_mode`` raises ValueError rather than being ignored. ``gspo``
    is not among them: veRL 0.9.1 aggregates it with ``loss_agg_mode`` like any other mode.

    ``rollout_is_weights`` (B, T), when given, multiplies each token's loss before aggregation
    (truncated importance sampling for the rollout/trainer mismatch; detached, no gradient).

    Inputs are (B, T). ``kwargs`` take the normalisers of :func:`agg_loss` (``global_num_tokens``,
    ``global_num_seqs``, ``loss_scale_factor``) and the knobs of the registered modes (``clip_cov_ratio``,
    ``clip_cov_lb``, ``clip_cov_ub``, ``generator``, ``kl_cov_ratio``, ``ppo_kl_coef``, ``tau_pos``,
    ``tau_neg``, ``dro_beta``); a knob of another mode is ignored, a name no mode knows raises
    TypeError. Masked positions of every input are replaced by 0 first, so garbage there never reaches
    the loss, the metrics or the gradient.

    Metrics (0-d, detached, over the valid tokens of this call) always include ``pg_clipfrac``,
    ``pg_clipfrac_lower`` (0 where a mode does not have it) and ``ppo_kl`` = mean(−Δ).
    """
    fn = lookup(POLICY_LOSSES, mode, "policy loss mode")
    if loss_agg_mode is not None:
        lookup(AGG_MODES, loss_agg_mode, "loss_agg_mode")
    own_agg = FIXED_AGG_MODES.get(mode)
    if own_agg is not None and loss_agg_mode not in (None, own_agg):
        raise ValueError(
            f"policy loss {mode!r} aggregates with {own_agg!r} by definition; loss_agg_mode="
            f"{loss_agg_mode!r} cannot apply to it (pass None or {own_agg!r})"
        )
    agg_kwargs = {k: kwargs.pop(k) for k in _AGG_KWARGS if k in kwargs}
    unknown = set(kwargs) - accepted_names(POLICY_LOSSES)
    if unknown:
        raise TypeError(f"policy_loss got unknown keyword argument(s): {', '.join(sorted(unknown))}")
    mask = response_mask.bool()
    old_log_prob, log_prob = zero_masked(old_log_prob, mask), zero_masked(log_prob, mask)
    inputs = {
        "old_log_prob": old_log_prob,
        "log_prob": log_prob,
        "advantages": zero_masked(advantages, mask),
        "response_mask": mask,
        "clip_ratio_low": clip_ratio_low,
        "clip_ratio_high": clip_ratio_high,
        "clip_ratio_c": clip_ratio_c,
        **kwargs,
    }
    weights = None
    if rollout_is_weights is not None:
        weights = zero_masked(rollout_is_weights.detach().to(log_prob.device), mask)
    applies_weights = "rollout_is_weights" in inspect.signature(fn).parameters
    if applies_weights:
        inputs["rollout_is_weights"] = weights
    loss_mat, own_metrics = call_accepted(fn, inputs, f"policy loss {mode!r}")
    if weights is not None and not applies_weights:
        loss_mat = loss_mat * weights
    loss = agg_loss(loss_mat, mask, own_agg or loss_agg_mode, **agg_kwargs)
    zero = torch.zeros((), device=loss.device)
    metrics = {
        "pg_clipfrac": zero,
        "pg_clipfrac_lower": zero,
        "ppo_kl": _mean_or_zero(-_log_ratio(log_prob, old_log_prob), mask),
        **own_metrics,
    }
    return loss, {k: v.detach() for k, v in metrics.items()}


def _mean_or_zero(x: Tensor, mask: Tensor) -> Tensor:
    """Detached float32 mean over the valid tokens, 0 for an empty mask.

    For metrics (and covariance centring), where an empty micro-batch must not stop training.
    """
    return (masked_sum(x.float(), mask) / mask.sum().clamp(min=1)).detach()


def _log_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    return torch.clamp(log_prob - old_log_prob, -20.0, 20.0)


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic surrogate max(−Aρ, −A·clip(ρ)) and where the clipped branch won."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _centred_cov(advantages: Tensor, log_prob: Tensor, mask: Tensor) -> Tensor:
    """Per-token (A − Ā)(logπ − mean logπ) with means over valid tokens; −inf where masked."""
    lp = log_prob.detach()
    cov = (advantages - _mean_or_zero(advantages, mask)) * (lp - _mean_or_zero(lp, mask))
    return torch.where(mask, cov, -torch.inf)


@register_policy_loss("vanilla", linear_in_advantage=True)
def vanilla_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""PPO clip (Schulman et al. 2017) with asymmetric ranges and dual clip (Ye et al. 2019).

    .. math:: L^{clip} = \max(-A\rho,\ -A\,\mathrm{clip}(\rho, 1-\epsilon_{low}, 1+\epsilon_{high})),
              \qquad L = \begin{cases} \min(L^{clip}, -cA) & A < 0 \\ L^{clip} & A \ge 0 \end{cases}

    Dual clip caps the loss of a negative-advantage token at c·|A| however large ρ grows; c =
    ``clip_ratio_c`` must be > 1. Returns the (B, T) loss and ``pg_clipfrac`` = mean[clip branch won],
    ``pg_clipfrac_lower`` = mean[dual clip active].
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    ratio = torch.exp(_log_ratio(log_prob, old_log_prob))
    clip_loss, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    dual_bound = -advantages * clip_ratio_c
    dual = (advantages < 0) & (clip_loss > dual_bound)
    loss = torch.where(dual, dual_bound, clip_loss)
    return loss, {
        "pg_clipfrac": _mean_or_zero(clipped, response_mask),
        "pg_clipfrac_lower": _mean_or_zero(dual, response_mask),
    }


@register_policy_loss("gspo", linear_in_advantage=True)
def gspo_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Group sequence policy optimisation (Zheng et al. 2025): a sequence-level ratio.

    .. math:: s_i = \frac{\sum_t \Delta_{i,t} m_{i,t}}{\max(1, |y_i|)}, \qquad
              \rho_{i,t} = \exp\big(\min(\mathrm{sg}[s_i] + \log\pi_{i,t} - \mathrm{sg}[\log\pi_{i,t}],
              10)\big)

    then PPO clip on ρ. Every token of a sequence has the value exp(s_i) but its own gradient.
    Aggregated with ``loss_agg_mode`` like vanilla (default ``token-mean``), as veRL 0.9.1's
    ``compute_policy_loss_gspo`` does (veRL 0.9.0 hard-coded ``seq-mean-token-mean``). The paper's
    1/|G| Σ_i 1/|y_i| Σ_t is ``seq-mean-token-mean``, which the ``gspo`` preset sets. ``pg_clipfrac`` as
    in vanilla; no dual clip.
    """
    lengths = response_mask.sum(-1, keepdim=True).clamp(min=1)
    seq_log_ratio = masked_sum(_log_ratio(log_prob, old_log_prob), response_mask, dim=-1).unsqueeze(-1)
    token_log_ratio = (seq_log_ratio / lengths).detach() + log_prob - log_prob.detach()
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    return loss, {"pg_clipfrac": _mean_or_zero(clipped, response_mask)}


@register_policy_loss("cispo", linear_in_advantage=True)
def cispo_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""CISPO (MiniMax 2025): clip the importance weight, not the update.

    .. math:: L = -\mathrm{sg}[\mathrm{clip}(\rho, 1-\epsilon_{low}, 1+\epsilon_{high})]\, A \log\pi

    Every token keeps a gradient (−w·A with respect to logπ); ``pg_clipfrac`` is the fraction of tokens
    whose weight was clipped.
    """
    ratio = torch.exp(_log_ratio(log_prob, old_log_prob)).detach()
    weight = torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return -weight * advantages * log_prob, {"pg_clipfrac": _mean_or_zero(weight != ratio, response_mask)}


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning LMs").

    PPO clip, then up to :math:`k = \max(1, \lfloor \text{clip\_cov\_ratio} \cdot N_{tok} \rfloor)`
    tokens drawn uniformly (with ``generator``) among those not already clipped whose centred covariance
    :math:`(A - \bar A)(\log\pi - \overline{\log\pi})` lies strictly inside (lb, ub) are dropped: their
    loss and gradient are set to 0. This stops the few tokens that drive entropy collapse.
    ``pg_clipfrac`` is the fraction of valid tokens dropped.
    """
    ratio = torch.exp(_log_ratio(log_prob, old_log_prob))
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    cov = _centred_cov(advantages, log_prob, response_mask)
    eligible = response_mask & ~clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    candidates = eligible.flatten().nonzero().squeeze(-1)
    budget = max(1, int(clip_cov_ratio * int(response_mask.sum())))
    # randperm on CPU: a CPU generator cannot drive a CUDA randperm.
    order = torch.randperm(candidates.numel(), generator=generator).to(candidates.device)
    dropped = torch.zeros_like(response_mask)
    dropped.view(-1)[candidates[order[:budget]]] = True
    loss = torch.where(dropped, torch.zeros_like(loss), loss)
    return loss, {"pg_clipfrac": _mean_or_zero(dropped, response_mask)}


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    *,
    old_log_prob: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""KL-Cov (Cui et al. 2025): unclipped surrogate, KL penalty on the highest-covariance tokens.

    .. math:: L_t = -A_t\rho_t + \beta\,|\Delta_t|\,[t \in \mathrm{top}_k\ (A - \bar A)(\log\pi -
              \overline{\log\pi})]

    with :math:`k = \max(1, \lfloor \text{kl\_cov\_ratio} \cdot N_{tok} \rfloor)` and β = ``ppo_kl_coef``
    (``policy_loss.ppo_kl_coef``, 0.1 as veRL's config; veRL's code falls back to 1.0 only when it is null).
    No clipping (``pg_clipfrac`` = 0); extra metric ``ppo_kl_abs`` = mean |Δ| (what veRL reports as
    ``ppo_kl`` for this mode; here ``ppo_kl`` keeps one meaning across modes).
    """
    log_ratio = _log_ratio(log_prob, old_log_prob)
    loss = -advantages * torch.exp(log_ratio)
    n_valid = int(response_mask.sum())
    k = min(n_valid, max(1, int(kl_cov_ratio * n_valid)))
    top = torch.topk(_centred_cov(advantages, log_prob, response_mask).flatten(), k).indices
    penalised = torch.zeros_like(response_mask)
    penalised.view(-1)[top] = True
    loss = loss + ppo_kl_coef * log_ratio.abs() * penalised
    return loss, {"ppo_kl_abs": _mean_or_zero(log_ratio.abs(), response_mask)}


# ----------------------------------------------------------------------------- value loss


def value_loss(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: int | float | Tensor | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Clipped value loss (PPO2), all inputs (B, T).

    .. math:: v^{clip} = V_{old} + \mathrm{clip}(v - V_{old}, -c, c), \qquad
              L = \tfrac12\,\mathrm{agg}\big(\max((v - G)^2, (v^{clip} - G)^2)\big)

    ``values`` are the critic's values at rollout time, ``returns`` G the targets, c = ``cliprange_value``;
    ``agg_kwargs`` are :func:`agg_loss`'s normalisers. Metrics: ``vf_clipfrac`` = mean[clipped branch
    larger], ``vpred_mean``.
    """
    mask = response_mask.bool()
    vpreds, values, returns = (zero_masked(x, mask) for x in (vpreds, values, returns))
    vclipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    unclipped_sq, clipped_sq = (vpreds - returns).square(), (vclipped - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(unclipped_sq, clipped_sq), mask, loss_agg_mode, **agg_kwargs)
    return loss, {
        "vf_clipfrac": _mean_or_zero(clipped_sq > unclipped_sq, mask),
        "vpred_mean": _mean_or_zero(vpreds, mask),
    }


# ----------------------------------------------------------------------------- logits


def _compute_dtype(logits: Tensor) -> torch.dtype:
    # 16-bit log-sum-exp loses about two significant digits, enough to bias PPO ratios by percents.
    return torch.promote_types(logits.dtype, torch.float32)


def _entropy(logits: Tensor) -> Tensor:
    logits = logits.to(_compute_dtype(logits))
    # Shifting by the max keeps logsumexp and Σ p·z small, so huge logits do not cancel catastrophically.
    shifted = logits - logits.max(dim=-1, keepdim=True).values.detach()
    lse = torch.logsumexp(shifted, dim=-1)
    probs = torch.softmax(shifted, dim=-1)
    return lse - (probs * shifted).sum(-1)


def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    r"""Entropy of softmax(z) along the last axis: :math:`H = \log\sum_v e^{z_v} - \sum_v p_v z_v`.

    ``logits`` (..., V) → (...). Computed in at least float32, after shifting by the max (stable for
    logits of any finite size). ``chunk_size`` processes that many positions (rows of the flattened
    leading axes) at a time to bound the temporary softmax memory; the result is the same.
    """
    if chunk_size is None:
        return _entropy(logits)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    chunks = [_entropy(part) for part in flat.split(chunk_size)]
    return torch.cat(chunks).reshape(logits.shape[:-1])


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    r"""Log-probability of each label: :math:`\log p(y) = z_y - \log\sum_v e^{z_v}`.

    ``logits`` (..., V), ``labels`` (...) int64 → (...), in at least float32. Gathers one logit per
    position and takes a log-sum-exp, so no (..., V) log-softmax copy is made.
    """
    logits = logits.to(_compute_dtype(logits))
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
