r"""The Bradley–Terry loss of a scalar reward model trained on preference pairs.

The model gives each (prompt, response) a scalar :math:`r`. Under the Bradley–Terry model a human
prefers the chosen response with probability :math:`\sigma(r_c - r_r)`; the loss is the negative log
of that probability, with TRL's optional per-pair margin :math:`m` (Llama 2: a larger margin for a
stronger preference) and its centring term (Eisenstein et al. 2023, "Helping or Herding?", eq. 2),
which pulls the rewards towards mean zero without changing their differences' ranking.
Semantics follow TRL's ``RewardTrainer``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(
    chosen_rewards: Tensor,
    rejected_rewards: Tensor,
    *,
    margin: Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    r"""Mean loss over P pairs and per-pair statistics.

    .. math:: L = -\frac{1}{P}\sum_i \log\sigma(r_{c,i} - r_{r,i} - m_i)
              \;+\; c\,\frac{1}{P}\sum_i (r_{c,i} + r_{r,i})^2

    with :math:`m_i` the pair's margin (0 when ``margin`` is None) and :math:`c` the
    ``center_rewards_coefficient`` (no term when None; TRL recommends 0.01). Both terms are means
    over pairs, so a step's loss is the pair-weighted sum of its micro-batches' losses.

    Args:
        chosen_rewards, rejected_rewards: (P,) rewards of each pair's two responses.
        margin: (P,) or None.
        center_rewards_coefficient: c, or None.

    Returns:
        ``(loss, stats)``: the scalar loss and, each (P,), ``gap`` :math:`r_c - r_r` and ``correct``
        (1.0 where :math:`r_c > r_r`, ties count as wrong).
    """
    gap = chosen_rewards - rejected_rewards
    shifted = gap if margin is None else gap - margin
    loss = -F.logsigmoid(shifted).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((chosen_rewards + rejected_rewards) ** 2).mean()
    return loss, {"gap": gap.detach(), "correct": (gap > 0).to(torch.float32).detach()}
