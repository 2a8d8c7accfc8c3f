r"""Flow-GRPO (Liu et al. 2025): online GRPO for flow-matching generators, one epoch at a time.

Each epoch (:meth:`FlowGRPOTrainer.epoch`):

1. **rollout**: ``prompts_per_epoch`` prompts × ``group_size`` SDE samples of ``sample.num_steps`` steps,
   storing every latent and the log-prob of every step (:func:`~tearless.flow.sampler.sample_sde`);
2. **reward** per final sample;
3. **advantages** :math:`A_i = \mathrm{clip}\big((r_i - \bar r_{g(i)})/(\sigma + \epsilon), \pm A_{max}\big)`
   with σ the batch or per-prompt population std, as Flow-GRPO (:func:`tearless.algos.compute_advantage`,
   ``grpo``); samples with A = 0 (e.g. every sample of a group scored the same) carry no signal and are
   dropped;
4. **update**: ``updates_per_epoch`` mini-batches; for each trained step j the log-prob of the stored
   transition is recomputed under the current weights and the PPO-clipped surrogate of the per-step
   ratio :math:`\rho_j = \exp(\log\pi_\theta - \log\pi_{old})` is taken
   (:func:`tearless.algos.policy_loss`, ``vanilla``, no dual clip), plus β times the closed-form KL
   between the policy's and the reference's step Gaussians (:func:`tearless.algos.gaussian_kl`):

   .. math:: L = \frac{1}{|J|}\sum_{j \in J} \Big[\mathrm{mean}_i \max(-A_i\rho_{ij},
             -A_i\,\mathrm{clip}(\rho_{ij}, 1\pm\varepsilon)) + \beta\,\mathrm{mean}_i
             \frac{\|\mu_\theta - \mu_{ref}\|^2}{2 s_j^2}\Big]

   with :math:`s_j = \sigma_{t_j}\sqrt{h_j}` (``kl_variant=exact``) or :math:`\sigma_{t_j}`
   (``official``: Flow-GRPO's code since July 2025, i.e. the exact KL times h per step). AdamW,
   gradient clipping, optional EMA of the trained weights for evaluation.

Evaluation samples with the deterministic ODE (``sample.eval_num_steps``) from fixed noise, so every
evaluation of a run (and of runs with different settings) sees the same starting points.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tearless.algos import compute_advantage, gaussian_kl, policy_loss
from tearless.flow.config import FlowConfig
from tearless.flow.models import save_flow_model
from tearless.flow.sampler import (
    Trajectory,
    sample_ode,
    sample_sde,
    sigma_schedule,
    step_log_prob,
    step_params,
)
from tearless.flow.tasks import FlowTask, RewardFn, image_grid
from tearless.run.checkpoint import save_checkpoint
from tearless.trainers.progress import run_tracker
from tearless.workers.optim import adamw


def flow_advantages(
    rewards: Tensor, prompt_ids: Tensor, *, std_scope: str, epsilon: float, clip_max: float
) -> Tensor:
    r"""(B,) advantages :math:`\mathrm{clip}((r - \bar r_g)/(\sigma + \epsilon), -c, c)`: GRPO's
    estimator on one outcome per sample, σ per group or over the batch (``std_scope``).

    σ is the population std (÷ n), as Flow-GRPO's numpy ``std``, in both scopes; veRL's LLM GRPO (and
    ``algorithm.adv_estimator=grpo`` in ``tearless train``) divides by n − 1: with groups of 16 that σ
    is √(16/15) times this one, every advantage 3% smaller than Flow-GRPO's."""
    ones = torch.ones(len(rewards), 1, dtype=torch.bool)
    adv, _ = compute_advantage(
        "grpo",
        token_level_rewards=rewards.float().cpu()[:, None],
        response_mask=ones,
        index=prompt_ids.cpu(),
        epsilon=epsilon,
        std_scope=std_scope,
        unbiased_std=False,
    )
    return adv[:, 0].clamp(-clip_max, clip_max)


