"""The critic role: values for GAE and the clipped value-loss update.

A rank forwards it before advantages (:meth:`~tearless.workers.rank.Rank.compute_values`: the values
V(s_t) of the rollout-time critic); the update regresses the critic on the GAE returns with
:func:`tearless.algos.value_loss`, on the same epochs × mini-batches × micro-batches schedule as the
actor (:mod:`tearless.workers.schedule`), each rank running its share of the group's plan.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from tensordict import TensorDict

from tearless.algos import value_loss
from tearless.config.derived import loss_scale_factor
from tearless.models.value import response_values
from tearless.workers.actor import make_optimizer
from tearless.workers.schedule import UpdateSettings, attention_mask


class Critic:
    """A value model with its own AdamW, trained on ``returns`` with value clipping.

    ``resolved`` is the critic section with every null (inherit-from-actor) field already resolved
    (:func:`critic_settings`):
    ``ppo_mini_batch_size`` (prompts), ``ppo_micro_batch_size_per_gpu``, ``use_dynamic_bsz``,
    ``ppo_max_token_len_per_gpu``, ``ppo_epochs``, ``shuffle``, ``cliprange_value``, ``loss_agg_mode``,
    ``loss_scale_factor``, ``grad_clip``, ``forward_micro_batch_size_per_gpu`` and ``optim``;
    ``settings`` their update schedule (:func:`update_settings`), both built once from the resolved
    config.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        resolved,
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

    def micro_loss(self, mb: TensorDict, norm: dict) -> tuple[torch.Tensor, dict]:
        """One micro-batch's globally normalised clipped value loss (``norm``:
        :func:`~tearless.workers.schedule.mini_batch_norm`) and its metrics."""
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


def update_settings(settings, rollout_n: int) -> UpdateSettings:
    """The schedule's view of the critic's resolved settings (:func:`critic_settings`)."""
    return UpdateSettings(
        rows_per_mini=settings.ppo_mini_batch_size * rollout_n,
        epochs=settings.ppo_epochs,
        shuffle=settings.shuffle,
        micro_size=settings.ppo_micro_batch_size_per_gpu,
        token_budget=settings.ppo_max_token_len_per_gpu if settings.use_dynamic_bsz else None,
        grad_clip=settings.grad_clip,
        prefix="critic",
        loss_scale_factor=settings.loss_scale_factor,
    )


def critic_settings(cfg) -> SimpleNamespace:
    """The ``critic`` config section with every null (inherit-from-actor) field resolved from the actor's."""
    c, a = cfg.critic, cfg.actor_rollout_ref.actor
    settings = SimpleNamespace(**{f.name: getattr(c, f.name) for f in dataclasses.fields(c)})
    for name in ("ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode", "use_dynamic_bsz"):
        if getattr(settings, name) is None:
            setattr(settings, name, getattr(a, name))
    if settings.loss_scale_factor is None:
        settings.loss_scale_factor = loss_scale_factor(cfg)
    return settings


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
