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

import torch
from tensordict import TensorDict

from tearless.algos import agg_loss, kl_penalty, masked_mean, policy_loss
from tearless.algos.losses import LINEAR_IN_ADVANTAGE
from tearless.config.derived import policy_loss_knobs
from tearless.config.schema import ActorConfig
from tearless.models.copies import refresh_after
from tearless.models.logprobs import response_logprobs
from tearless.models.vision import pixel_kwargs
from tearless.workers.optim import make_optimizer
from tearless.workers.schedule import UpdateFlags, UpdateSettings, attention_mask


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
        entropy_chunking: bool | None = None,
        entropy_checkpointing: bool = False,
    ):
        self.model = model
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.share_prompts = share_prompts
        self.remove_padding = remove_padding
        self.fused_kernels = fused_kernels
        self.entropy_chunking = entropy_chunking
        self.entropy_checkpointing = entropy_checkpointing

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
            entropy_chunking=self.entropy_chunking,
            entropy_checkpointing=self.entropy_checkpointing,
            vision=pixel_kwargs(mb),
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
        section: ActorConfig,
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
            entropy_chunking=section.entropy_from_logits_with_chunking,
            entropy_checkpointing=section.entropy_checkpointing,
        )
        self.section = section  # actor_rollout_ref.actor: the loss knobs
        self.settings = settings  # its update schedule, built once from the resolved config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, section.optim, total_steps)
        refresh_after(self.optimizer, model)  # compute copies, where the model has them
        self.skipped_steps = 0

    def micro_loss(self, mb: TensorDict, norm: dict, flags: UpdateFlags) -> tuple[torch.Tensor, dict]:
        """One micro-batch's globally normalised loss and metrics: the policy loss, minus
        ``entropy_coeff`` × the entropy, plus ``kl_loss_coef`` × the KL to the reference (``norm``:
        the mini-batch's normalisers, :func:`~tearless.workers.schedule.mini_batch_norm`); π_old is
        the detached π_θ when ``flags.detached`` (on-policy: the ratio is exactly 1).

        The entropy (a pass over the whole vocabulary) is computed for the bonus, or for
        ``actor/entropy`` when ``calculate_entropy``; otherwise the metric is the sampler's
        entropy of the same tokens (``rollout_entropy``) where the batch has it."""
        cfg = self.section
        need_entropy = "grad" if cfg.entropy_coeff != 0 else cfg.calculate_entropy
        log_prob, entropy = self.forward(mb, with_entropy=need_entropy)
        device = log_prob.device
        mask = mb["response_mask"].to(device)
        old = log_prob.detach() if flags.detached else mb["old_log_prob"].to(device)
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
        if entropy is not None:
            ent_loss = agg_loss(entropy, mask, cfg.loss_agg_mode, **norm)
            metrics["actor/entropy"] = ent_loss.detach()
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * ent_loss
        elif "rollout_entropy" in mb.keys():
            sampled = mb["rollout_entropy"].to(device)
            metrics["actor/entropy"] = agg_loss(sampled, mask, cfg.loss_agg_mode, **norm)
        if cfg.use_kl_loss:
            kl = kl_penalty(log_prob, mb["ref_log_prob"].to(device), cfg.kl_loss_type)
            kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **norm)
            loss = loss + cfg.kl_loss_coef * kl_loss
            metrics["actor/kl_loss"] = kl_loss.detach()
        return loss, metrics


def skips_zero_adv_rows(cfg: ActorConfig, on_policy: bool) -> bool:
    """Whether an update leaves out responses with all-zero advantages: ``on_policy`` (the ratio and
    its metrics are exactly 1 and 0, :meth:`tearless.config.plan.RunPlan.on_policy`) and every loss
    term linear in A_t."""
    return (
        cfg.skip_zero_adv_rows
        and on_policy
        and cfg.entropy_coeff == 0
        and not cfg.use_kl_loss
        and cfg.policy_loss.loss_mode in LINEAR_IN_ADVANTAGE
    )


def reward_kl(old_log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor, kind: str) -> tuple:
    """Per-token KL for the in-reward penalty, and the batch KL for the controller (mean of seq means)."""
    kl = kl_penalty(old_log_prob, ref_log_prob, kind) * mask
    seq_kl = masked_mean(kl, mask, dim=-1)
    return kl, float(seq_kl.mean())