def clipped_step_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clipped surrogate of one denoising step, mean over the (B,) samples; the shared policy loss
    with a symmetric clip and no dual clip (Flow-GRPO has none)."""
    mask = torch.ones(len(log_prob), 1, dtype=torch.bool, device=log_prob.device)
    return policy_loss(
        "vanilla",
        old_log_prob=old_log_prob[:, None],
        log_prob=log_prob[:, None],
        advantages=advantages[:, None],
        response_mask=mask,
        clip_ratio_low=clip_range,
        clip_ratio_high=clip_range,
        clip_ratio_c=math.inf,
    )


class EMA:
    r"""Exponential moving average of parameters: :math:`\bar\theta \leftarrow d\bar\theta + (1-d)\theta`."""

    def __init__(self, params: list[nn.Parameter], decay: float):
        self.params, self.decay = params, decay
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self) -> None:
        for s, p in zip(self.shadow, self.params, strict=True):
            s.lerp_(p.detach(), 1.0 - self.decay)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Context in which the parameters hold the averages (restored on exit)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        for s, p in zip(self.shadow, self.params, strict=True):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)


class _MergedSaver:
    """``save_pretrained`` for the checkpoint writer: the policy with LoRA merged, as a flow-model
    directory (built-in models) or the model's own ``save_pretrained`` format."""

    def __init__(self, policy: nn.Module, meta: dict[str, Any]):
        self.policy, self.meta = policy, meta

    def save_pretrained(self, path: Path) -> None:
        model = copy.deepcopy(self.policy)
        if hasattr(model, "merge_and_unload"):
            model = model.merge_and_unload()
        if hasattr(model, "save_pretrained"):  # e.g. the SD3 adapter: a diffusers transformer directory
            model.save_pretrained(path)
        else:
            save_flow_model(model.cpu(), path, **self.meta)


