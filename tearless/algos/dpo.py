r"""Paired preference losses (the DPO family), registered by kind in :data:`DPO_LOSSES`.

Inputs are per pair, shape (P,): the policy's and the frozen reference's log-probabilities of the
chosen (preferred) and the rejected response, each the **sum** over the response's tokens, and, for
the kinds that average per token, the responses' token counts :math:`L_c, L_r`. Notation used by every
kind (TRL's ``DPOTrainer`` semantics, ``trl/trainer/dpo_trainer.py``):

.. math::
    \ell_c = \log\pi(y_c) - \log\pi_{ref}(y_c), \quad \ell_r = \log\pi(y_r) - \log\pi_{ref}(y_r)
    \quad\text{(log-ratios)}

    c = f(\ell_c), \quad r = f(\ell_r), \quad h = c - r \quad\text{(scores and their margin)}

f is the identity for DPO's reverse KL (the default ``f_divergence``), or the f-DPO transform of
another divergence (:data:`F_DIVERGENCES`). ε is ``label_smoothing``, only for the kinds that take it
(robust, exo_pair, aot, aot_unpaired, cdpo, and the reference-free cpo/simpo): TRL ≥ 0.29 ignores it
for ``sigmoid``; here a nonzero value there is an error that names ``robust`` and ``cdpo``. Each
kind's docstring gives its per-pair loss; :func:`dpo_loss` returns their mean. The reference-free
kinds (``cpo``, ``simpo``, ``orpo``) live in :mod:`tearless.algos.preference` and register here too.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tearless.algos._registry import call_accepted, lookup, registrar

DPO_LOSSES: dict[str, Callable[..., Tensor]] = {}
register_dpo_loss = registrar(DPO_LOSSES, "DPO loss kind")

# Kinds that never read the reference (the trainer skips the reference pass for them), and kinds whose
# implicit reward is reported per token (β · log-prob / L) instead of summed, as TRL's CPO/ORPO do.
REFERENCE_FREE: set[str] = set()
PER_TOKEN_REWARD: set[str] = set()
# Inputs that exist only when token counts are given.
_NEEDS_LENGTHS = {"chosen_avg", "rejected_avg", "chosen_mean_logp", "rejected_mean_logp", "chosen_nll"}


def _f_reverse_kl(logratio: Tensor, alpha: float) -> Tensor:
    return logratio


def _f_forward_kl(logratio: Tensor, alpha: float) -> Tensor:
    # f'(u) = 1 − 1/u, constant dropped: −exp(−ℓ)
    return -torch.exp(-logratio)


def _f_js(logratio: Tensor, alpha: float) -> Tensor:
    # f'(u) = log(2u/(1+u)), log 2 dropped: log σ(ℓ)
    return F.logsigmoid(logratio)


def _f_alpha(logratio: Tensor, alpha: float) -> Tensor:
    # f'(u) = (u^(α−1) − 1)/(α − 1), constant dropped: exp((α−1)ℓ)/(α−1); α → 1 is reverse KL.
    if abs(alpha - 1.0) < 1e-6:
        return logratio
    return torch.exp(((alpha - 1.0) * logratio).clamp(max=80.0)) / (alpha - 1.0)


F_DIVERGENCES: dict[str, Callable[[Tensor, float], Tensor]] = {
    "reverse_kl": _f_reverse_kl,
    "forward_kl": _f_forward_kl,
    "js_divergence": _f_js,
    "alpha_divergence": _f_alpha,
}


def _smoothed(x: Tensor, label_smoothing: float) -> Tensor:
    r""":math:`-(1-\epsilon)\log\sigma(x) - \epsilon\log\sigma(-x)`: the logistic loss on labels flipped
    with probability ε."""
    return -(1.0 - label_smoothing) * F.logsigmoid(x) - label_smoothing * F.logsigmoid(-x)


@register_dpo_loss("sigmoid")
def dpo_sigmoid(h: Tensor, beta: float) -> Tensor:
    r"""DPO (Rafailov et al. 2023): :math:`-\log\sigma(\beta h)`."""
    return -F.logsigmoid(beta * h)


@register_dpo_loss("cdpo")
def dpo_conservative(h: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    r"""Conservative DPO (Mitchell 2023), TRL ≤ 0.28's ``sigmoid`` with label smoothing (not in TRL's
    current list): :math:`-(1-\epsilon)\log\sigma(\beta h) - \epsilon\log\sigma(-\beta h)`."""
    return _smoothed(beta * h, label_smoothing)


@register_dpo_loss("robust")
def dpo_robust(h: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    r"""Robust DPO (rDPO, Chowdhury et al. 2024), unbiased under labels flipped with probability ε:

    .. math:: \frac{-(1-\epsilon)\log\sigma(\beta h) + \epsilon\log\sigma(-\beta h)}{1 - 2\epsilon}
    """
    return (-(1.0 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) / (
        1.0 - 2.0 * label_smoothing
    )


@register_dpo_loss("hinge")
def dpo_hinge(h: Tensor, beta: float) -> Tensor:
    r"""SLiC hinge (Zhao et al. 2023): :math:`\max(0, 1 - \beta h)`."""
    return torch.relu(1.0 - beta * h)


@register_dpo_loss("ipo")
def dpo_ipo(chosen_avg: Tensor, rejected_avg: Tensor, beta: float) -> Tensor:
    r"""IPO (Azar et al. 2023) on per-token scores, as TRL (the IPO authors' reported results use it):

    .. math:: \left(\frac{c}{L_c} - \frac{r}{L_r} - \frac{1}{2\beta}\right)^2

    β is the paper's τ. With β = 0.1 the target margin is 5 nats per token.
    """
    return (chosen_avg - rejected_avg - 1.0 / (2.0 * beta)).square()


@register_dpo_loss("ipo_sum")
def dpo_ipo_sum(h: Tensor, beta: float) -> Tensor:
    r"""IPO on summed scores (tearless's ``ipo`` before it followed TRL; not in TRL):
    :math:`(h - \frac{1}{2\beta})^2`, a target margin of 1/(2β) nats per sequence whatever its length."""
    return (h - 1.0 / (2.0 * beta)).square()


@register_dpo_loss("sigmoid_norm")
def dpo_sigmoid_norm(chosen_avg: Tensor, rejected_avg: Tensor, beta: float) -> Tensor:
    r"""Length-normalised DPO: :math:`-\log\sigma\big(\beta(\frac{c}{L_c} - \frac{r}{L_r})\big)`."""
    return -F.logsigmoid(beta * (chosen_avg - rejected_avg))


@register_dpo_loss("exo_pair")
def dpo_exo_pair(h: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    r"""EXO-pref (Ji et al. 2024, eq. 16): KL(q‖p) between the policy's pair distribution
    :math:`q = (\sigma(\beta h), \sigma(-\beta h))` and the smoothed labels
    :math:`p = (1-\epsilon, \epsilon)`:

    .. math:: \sigma(\beta h)\,(\log\sigma(\beta h) - \log(1-\epsilon))
              + \sigma(-\beta h)\,(\log\sigma(-\beta h) - \log\epsilon)

    ε must be in (0, 1) (the paper recommends 1e-3).
    """
    if not 0.0 < label_smoothing < 1.0:
        raise ValueError(
            f"exo_pair needs label_smoothing in (0, 1) (the paper uses 1e-3), got {label_smoothing}"
        )
    x = beta * h
    return torch.sigmoid(x) * (F.logsigmoid(x) - math.log1p(-label_smoothing)) + torch.sigmoid(-x) * (
        F.logsigmoid(-x) - math.log(label_smoothing)
    )


@register_dpo_loss("nca_pair")
def dpo_nca_pair(chosen: Tensor, rejected: Tensor, beta: float) -> Tensor:
    r"""NCA (Chen et al. 2024), pairwise: absolute rather than relative likelihoods,

    .. math:: -\log\sigma(\beta c) - \tfrac12\log\sigma(-\beta c) - \tfrac12\log\sigma(-\beta r)
    """
    return (
        -F.logsigmoid(beta * chosen)
        - 0.5 * F.logsigmoid(-beta * chosen)
        - 0.5 * F.logsigmoid(-beta * rejected)
    )


@register_dpo_loss("bco_pair")
def dpo_bco_pair(chosen: Tensor, rejected: Tensor, beta: float) -> Tensor:
    r"""BCO (Jung et al. 2024) on pairs, a binary classifier of chosen vs rejected rewards (TRL's
    current form, without the running-mean shift δ): :math:`-\log\sigma(\beta c) - \log\sigma(-\beta r)`."""
    return -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected)


@register_dpo_loss("sppo_hard")
def dpo_sppo_hard(chosen: Tensor, rejected: Tensor, beta: float) -> Tensor:
    r"""SPPO (Wu et al. 2024) with hard win probabilities (1 for the chosen, 0 for the rejected):

    .. math:: \left(c - \frac{1}{2\beta}\right)^2 + \left(r + \frac{1}{2\beta}\right)^2
    """
    return (chosen - 0.5 / beta).square() + (rejected + 0.5 / beta).square()


@register_dpo_loss("aot")
def dpo_aot(policy_margin: Tensor, ref_margin: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    r"""AOT (Melnyk et al. 2024), paired: distributional alignment by optimal transport, i.e. the
    logistic loss of the **sorted** margins. With :math:`m = \log\pi(y_c) - \log\pi(y_r)` and
    :math:`m^{ref}` the reference's, each sorted ascending over the batch:

    .. math:: \delta_{(k)} = m_{(k)} - m^{ref}_{(k)}, \qquad
              -(1-\epsilon)\log\sigma(\beta\delta_{(k)}) - \epsilon\log\sigma(-\beta\delta_{(k)})

    Depends on the whole batch (sorting), so the trainer needs every pair of a step in one micro-batch.
    """
    delta = torch.sort(policy_margin).values - torch.sort(ref_margin).values
    return _smoothed(beta * delta, label_smoothing)


@register_dpo_loss("aot_unpaired")
def dpo_aot_unpaired(
    chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float, label_smoothing: float = 0.0
) -> Tensor:
    r"""AOT (Melnyk et al. 2024), unpaired: the chosen and rejected log-ratios are sorted separately,
    :math:`\delta_{(k)} = \ell_{c,(k)} - \ell_{r,(k)}`, then the smoothed logistic loss of aot."""
    delta = torch.sort(chosen_logratios).values - torch.sort(rejected_logratios).values
    return _smoothed(beta * delta, label_smoothing)


@register_dpo_loss("apo_zero")
def dpo_apo_zero(chosen_logratios: Tensor, rejected_logratios: Tensor, beta: float) -> Tensor:
    r"""APO-zero (D'Oosterlinck et al. 2024, eq. 7), for chosen answers better than the model's own:
    raise the chosen likelihood and lower the rejected one,
    :math:`1 - \sigma(\beta\ell_c) + \sigma(\beta\ell_r)`."""
    return 1.0 - torch.sigmoid(beta * chosen_logratios) + torch.sigmoid(beta * rejected_logratios)


@register_dpo_loss("apo_down")
def dpo_apo_down(h: Tensor, chosen_logratios: Tensor, beta: float) -> Tensor:
    r"""APO-down (D'Oosterlinck et al. 2024, eq. 8), for chosen answers worse than the model's own:
    lower both likelihoods, the rejected one more, :math:`\sigma(\beta\ell_c) + 1 - \sigma(\beta h)`."""
    return torch.sigmoid(beta * chosen_logratios) + 1.0 - torch.sigmoid(beta * h)


@register_dpo_loss("discopop")
def dpo_discopop(h: Tensor, beta: float, discopop_tau: float = 0.05) -> Tensor:
    r"""DiscoPOP (Chris Lu et al. 2024, eq. 5), the log-ratio modulated loss: with :math:`x = \beta h`
    and :math:`w = \sigma(x/\tau)`, :math:`(1 - w)(-\log\sigma(x)) + w\,e^{-x}`."""
    x = beta * h
    w = torch.sigmoid(x / discopop_tau)
    return (1.0 - w) * -F.logsigmoid(x) + w * torch.exp(-x)


@register_dpo_loss("sft")
def dpo_sft(chosen_nll: Tensor) -> Tensor:
    r"""Supervised term on the chosen responses: their negative log-likelihood averaged over every
    chosen token of the batch, :math:`-\sum_i \log\pi(y_{c,i}) / \sum_i L_{c,i}` (TRL's ``sft``, to be
    combined with another kind, e.g. RPO = sigmoid + sft)."""
    return chosen_nll


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    kind: str = "sigmoid",
    *,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    mean_chosen_length: float | None = None,
    f_divergence: str = "reverse_kl",
    f_alpha: float = 0.5,
    discopop_tau: float = 0.05,
    simpo_gamma: float = 0.5,
    cpo_alpha: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Mean preference loss over pairs, and the implicit rewards.

    Log-prob inputs are (P,) sums over each response's tokens; ``chosen_lengths`` /
    ``rejected_lengths`` (P,) are the token counts, needed by the kinds that average per token (ipo,
    sigmoid_norm, sft, simpo, orpo, and the NLL term of cpo). ``mean_chosen_length`` is the mean chosen
    length of the whole optimizer step, so that the token-mean NLL of ``sft``/``cpo``/``orpo`` stays the
    step's token mean when the trainer splits it into micro-batches (default: this batch's).

    Returns ``(loss, chosen_rewards, rejected_rewards)``: loss is the 0-d mean over pairs; rewards
    (P,) are detached, :math:`\beta\ell_c` and :math:`\beta\ell_r` (for the reference-free kinds
    β·log π, per token for simpo and orpo, as TRL logs them), for metrics such as reward accuracy.
    ``label_smoothing`` nonzero for a kind that does not take it raises ValueError.
    """
    fn = lookup(DPO_LOSSES, kind, "DPO loss kind")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    params = inspect.signature(fn).parameters
    if label_smoothing and "label_smoothing" not in params:
        takes = sorted(
            k for k, f in DPO_LOSSES.items() if "label_smoothing" in inspect.signature(f).parameters
        )
        hint = (
            " (TRL >= 0.29 ignores it for sigmoid: use kind 'robust' for robust DPO or 'cdpo' for "
            "conservative DPO, TRL <= 0.28's sigmoid with label smoothing)"
            if kind == "sigmoid"
            else ""
        )
        raise ValueError(
            f"label_smoothing is not defined for DPO loss kind {kind!r}{hint}; "
            f"kinds that take it: {', '.join(takes)}"
        )
    f = lookup(F_DIVERGENCES, f_divergence, "f-divergence")
    chosen_lr = policy_chosen_logps - ref_chosen_logps
    rejected_lr = policy_rejected_logps - ref_rejected_logps
    chosen, rejected = f(chosen_lr, f_alpha), f(rejected_lr, f_alpha)
    inputs: dict = {
        "h": chosen - rejected,
        "chosen": chosen,
        "rejected": rejected,
        "chosen_logratios": chosen_lr,
        "rejected_logratios": rejected_lr,
        "policy_margin": policy_chosen_logps - policy_rejected_logps,
        "ref_margin": ref_chosen_logps - ref_rejected_logps,
        "policy_chosen_logps": policy_chosen_logps,
        "policy_rejected_logps": policy_rejected_logps,
        "beta": beta,
        "label_smoothing": label_smoothing,
        "discopop_tau": discopop_tau,
        "simpo_gamma": simpo_gamma,
        "cpo_alpha": cpo_alpha,
    }
    needs_lengths = sorted(_NEEDS_LENGTHS & set(params))
    if needs_lengths:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                f"DPO loss kind {kind!r} averages log-probs per response token: pass chosen_lengths and "
                "rejected_lengths (token counts, (P,))"
            )
        lc = chosen_lengths.to(chosen.dtype).clamp(min=1.0)
        lr = rejected_lengths.to(chosen.dtype).clamp(min=1.0)
        norm = float(lc.mean()) if mean_chosen_length is None else max(float(mean_chosen_length), 1.0)
        inputs.update(
            chosen_avg=chosen / lc,
            rejected_avg=rejected / lr,
            chosen_mean_logp=policy_chosen_logps / lc,
            rejected_mean_logp=policy_rejected_logps / lr,
            chosen_nll=-policy_chosen_logps / norm,
        )
    losses = call_accepted(fn, inputs, f"DPO {kind!r}")
    if kind in PER_TOKEN_REWARD:
        chosen_r, rejected_r = inputs["chosen_mean_logp"], inputs["rejected_mean_logp"]
    elif kind in REFERENCE_FREE:
        chosen_r, rejected_r = policy_chosen_logps, policy_rejected_logps
    else:
        chosen_r, rejected_r = chosen_lr, rejected_lr
    return losses.mean(), (beta * chosen_r).detach(), (beta * rejected_r).detach()
