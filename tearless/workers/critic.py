"""The critic role: values for GAE and the clipped value-loss update.

A rank forwards it before advantages (:meth:`~tearless.workers.rank.Rank.compute_values`: the values
V(s_t) of the rollout-time critic); the update regresses the critic on the GAE returns with
:func:`tearless.algos.value_loss`, on the same epochs × mini-batches × micro-batches schedule as the
actor (:mod:`tearless.workers.schedule`), each rank running its share of the group's plan.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from tearless.algos import value_loss
from tearless.config.schema import CriticConfig
from tearless.models.copies import refresh_after
from tearless.models.value import response_values
from tearless.workers.optim import make_optimizer
from tearless.workers.schedule import UpdateFlags, UpdateSettings, attention_mask


class Critic:
    """A value model with its own AdamW, trained on ``returns`` with value clipping.

    ``resolved`` is the critic section with every null (inherit-from-actor) field already resolved
    (the plan's ``critic_section``, :func:`tearless.config.plan.critic_section`):
    ``ppo_mini_batch_size`` (prompts), ``ppo_micro_batch_size_per_gpu``, ``use_dynamic_bsz``,
    ``ppo_max_token_len_per_gpu``, ``ppo_epochs``, ``shuffle``, ``cliprange_value``, ``loss_agg_mode``,
    ``loss_scale_factor``, ``grad_clip``, ``forward_micro_batch_size_per_gpu`` and ``optim``;
    ``settings`` their update schedule (``UpdateSettings.of_section``), both built once from the resolved
    config.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        resolved: CriticConfig,
        *,
        settings: UpdateSettings,
        total_steps: int,
        remove_padding: bool = False,
    ) -> None:
        self.model = model
        self.remove_padding = remove_padding
        self.s = resolved
        self.settings = settings
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, resolved.optim, total_steps)
        refresh_after(self.optimizer, model)  # compute copies, where the model has them
        self.skipped_steps = 0

    def values(self, mb: TensorDict) -> torch.Tensor:
        """V(s_t) at each response position of the micro-batch, shape (B, R)."""
        return response_values(
            self.model,
            mb["prompt_ids"],
            mb["prompt_mask"],
            mb["response_ids"],
            attention_mask(mb),
            remove_padding=self.remove_padding,
        )

    def micro_loss(self, mb: TensorDict, norm: dict, flags: UpdateFlags) -> tuple[torch.Tensor, dict]:
        """One micro-batch's globally normalised clipped value loss (``norm``:
        :func:`~tearless.workers.schedule.mini_batch_norm`) and its metrics. ``flags`` is the
        update's (:class:`~tearless.workers.schedule.UpdateFlags`, the roles' one loss signature):
        the value loss reads none of them."""
        vpreds = self.values(mb)
        device = vpreds.device
        mask = mb["response_mask"].to(device)
        loss, metrics = value_loss(
            vpreds,
            mb["values"].to(device),
            mb["returns"].to(device),
            mask,
            self.s.cliprange_value,
            loss_agg_mode=self.s.loss_agg_mode,
            **norm,
        )
        share = mask.sum() / norm["global_num_tokens"]
        out = {"critic/vf_loss": loss.detach()}
        out.update({f"critic/{k}": v.detach() * share for k, v in metrics.items()})
        return loss, out


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 − Var(G − V) / Var(G) over valid tokens: 1 is a perfect critic, 0 no better than a constant."""
    m = mask.bool()
    g, v = returns[m].double(), values[m].double()
    if g.numel() < 2:
        return 0.0
    return float(1.0 - (g - v).var() / (g.var() + 1e-5))


def critic_value_stats(values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """``critic/values/{mean,max,min}`` over valid tokens (the rollout-time values)."""
    v = values[mask.bool()].float()
    return {
        "critic/values/mean": float(v.mean()),
        "critic/values/max": float(v.max()),
        "critic/values/min": float(v.min()),
    }
