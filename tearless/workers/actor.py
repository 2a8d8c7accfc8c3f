"""The actor (policy) and reference workers of the single-process placement.

The actor owns the trained model, its AdamW optimizer and learning-rate schedule. ``update_policy``
is veRL's update: ``ppo_epochs`` passes over mini-batches of ``ppo_mini_batch_size × n`` responses,
each split into micro-batches (by count or by token budget) whose losses are normalised by the
mini-batch's global token and sequence counts, so accumulation gives exactly the gradient of the
whole mini-batch; one optimizer step per mini-batch, gradients clipped, a non-finite gradient norm
skips the step and is counted.

On-policy, responses whose advantages are all zero contribute exactly nothing to the gradient when
every loss term is a multiple of A_t (no entropy bonus, no KL loss, a policy loss in
:data:`LINEAR_IN_ADVANTAGE`): with ``skip_zero_adv_rows`` they are left out of the forward and backward
(GRPO groups whose rewards are all equal), their share of the normalisers kept, their entropy metric
taken from the rollout. The update is the same; only the float summation order changes.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable

import torch
from tensordict import TensorDict

from tearless.algos import agg_loss, kl_penalty, masked_mean, policy_loss
from tearless.config.derived import policy_loss_knobs
from tearless.config.schema import ActorConfig
from tearless.distributed.partition import mini_batch_norm
from tearless.models.logprobs import response_logprobs

# Policy losses whose per-token term is A_t times a factor: a zero advantage gives a zero loss and gradient.
LINEAR_IN_ADVANTAGE = ("vanilla", "gspo", "cispo")


def attention_mask(td: TensorDict) -> torch.Tensor:
    """The responses' attention mask: ``response_attention_mask`` when the batch has one (multi-turn
    rollouts, where tool output is attended to but masked from the loss), else ``response_mask``."""
    return td["response_attention_mask"] if "response_attention_mask" in td.keys() else td["response_mask"]


def micro_batches(
    td: TensorDict, *, size: int | None = None, token_budget: int | None = None
) -> list[TensorDict]:
    """Split ``td`` into consecutive micro-batches of ``size`` rows, or packed under ``token_budget``.

    The token count of a row is its real (unpadded) prompt + response length.
    """
    rows = td.batch_size[0]
    if token_budget is None:
        step = size or rows
        return [td[i : i + step] for i in range(0, rows, step)]
    lengths = (td["prompt_mask"].sum(-1) + attention_mask(td).sum(-1)).tolist()
    chunks, start, used = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and used + length > token_budget:
            chunks.append(td[start:i])
            start, used = i, 0
        used += length
    chunks.append(td[start:rows])
    return chunks


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
    """Forward-only log-probs of responses (the reference policy, or the actor's old log-probs)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        temperature: float,
        micro_batch_size: int | None = None,
        share_prompts: bool = True,
    ):
        self.model = model
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size
        self.share_prompts = share_prompts

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
        )

    def compute_log_prob(self, td: TensorDict, *, with_entropy: bool = False):
        """(B, R) log-probs (and entropy) of ``td``'s responses, in micro-batches.

        The forwards run under ``torch.inference_mode`` (no autograd bookkeeping at all); the results
        are copied out of it so that they can enter a loss later as constants.
        """
        was_training = self.model.training
        self.model.eval()
        outs, ents = [], []
        try:
            with torch.inference_mode(), self.forward_context():
                for mb in micro_batches(td, size=self.micro_batch_size):
                    lp, ent = self.forward(mb, with_entropy=with_entropy)
                    outs.append(lp.cpu())
                    if ent is not None:
                        ents.append(ent.cpu())
        finally:
            self.model.train(was_training)
        return torch.cat(outs).clone(), (torch.cat(ents).clone() if ents else None)

    def forward_context(self):
        """The context the forwards of :meth:`compute_log_prob` run in (a no-op here; the LoRA
        reference disables the adapters)."""
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
        rollout_n: int,
        temperature: float,
        total_steps: int,
        log_prob_micro_batch_size: int | None = None,
        share_prompts: bool = True,
        loss_scale_factor: float | None = None,
    ):
        super().__init__(
            model,
            temperature=temperature,
            micro_batch_size=log_prob_micro_batch_size,
            share_prompts=share_prompts,
        )
        self.cfg = cfg
        # seq-mean-token-sum-norm's S; None (and no cfg.loss_scale_factor): the mini-batch's padded width.
        self.loss_scale_factor = cfg.loss_scale_factor if loss_scale_factor is None else loss_scale_factor
        self.rollout_n = rollout_n
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(self.params, cfg.optim, total_steps)
        self.skipped_steps = 0

    def on_policy(self, num_prompts: int) -> bool:
        """One epoch over one mini-batch: the update's ratio is exactly 1, old log-probs are not needed."""
        return self.cfg.ppo_epochs == 1 and num_prompts == self.cfg.ppo_mini_batch_size

    def _micro_loss(self, mb: TensorDict, norm: dict, use_detached_old: bool) -> tuple[torch.Tensor, dict]:
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

    def skips_zero_adv_rows(self, num_prompts: int) -> bool:
        """Whether an update of ``num_prompts`` prompts leaves out responses with all-zero advantages:
        on-policy (the ratio and its metrics are exactly 1 and 0) and every loss term linear in A_t."""
        cfg = self.cfg
        return (
            cfg.skip_zero_adv_rows
            and self.on_policy(num_prompts)
            and cfg.entropy_coeff == 0
            and not cfg.use_kl_loss
            and cfg.policy_loss.loss_mode in LINEAR_IN_ADVANTAGE
        )

    def split_zero_adv_rows(self, mini: TensorDict, norm: dict) -> tuple[TensorDict, dict]:
        """The rows of ``mini`` with a non-zero advantage (at least one row), and the metrics the
        others add to the mini-batch's sums: the share skipped and their entropy (the rollout's when
        the batch carries ``rollout_entropy``, else from a forward without gradient). Their policy
        loss and its clip and KL metrics are exactly 0 on-policy: they add nothing there."""
        mask = mini["response_mask"]
        keep = ((mini["advantages"] * mask) != 0).any(-1)
        if not bool(keep.any()):
            keep[0] = True  # one row keeps the update's shape: its metrics, gradients of zero
        metrics = {"actor/zero_adv_rows_skipped": float((~keep).sum()) / len(keep)}
        if bool(keep.all()):
            return mini, metrics
        idle = mini[~keep]
        if "rollout_entropy" in idle.keys():
            entropy = idle["rollout_entropy"]
        else:
            entropy = self.compute_log_prob(idle, with_entropy=True)[1]
        idle_entropy = agg_loss(entropy, idle["response_mask"], self.cfg.loss_agg_mode, **norm)
        metrics["actor/entropy"] = float(idle_entropy)
        return mini[keep], metrics

    def update_policy(self, td: TensorDict, *, generator: torch.Generator | None = None) -> dict[str, float]:
        """Run the PPO epochs over ``td`` (one training step's responses); return averaged metrics."""
        cfg = self.cfg
        num_prompts = td.batch_size[0] // self.rollout_n
        use_detached_old = self.on_policy(num_prompts)
        out, self.skipped_steps = run_updates(
            self.model,
            td,
            lambda mb, norm: self._micro_loss(mb, norm, use_detached_old),
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            params=self.params,
            grad_clip=cfg.grad_clip,
            rows_per_mini=cfg.ppo_mini_batch_size * self.rollout_n,
            epochs=cfg.ppo_epochs,
            shuffle=cfg.shuffle,
            generator=generator,
            micro_size=cfg.ppo_micro_batch_size_per_gpu,
            token_budget=cfg.ppo_max_token_len_per_gpu if cfg.use_dynamic_bsz else None,
            prefix="actor",
            skipped=self.skipped_steps,
            drop_rows=self.split_zero_adv_rows if self.skips_zero_adv_rows(num_prompts) else None,
            loss_scale_factor=self.loss_scale_factor,
        )
        if cfg.use_kl_loss:
            out["actor/kl_coef"] = cfg.kl_loss_coef
        return out


