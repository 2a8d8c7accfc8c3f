r"""Reference-free paired losses (CPO, SimPO, ORPO) and the unpaired KTO family.

The paired ones register in :data:`tearless.algos.dpo.DPO_LOSSES` and are called through
:func:`~tearless.algos.dpo.dpo_loss` (which ignores the reference log-probs for them); notation as
there: :math:`\log\pi(y)` is a response's summed log-prob, :math:`\overline{\log\pi}(y) = \log\pi(y)/L`
its per-token mean, and NLL is the token-mean negative log-likelihood of the chosen responses of the
step. Semantics follow TRL's ``CPOTrainer`` and ``ORPOTrainer`` (``trl/experimental``) and
``KTOTrainer``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tearless.algos._registry import call_accepted, lookup, registrar
from tearless.algos.dpo import PER_TOKEN_REWARD, REFERENCE_FREE, _smoothed, register_dpo_loss

REFERENCE_FREE.update({"cpo", "simpo", "orpo"})
PER_TOKEN_REWARD.update({"simpo", "orpo"})


@register_dpo_loss("cpo")
def cpo(
    policy_margin: Tensor,
    chosen_nll: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    cpo_alpha: float | None = None,
) -> Tensor:
    r"""CPO (Xu et al. 2024): DPO without a reference on summed log-probs, plus a behaviour-cloning
    term on the chosen responses,

    .. math:: -(1-\epsilon)\log\sigma(\beta m) - \epsilon\log\sigma(-\beta m) + \alpha\,\mathrm{NLL},
              \qquad m = \log\pi(y_c) - \log\pi(y_r)

    α is ``cpo_alpha`` (null: 1.0, TRL's default).
    """
    alpha = 1.0 if cpo_alpha is None else cpo_alpha
    return _smoothed(beta * policy_margin, label_smoothing) + alpha * chosen_nll


@register_dpo_loss("simpo")
def simpo(
    chosen_mean_logp: Tensor,
    rejected_mean_logp: Tensor,
    chosen_nll: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    cpo_alpha: float | None = None,
) -> Tensor:
    r"""SimPO (Meng et al. 2024): per-token log-probs as the reward, a target margin γ, no reference,

    .. math:: -(1-\epsilon)\log\sigma(\beta x) - \epsilon\log\sigma(-\beta x) + \alpha\,\mathrm{NLL},
              \qquad x = \overline{\log\pi}(y_c) - \overline{\log\pi}(y_r) - \gamma/\beta

    γ is ``simpo_gamma``; α is ``cpo_alpha`` (null: 0, the paper's SimPO; TRL's CPOTrainer defaults
    to 1.0 for its ``simpo`` loss type, i.e. CPO-SimPO).
    """
    alpha = 0.0 if cpo_alpha is None else cpo_alpha
    x = chosen_mean_logp - rejected_mean_logp - simpo_gamma / beta
    return _smoothed(beta * x, label_smoothing) + alpha * chosen_nll


def log1mexp(x: Tensor) -> Tensor:
    r""":math:`\log(1 - e^x)` for x < 0, accurate at both ends (Mächler 2012): ``log(-expm1(x))`` near 0,
    ``log1p(-exp(x))`` below −log 2."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


@register_dpo_loss("orpo")
def orpo(chosen_mean_logp: Tensor, rejected_mean_logp: Tensor, chosen_nll: Tensor, beta: float) -> Tensor:
    r"""ORPO (Hong et al. 2024, eqs. 4-7): supervised NLL on the chosen responses plus λ times the
    log odds ratio, with per-token probabilities :math:`p = \exp\overline{\log\pi}(y)`:

    .. math:: \mathrm{NLL} - \lambda\log\sigma\Big(\log\frac{p_c}{1-p_c} - \log\frac{p_r}{1-p_r}\Big)

    λ is ``beta`` (TRL's ORPOConfig name; 0.1 there).
    """
    log_odds = (chosen_mean_logp - rejected_mean_logp) - (
        log1mexp(chosen_mean_logp) - log1mexp(rejected_mean_logp)
    )
    return chosen_nll - beta * F.logsigmoid(log_odds)


KTO_LOSSES: dict[str, Callable[..., Tensor]] = {}
register_kto_loss = registrar(KTO_LOSSES, "KTO loss kind")


@register_kto_loss("kto")
def kto(logratios: Tensor, desirable: Tensor, kl: Tensor, beta: float) -> Tensor:
    r"""KTO (Ethayarajh et al. 2024, eq. 7): a prospect-theory value of each response against the
    reference point z (the policy's KL to the reference, estimated from mismatched pairs):

    .. math:: 1 - \sigma(\beta(\ell - z)) \text{ if desirable}, \qquad
              1 - \sigma(\beta(z - \ell)) \text{ if not}

    with :math:`\ell = \log\pi(y) - \log\pi_{ref}(y)`.
    """
    return torch.where(
        desirable, 1.0 - torch.sigmoid(beta * (logratios - kl)), 1.0 - torch.sigmoid(beta * (kl - logratios))
    )


@register_kto_loss("apo_zero_unpaired")
def apo_zero_unpaired(logratios: Tensor, desirable: Tensor, beta: float) -> Tensor:
    r"""APO-zero (D'Oosterlinck et al. 2024) on unpaired data: :math:`1 - \sigma(\beta\ell)` for a
    desirable response, :math:`\sigma(\beta\ell)` for an undesirable one (no KL reference point)."""
    return torch.where(desirable, 1.0 - torch.sigmoid(beta * logratios), torch.sigmoid(beta * logratios))


@register_kto_loss("implicit_prm")
def implicit_prm(logratios: Tensor, desirable: Tensor, beta: float) -> Tensor:
    r"""PRIME's implicit PRM objective (Cui et al. 2025; Yuan et al. 2024, "Free process rewards
    without process labels"): cross-entropy of the outcome label against :math:`\sigma(\beta\ell)`,

    .. math:: -\log\sigma(\beta\ell) \text{ if desirable}, \qquad -\log\sigma(-\beta\ell) \text{ if not}

    A model so trained on outcome labels alone gives every token the process reward
    :math:`\beta\log\pi_\phi(y_t|y_{<t})/\pi_{ref}(y_t|y_{<t})` (read by
    :class:`tearless.rewards.prm.ProcessRewardScorer` with ``kind="implicit"``). Not a TRL loss type.
    """
    return -F.logsigmoid(torch.where(desirable, beta * logratios, -beta * logratios))


def kto_reference_point(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    r"""KTO's z: :math:`\max(0, \operatorname{mean}_j(\log\pi(y'_j|x_j) - \log\pi_{ref}(y'_j|x_j)))`
    over mismatched (prompt, response) pairs, detached (no gradient flows through the reference point)."""
    return (policy_kl_logps - ref_kl_logps).mean().clamp(min=0.0).detach()


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl: Tensor | float = 0.0,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kind: str = "kto",
) -> tuple[Tensor, Tensor]:
    r"""Mean unpaired preference loss and the implicit rewards.

    ``policy_logps``, ``ref_logps`` (N,) are summed response log-probs; ``desirable`` (N,) bool labels;
    ``kl`` is z from :func:`kto_reference_point` (ignored by ``apo_zero_unpaired``). Each response's loss
    is weighted by :math:`\lambda_D` (``desirable_weight``) or :math:`\lambda_U`
    (``undesirable_weight``) and the result is the mean over all N. Returns ``(loss, rewards)`` with
    rewards :math:`\beta\ell` (N,), detached.
    """
    fn = lookup(KTO_LOSSES, kind, "KTO loss kind")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    desirable = desirable.bool()
    logratios = policy_logps - ref_logps
    kl = torch.as_tensor(kl, dtype=logratios.dtype, device=logratios.device)
    inputs = {"logratios": logratios, "desirable": desirable, "kl": kl, "beta": beta}
    losses = call_accepted(fn, inputs, f"KTO {kind!r}")
    weights = torch.where(desirable, desirable_weight, undesirable_weight).to(losses.dtype)
    return (weights * losses).mean(), (beta * logratios).detach()
