r"""Direct preference optimisation losses, registered by kind in :data:`DPO_LOSSES`.

Inputs are summed log-probabilities of whole responses, shape (P,) for P preference pairs: the policy's
and the frozen reference's, for the chosen (preferred) and the rejected response. With

.. math:: h = (\log\pi(y_c) - \log\pi_{ref}(y_c)) - (\log\pi(y_r) - \log\pi_{ref}(y_r))

each kind maps (h, β) to a per-pair loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from tearless.algos._registry import call_accepted, lookup, registrar

DPO_LOSSES: dict[str, Callable[..., Tensor]] = {}
register_dpo_loss = registrar(DPO_LOSSES, "DPO loss kind")


@register_dpo_loss("sigmoid")
def dpo_sigmoid(h: Tensor, beta: float, label_smoothing: float = 0.0) -> Tensor:
    r"""DPO (Rafailov et al. 2023), conservative with label smoothing ε (Mitchell 2023):

    .. math:: -(1-\epsilon)\log\sigma(\beta h) - \epsilon\log\sigma(-\beta h)
    """
    return -(1.0 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)


@register_dpo_loss("ipo")
def dpo_ipo(h: Tensor, beta: float) -> Tensor:
    r"""IPO (Azar et al. 2023): :math:`(h - \frac{1}{2\beta})^2`, a squared loss that cannot saturate."""
    return (h - 1.0 / (2.0 * beta)).square()


@register_dpo_loss("hinge")
def dpo_hinge(h: Tensor, beta: float) -> Tensor:
    r"""SLiC hinge (Zhao et al. 2023): :math:`\max(0, 1 - \beta h)`."""
    return torch.relu(1.0 - beta * h)


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    kind: str = "sigmoid",
) -> tuple[Tensor, Tensor, Tensor]:
    r"""Mean preference loss over pairs, and the implicit rewards.

    All inputs (P,). Returns ``(loss, chosen_rewards, rejected_rewards)``: loss is the 0-d mean over
    pairs of the ``kind`` loss of h; rewards are :math:`\beta(\log\pi - \log\pi_{ref})` per pair,
    detached (for metrics such as reward accuracy and margin). ``label_smoothing`` applies to
    kinds that accept it (``sigmoid``); a nonzero value with another kind raises ValueError.
    """
    fn = lookup(DPO_LOSSES, kind, "DPO loss kind")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen = policy_chosen_logps - ref_chosen_logps
    rejected = policy_rejected_logps - ref_rejected_logps
    h = chosen - rejected
    if label_smoothing and "label_smoothing" not in inspect.signature(fn).parameters:
        raise ValueError(f"label_smoothing is not defined for DPO loss kind {kind!r}")
    losses = call_accepted(fn, {"h": h, "beta": beta, "label_smoothing": label_smoothing}, f"DPO {kind!r}")
    return losses.mean(), (beta * chosen).detach(), (beta * rejected).detach()