def run_updates(
    model: torch.nn.Module,
    td: TensorDict,
    micro_loss,
    *,
    optimizer: torch.optim.Optimizer,
    scheduler,
    params: list[torch.nn.Parameter],
    grad_clip: float,
    rows_per_mini: int,
    epochs: int,
    shuffle: bool,
    generator: torch.Generator | None,
    micro_size: int | None,
    token_budget: int | None,
    prefix: str,
    skipped: int,
    drop_rows: Callable[[TensorDict, dict], tuple[TensorDict, dict]] | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[dict[str, float], int]:
    """veRL's update schedule, shared by actor and critic: ``epochs`` passes over mini-batches of
    ``rows_per_mini`` rows, each split into micro-batches whose losses ``micro_loss(mb, norm)`` are
    normalised by the mini-batch's global token and sequence counts (``norm``) and accumulated; one
    clipped optimizer step per mini-batch, skipped (and counted) when a micro-batch loss or the gradient
    norm is not finite: the parameters and the optimizer's moments and step count stay untouched.
    The scheduler steps once per call. ``drop_rows(mini, norm)``, when given, returns the rows of a
    mini-batch to forward (after the normalisers are taken from all of them) and the metrics the
    others add. ``loss_scale_factor`` goes into ``norm`` (:func:`mini_batch_norm`). Returns the metrics
    averaged over optimizer steps and the updated count of skipped steps.
    """
    model.train()
    rows = td.batch_size[0]
    sums: dict[str, float] = defaultdict(float)
    steps = 0
    for _ in range(epochs):
        order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
        for start in range(0, rows, rows_per_mini):
            mini = td[order[start : start + rows_per_mini]]
            norm = mini_batch_norm(mini["response_mask"], loss_scale_factor)
            optimizer.zero_grad(set_to_none=True)
            finite_loss = True
            if drop_rows is not None:
                mini, dropped = drop_rows(mini, norm)
                for k, v in dropped.items():
                    sums[k] += v
            for mb in micro_batches(
                mini, size=None if token_budget else micro_size, token_budget=token_budget
            ):
                loss, metrics = micro_loss(mb, norm)
                # A NaN loss can come with a finite gradient (from a term that does not reach the
                # parameters); the step is skipped either way.
                finite_loss = finite_loss and bool(torch.isfinite(loss.detach()))
                loss.backward()
                for k, v in metrics.items():
                    sums[k] += float(v)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
            if finite_loss and torch.isfinite(grad_norm):
                optimizer.step()
            else:
                skipped += 1
                optimizer.zero_grad(set_to_none=True)
            sums[f"{prefix}/grad_norm"] += float(grad_norm)
            steps += 1
    out = {k: v / steps for k, v in sums.items()}
    out[f"{prefix}/lr"] = optimizer.param_groups[0][
        "lr"
    ]  # the rate these steps used, before the schedule moves
    scheduler.step()
    out[f"{prefix}/skipped_steps"] = float(skipped)
    out[f"{prefix}/num_optimizer_steps"] = float(steps)
    return out, skipped


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