class FlowGRPOTrainer:
    """Flow-GRPO on a task and a base velocity model; :meth:`fit` runs the epochs and returns a summary."""

    def __init__(
        self,
        cfg: FlowConfig,
        task: FlowTask,
        base_model: nn.Module,
        *,
        reward_fn: RewardFn | None = None,
        run_dir: str | Path | None = None,
        train_sigmas: Tensor | None = None,
        eval_sigmas: Tensor | None = None,
    ):
        """``train_sigmas`` / ``eval_sigmas`` (T+1,) replace the schedules built from ``sample.*``
        (e.g. a diffusers scheduler's, from :func:`~tearless.flow.models.scheduler_sigmas`)."""
        self.cfg, self.task = cfg, task
        t = cfg.trainer
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        want_cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda" if want_cuda else "cpu")
        self.reward_fn = reward_fn or task.reward
        self.run_dir = Path(
            run_dir or t.default_local_dir or Path("runs") / t.project_name / t.experiment_name
        )
        torch.manual_seed(t.seed)
        base_model = base_model.to(self.device).eval()
        tc = cfg.train
        self.ref: nn.Module | None = None
        if tc.lora:
            try:
                from peft import LoraConfig, get_peft_model
            except ImportError as e:
                raise ImportError("train.lora=true needs peft: pip install 'tearless[lora]'") from e
            lora = LoraConfig(
                r=tc.lora_rank, lora_alpha=tc.lora_alpha, target_modules=base_model.lora_targets()
            )
            self.policy = get_peft_model(base_model, lora)
        else:
            self.policy = base_model
            if tc.beta > 0:
                self.ref = copy.deepcopy(base_model).requires_grad_(False)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.opt = adamw(self.params, tc.lr, tc.betas, tc.weight_decay)
        self.ema = EMA(self.params, tc.ema_decay) if tc.ema else None
        self.train_sigmas = (
            sigma_schedule(cfg.sample.num_steps, cfg.shift()) if train_sigmas is None else train_sigmas
        )
        self.eval_sigmas = (
            sigma_schedule(cfg.sample.eval_num_steps, cfg.shift()) if eval_sigmas is None else eval_sigmas
        )
        if len(self.train_sigmas) != cfg.sample.num_steps + 1:
            raise ValueError(
                f"train_sigmas has {len(self.train_sigmas)} values but sample.num_steps="
                f"{cfg.sample.num_steps} needs {cfg.sample.num_steps + 1}"
            )
        self.trained_steps = cfg.trained_steps()
        stds = [step_params(self.train_sigmas, j, cfg.sample.noise_level).std for j in self.trained_steps]
        mean_std = sum(stds) / len(stds)
        self.step_weights = [s / mean_std if tc.noise_aware_weighting else 1.0 for s in stds]
        self.optimizer_steps = 0

    # ----------------------------------------------------------------------------- pieces

    @contextmanager
    def _reference(self) -> Iterator[nn.Module]:
        """The reference velocity model: the policy with its LoRA adapters disabled, or the frozen copy."""
        if self.ref is not None:
            yield self.ref
        else:
            with self.policy.disable_adapter():
                yield self.policy

    def _prompts(self, epoch: int) -> Tensor:
        """Round-robin prompts of ``epoch``, each repeated group_size times, (B,)."""
        tc = self.cfg.train
        first = epoch * tc.prompts_per_epoch
        ids = torch.arange(first, first + tc.prompts_per_epoch) % self.task.num_prompts
        return ids.repeat_interleave(tc.group_size)

    def rollout(self, prompt_ids: Tensor, generator: torch.Generator) -> Trajectory:
        s = self.cfg.sample
        ids = prompt_ids.to(self.device)
        noise = torch.randn(len(ids), *self.task.sample_shape, generator=generator).to(self.device)
        return sample_sde(
            self.policy,
            self.task.cond(ids),
            noise,
            self.train_sigmas,
            noise_level=s.noise_level,
            guidance_scale=s.guidance_scale,
            uncond=self.task.uncond(ids),
            generator=generator,
            reduce=s.log_prob_reduce,
        )

    def update(
        self, traj: Trajectory, prompt_ids: Tensor, advantages: Tensor, rows: Tensor
    ) -> dict[str, float]:
        """One optimizer step on the samples ``rows`` of the epoch's rollouts, every trained step."""
        s, tc = self.cfg.sample, self.cfg.train
        ids = prompt_ids[rows].to(self.device)
        cond, uncond = self.task.cond(ids), self.task.uncond(ids)
        adv = advantages[rows].to(self.device)
        sums = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "kl_loss": 0.0}
        self.opt.zero_grad(set_to_none=True)
        for j, weight in zip(self.trained_steps, self.step_weights, strict=True):
            p = step_params(self.train_sigmas, j, s.noise_level)
            x, next_x = traj.latents[rows, j], traj.latents[rows, j + 1]
            kwargs = {
                "guidance_scale": s.guidance_scale,
                "uncond": uncond,
                "reduce": s.log_prob_reduce,
                "model_dtype": traj.model_dtype,
            }
            log_prob, mean = step_log_prob(self.policy, x, next_x, cond, p, **kwargs)
            loss, metrics = clipped_step_loss(log_prob, traj.log_probs[rows, j], adv * weight, tc.clip_range)
            sums["pg_loss"] += loss.item()
            if tc.beta > 0:
                with torch.no_grad(), self._reference() as ref:
                    _, ref_mean = step_log_prob(ref, x, next_x, cond, p, **kwargs)
                kl_std = p.std if tc.kl_variant == "exact" else p.sigma
                kl = gaussian_kl(mean, ref_mean, kl_std, s.log_prob_reduce).mean()
                loss = loss + tc.beta * kl
                sums["kl_loss"] += kl.item()
            (loss / len(self.trained_steps)).backward()
            sums["pg_clipfrac"] += float(metrics["pg_clipfrac"])
            sums["ppo_kl"] += float(metrics["ppo_kl"])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip)
        if torch.isfinite(grad_norm):
            self.opt.step()
            self.optimizer_steps += 1
            if self.ema is not None and self.optimizer_steps % tc.ema_every == 0:
                self.ema.update()
        out = {f"actor/{k}": v / len(self.trained_steps) for k, v in sums.items()}
        out["actor/grad_norm"] = float(grad_norm)
        return out

    def epoch(self, epoch: int) -> dict[str, float]:
        """Rollout → reward → advantages → updates for one epoch; returns its metrics."""
        tc = self.cfg.train
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + epoch)
        start = time.perf_counter()
        prompt_ids = self._prompts(epoch)
        self.policy.eval()
        traj = self.rollout(prompt_ids, generator)
        rewards = self.reward_fn(traj.samples, prompt_ids.to(self.device)).float().cpu()
        if rewards.shape != prompt_ids.shape:
            raise ValueError(
                f"the reward function returned shape {tuple(rewards.shape)}, expected ({len(prompt_ids)},)"
            )
        adv = flow_advantages(
            rewards, prompt_ids, std_scope=tc.std_scope, epsilon=tc.adv_epsilon, clip_max=tc.adv_clip_max
        )
        if tc.shuffle_advantages:
            adv = adv[torch.randperm(len(adv), generator=generator)]
        keep = (adv != 0).nonzero().squeeze(-1)
        groups = rewards.view(-1, tc.group_size)
        metrics = {
            "reward/mean": float(rewards.mean()),
            "reward/std_per_prompt": float(groups.std(-1, correction=0).mean()),
            "reward/zero_std_ratio": float((groups.std(-1) == 0).float().mean()),
            "batch/kept_fraction": len(keep) / len(adv),
        }
        sums: dict[str, float] = {}
        n_updates = 0
        for _ in range(tc.inner_epochs):
            order = keep[torch.randperm(len(keep), generator=generator)]
            for rows in order.tensor_split(tc.updates_per_epoch):
                if len(rows) == 0:
                    continue
                for k, v in self.update(traj, prompt_ids, adv, rows).items():
                    sums[k] = sums.get(k, 0.0) + v
                n_updates += 1
        metrics.update({k: v / max(n_updates, 1) for k, v in sums.items()})
        metrics["timing_s/epoch"] = time.perf_counter() - start
        return metrics

    @torch.no_grad()
    def evaluate(self, samples_per_prompt: int | None = None) -> tuple[dict[str, float], Tensor, Tensor]:
        """ODE samples from fixed noise (EMA weights when train.ema); returns the task's metrics, the
        samples and their prompt ids."""
        s = self.cfg.sample
        n = samples_per_prompt or s.eval_samples_per_prompt
        generator = torch.Generator().manual_seed(12345)
        ids = torch.arange(self.task.num_prompts).repeat_interleave(n)
        noise = torch.randn(len(ids), *self.task.sample_shape, generator=generator).to(self.device)
        dev_ids = ids.to(self.device)
        self.policy.eval()
        with self.ema.swapped() if self.ema is not None else nullcontext():
            x = sample_ode(
                self.policy,
                self.task.cond(dev_ids),
                noise,
                self.eval_sigmas,
                guidance_scale=s.guidance_scale,
                uncond=self.task.uncond(dev_ids),
            )
        metrics = self.task.metrics(x.cpu(), ids)
        if self.reward_fn is not self.task.reward:
            metrics["reward"] = float(self.reward_fn(x, dev_ids).float().mean())
        return metrics, x.cpu(), ids

    # ----------------------------------------------------------------------------- the loop

    def fit(self) -> dict[str, Any]:
        """Run ``train.epochs`` epochs with evaluation and checkpoints; returns before/after metrics."""
        cfg, t = self.cfg, self.cfg.trainer
        total = cfg.train.epochs
        key_metrics = {"reward/mean": "reward", "val/reward": "val", "actor/kl_loss": "kl"}
        tracker = run_tracker(self.run_dir, cfg, total_steps=total, key_metrics=key_metrics)
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            before, before_x, ids = self.evaluate()
            tracker.log({f"val/{k}": v for k, v in before.items()}, 0)
            after = before
            for epoch in range(1, total + 1):
                metrics = self.epoch(epoch - 1)
                if epoch % t.test_freq == 0 or epoch == total:
                    after, after_x, _ = self.evaluate()
                    metrics.update({f"val/{k}": v for k, v in after.items()})
                metrics["timing_s/total"] = time.perf_counter() - start
                # CPU seconds of this process: what the run costs, whatever else shares the machine.
                metrics["timing_s/cpu_total"] = time.process_time() - cpu_start
                tracker.log(metrics, epoch)
                if epoch == total or (t.save_freq > 0 and epoch % t.save_freq == 0):
                    saver = _MergedSaver(self.policy, {"task": self.task.name, "epoch": epoch})
                    with self.ema.swapped() if self.ema is not None else nullcontext():
                        checkpoint = save_checkpoint(
                            self.run_dir,
                            epoch,
                            model=saver,
                            tokenizer=None,
                            state={"epoch": epoch, "optimizer": self.opt.state_dict()},
                        )
        finally:
            tracker.close()
        summary: dict[str, Any] = {
            "before": before,
            "after": after,
            "epochs": total,
            "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu_start,
            "run_dir": str(self.run_dir),
            "checkpoint": str(checkpoint),
        }
        if hasattr(self.task, "to_images"):
            summary["grid"] = str(self.before_after_grid(before_x, after_x, ids))
        return summary

    def before_after_grid(self, before: Tensor, after: Tensor, ids: Tensor, per_prompt: int = 12) -> Path:
        """PNG of ODE samples: for each prompt a row before training and the row after it."""
        rows = []
        for p in range(self.task.num_prompts):
            pick = (ids == p).nonzero().squeeze(-1)[:per_prompt]
            rows += [self.task.to_images(before[pick]).cpu(), self.task.to_images(after[pick]).cpu()]
        return image_grid(rows, self.run_dir / "samples_before_after.png")
