"""The actor (policy) and reference roles: losses and forwards over one model, in any placement.

The actor owns the trained model, its AdamW optimizer and learning-rate schedule; its update follows
the one schedule of :mod:`tearless.workers.schedule` (``ppo_epochs`` passes over mini-batches of
``ppo_mini_batch_size × n`` responses, micro-batched, globally normalised, one clipped optimizer
step per mini-batch, non-finite steps skipped and counted). A rank of a worker group holds these same
objects over its (possibly FSDP2-sharded) model.

On-policy, responses whose advantages are all zero contribute exactly nothing to the gradient when
every loss term is a multiple of A_t (no entropy bonus, no KL loss, a policy loss registered as linear
in the advantage: :data:`~tearless.algos.losses.LINEAR_IN_ADVANTAGE`): with ``skip_zero_adv_rows``
they are left out of the forward and backward (GRPO groups whose rewards are all equal), their share
of the normalisers kept, their entropy metric taken from the rollout. The update is the same; only
the float summation order changes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
from tensordict import TensorDict

from tearless.algos import agg_loss, kl_penalty, masked_mean, policy_loss
from tearless.algos.groups import num_groups
from tearless.algos.losses import LINEAR_IN_ADVANTAGE
from tearless.config.derived import on_policy, policy_loss_knobs
from tearless.config.schema import ActorConfig
from tearless.models.logprobs import response_logprobs
from tearless.workers.schedule import UpdateSettings, attention_mask, scheduled_update, skipped_rows_metrics


def lr_lambda(total_steps: int, warmup_steps: int, kind: str, min_lr_ratio: float, num_cycles: float):
    """Multiplier of the base lr at scheduler step s: linear warm-up, then constant or cosine."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * num_cycles * progress))
        return min_lr_ratio + (1.0 - min_lr_ratio) * max(0.0, cosine)

    return f


class LogProbWorker:
    """Log-probs of responses under one model (the reference policy, or the actor's old log-probs):
    the forward of one micro-batch; a rank runs this role's share of a batch through it."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        temperature: float,
        micro_batch_size: int | None = None,
        share_prompts: bool = True,
        remove_padding: bool = False,
        fused_kernels: bool = False,
    ):
        self.model = model
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.share_prompts = share_prompts
        self.remove_padding = remove_padding
        self.fused_kernels = fused_kernels

    def forward(self, mb: TensorDict, *, with_entropy: bool | str = False):
        """Log-probs (and entropy) of one micro-batch's responses, with gradient if enabled."""
        return response_logprobs(
            self.model,
            mb["prompt_ids"],
            mb["prompt_mask"],
            mb["response_ids"],
            attention_mask(mb),
            temperature=self.temperature,
            with_entropy=with_entropy,
            share_prompts=self.share_prompts,
            remove_padding=self.remove_padding,
            fused_kernels=self.fused_kernels,
        )

    def forward_context(self):
        """The context a rank runs this role's forward-only passes in
        (:meth:`~tearless.workers.rank.Rank.compute_log_prob`; a no-op here, the LoRA reference
        disables the adapters)."""
        return contextlib.nullcontext()


class AdapterOffLogProbWorker(LogProbWorker):
    """The reference policy of a LoRA actor: the actor's own model with its adapters disabled,
    π_ref = π_W with W the frozen base weights (no second copy of them)."""

    def forward_context(self):
        return self.model.disable_adapter()


class Actor(LogProbWorker):
    """The trained policy: PPO-family updates with the losses of :mod:`tearless.algos`."""

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: ActorConfig,
        *,
        settings: UpdateSettings,
        temperature: float,
        total_steps: int,
        log_prob_micro_batch_size: int | None = None,
        share_prompts: bool = True,
        remove_padding: bool = False,
        fused_kernels: bool = False,
    ):
        super().__init__(
            model,
            temperature=temperature,
            micro_batch_size=log_prob_micro_batch_size,
            share_prompts=share_prompts,
            remove_padding=remove_padding,
            fused_kernels=fused_kernels,
        )
        self.cfg = cfg
        self.settings = settings  # its update schedule, built once from the resolved config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, cfg.optim, total_steps)
        self.skipped_steps = 0

    def micro_loss(self, mb: TensorDict, norm: dict, use_detached_old: bool) -> tuple[torch.Tensor, dict]:
        """One micro-batch's globally normalised loss and metrics: the policy loss, minus
        ``entropy_coeff`` × the entropy, plus ``kl_loss_coef`` × the KL to the reference (``norm``:
        the mini-batch's normalisers, :func:`~tearless.workers.schedule.mini_batch_norm`); π_old is
        the detached π_θ when ``use_detached_old`` (on-policy: the ratio is exactly 1)."""
        cfg = self.cfg
        need_entropy = "grad" if cfg.entropy_coeff != 0 else True
        log_prob, entropy = self.forward(mb, with_entropy=need_entropy)
        device = log_prob.device
        mask = mb["response_mask"].to(device)
        old = log_prob.detach() if use_detached_old else mb["old_log_prob"].to(device)
        low = cfg.clip_ratio if cfg.clip_ratio_low is None else cfg.clip_ratio_low
        high = cfg.clip_ratio if cfg.clip_ratio_high is None else cfg.clip_ratio_high
        pg_loss, pg_metrics = policy_loss(
            cfg.policy_loss.loss_mode,
            old_log_prob=old,
            log_prob=log_prob,
            advantages=mb["advantages"].to(device),
            response_mask=mask,
            clip_ratio_low=low,
            clip_ratio_high=high,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode=cfg.loss_agg_mode,
            rollout_is_weights=mb.get("rollout_is_weights", None),
            **policy_loss_knobs(cfg),
            **norm,
        )
        loss = pg_loss
        metrics = {"actor/pg_loss": pg_loss.detach()}
        share = mask.sum() / norm["global_num_tokens"]  # this micro-batch's share of the mini-batch's tokens
        for name, value in pg_metrics.items():
            metrics[f"actor/{name}"] = value.detach() * share
        ent_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **norm)
        metrics["actor/entropy"] = ent_loss.detach()
        if cfg.entropy_coeff != 0:
            loss = loss - cfg.entropy_coeff * ent_loss
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, mb["ref_log_prob"].to(device), cfg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics


def skips_zero_adv_rows(cfg: ActorConfig, num_prompts: int) -> bool:
    """Whether an update of ``num_prompts`` prompts leaves out responses with all-zero advantages:
    on-policy (the ratio and its metrics are exactly 1 and 0) and every loss term linear in A_t."""
    return (
        cfg.skip_zero_adv_rows
        and on_policy(cfg, num_prompts)
        and cfg.entropy_coeff == 0
        and not cfg.use_kl_loss
        and cfg.policy_loss.loss_mode in LINEAR_IN_ADVANTAGE
    )


def actor_settings(cfg: ActorConfig, rollout_n: int, loss_scale_factor: float) -> UpdateSettings:
    """The schedule's view of an actor config section (with seq-mean-token-sum-norm's constant S)."""
    return UpdateSettings(
        rows_per_mini=cfg.ppo_mini_batch_size * rollout_n,
        epochs=cfg.ppo_epochs,
        shuffle=cfg.shuffle,
        micro_size=cfg.ppo_micro_batch_size_per_gpu,
        token_budget=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
        grad_clip=cfg.grad_clip,
        prefix="actor",
        loss_scale_factor=loss_scale_factor,
    )


def policy_update(
    cfg: ActorConfig,
    settings: UpdateSettings,
    td: TensorDict,
    world: int,
    run_ranks: Callable,
    *,
    generator: torch.Generator | None,
    entropy_of: Callable[[TensorDict], torch.Tensor],
) -> dict[str, float]:
    """The actor's update in any placement (:func:`~tearless.workers.schedule.scheduled_update`):
    on-policy, rows whose advantages are all zero are left out when their gradient is exactly zero
    (:func:`skips_zero_adv_rows`), their entropy metric taken from the sampler (``rollout_entropy``)
    or, without it, from ``entropy_of(rows)``."""
    skip, skip_metrics = None, None
    if skips_zero_adv_rows(cfg, num_groups(td["uid_index"])):
        skip = ~((td["advantages"] * td["response_mask"]) != 0).any(-1)

        def entropy(rows: TensorDict) -> torch.Tensor:
            return rows["rollout_entropy"] if "rollout_entropy" in rows.keys() else entropy_of(rows)

        def skip_metrics(plans):
            return skipped_rows_metrics(td, plans, cfg.loss_agg_mode, entropy)

    out = scheduled_update(
        td,
        settings,
        world,
        run_ranks,
        generator=generator,
        skip_rows=skip,
        skip_metrics=skip_metrics,
    )
    if cfg.use_kl_loss:
        out["actor/kl_coef"] = cfg.kl_loss_coef
    return out


def make_optimizer(params: list[torch.nn.Parameter], optim_cfg, total_steps: int):
    """AdamW and its warm-up + constant/cosine schedule from an ``optim`` config section.

    AdamW is torch's fused implementation (one kernel over every tensor instead of about ten ops per
    tensor) where it exists: plain (unsharded) floating-point parameters on CPU or CUDA."""
    optimizer = torch.optim.AdamW(
        params,
        lr=optim_cfg.lr,
        weight_decay=optim_cfg.weight_decay,
        betas=tuple(optim_cfg.betas),
        fused=can_fuse(params) or None,
    )
    warmup = optim_cfg.lr_warmup_steps
    if warmup < 0:
        warmup = int(optim_cfg.lr_warmup_steps_ratio * total_steps)
    schedule = lr_lambda(
        total_steps, warmup, optim_cfg.lr_scheduler_type, optim_cfg.min_lr_ratio, optim_cfg.num_cycles
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def can_fuse(params: list[torch.nn.Parameter]) -> bool:
    """Whether torch's fused AdamW can step ``params``: floating point, on CPU or CUDA, not DTensors
    (FSDP2 shards)."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") and not isinstance(p, DTensor)
        for p in params
    )


def reward_kl(old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor, kind: str) -> tuple:
    """Per-token KL for the in-reward penalty, and the batch KL for the controller (mean of seq means)."""
    kl = kl_penalty(old_log_prob, ref_log_prob, kind) * mask
    seq_kl = masked_mean(kl, mask, dim=-1)
    return kl, float(seq_kl.mean())
