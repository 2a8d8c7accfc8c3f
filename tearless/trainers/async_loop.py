"""The asynchronous RL pipeline (``async_training.enable``): generation runs ahead of training.

Policy versions. Version v is the policy after v actor updates; the weights a step s updates from are
version V_s (s − 1 when every step so far updated the actor). A generation call submitted while the
driver's policy is at version v samples with version v: the generating ranks run their calls in
submission order, and in the split placement the weights of every update are broadcast to them
right after it (:meth:`~tearless.workers.group.WorkerGroup.sync_weights`, queued behind the
generation calls submitted before), so that the rollout workers hold version v when they reach a call
submitted at v. Each sample records its version; its staleness at step s is V_s − v.

Schedule, with k = ``async_training.max_staleness``. Before training step s, the generation calls of
steps s … s + k are submitted (those not submitted yet), each on the prompts and sampling keys the
synchronous loop would give that step; step s then waits for its own batch and trains on it while the
rollout workers generate the next ones. A call for step t is submitted at step t − k with version
V_{t−k} ≥ V_t − k, so staleness never exceeds k on this schedule; samples older than k (an injected
batch, or any future producer) are dropped by whole prompt groups and counted
(``async/dropped_frac``), and a step left with none regenerates its batch with the current weights.
With k = 0 each call is submitted and awaited inside its own step: exactly the synchronous loop.

Partial rollouts (``async_training.partial_rollout``): a split rollout worker takes each broadcast
between two tokens of the call it is running and continues its responses under the new weights
(:meth:`~tearless.workers.rank.Rank.take_new_weights`); each token records its version
(``token_versions``) and a response's version is its oldest token's (:func:`response_versions`).

Every batch is a whole generation call: a prompt's ``n`` responses complete (and are scored) before
they are trained on (GRPO groups); values for GAE come from the critic of the step that trains on
them (:meth:`RLTrainer.forward_passes` runs at that step). The policy-lag correction is the rollout
correction (:mod:`tearless.algos.offpolicy`): with stale samples the rollout's log-probs are the
behaviour policy and π_old, recomputed by the trainer, the proximal one (decoupled PPO).

Resume. Samples in flight at a checkpoint are not in it: the checkpoint counts only the prompt
batches of steps already trained, so a resumed run draws the in-flight prompts again for the same
steps and regenerates them with the restored weights (never training on a sample twice). The resumed
run is therefore not bit-identical to an uninterrupted one when k > 0.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch

from tearless import faults
from tearless.rollout.seeds import prompt_keys
from tearless.run.timer import Timer
from tearless.trainers.collect import select
from tearless.workers.group import Rollout


@dataclass
class Batch:
    """One step's generation call: the step it is for, the policy version it samples with, its
    prompts and the worker group's pending call; or an already generated ``rollout`` with each
    row's policy version in ``versions`` (B,) (rows may differ, e.g. a batch handed in from elsewhere)."""

    step: int
    version: int
    prompts: list[dict]
    pending: Any = None
    rollout: Rollout | None = None
    versions: torch.Tensor | None = None


def fresh_groups(
    versions: torch.Tensor, current: int, max_staleness: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to keep and each row's staleness: ``versions`` (B,) holds each sample's policy version,
    rows in groups of ``n`` (a prompt's responses); a group is kept when all its samples are at most
    ``max_staleness`` versions behind ``current``. Returns (kept row indices, staleness (B,))."""
    staleness = current - versions
    if (staleness < 0).any():
        newest = int(versions.max())
        raise ValueError(f"a sample's policy version {newest} is newer than the policy ({current})")
    fresh = (staleness <= max_staleness).view(-1, n).all(-1).repeat_interleave(n)
    return fresh.nonzero().squeeze(-1), staleness


def response_versions(
    token_versions: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Each response's policy version, that of its oldest token (its staleness bound), from the
    (B, R) versions of its tokens; and the partial-rollout metrics: ``async/partial_frac`` (responses
    whose tokens come from more than one version: continued under new weights) and
    ``async/resumed_token_frac`` (tokens drawn with a newer version than their response's first)."""
    mask = response_mask.bool()
    big = torch.iinfo(token_versions.dtype).max
    oldest = torch.where(mask, token_versions, big).min(-1).values
    newest = torch.where(mask, token_versions, -1).max(-1).values
    resumed = mask & (token_versions > oldest[:, None])
    metrics = {
        "async/partial_frac": int((newest > oldest).sum()) / len(oldest),
        "async/resumed_token_frac": int(resumed.sum()) / max(1, int(mask.sum())),
    }
    return oldest, metrics


def staleness_metrics(staleness: torch.Tensor, kept: torch.Tensor, max_staleness: int) -> dict[str, float]:
    """``async/staleness_mean`` and ``_max`` over the trained samples, ``async/staleness_count/<s>``
    (trained samples of staleness s, for s = 0 … max_staleness), ``async/dropped`` and
    ``async/dropped_frac`` (samples too old, of all the step's samples)."""
    trained = staleness[kept]
    counts = Counter(trained.tolist())
    total = staleness.numel()
    metrics = {
        "async/staleness_mean": float(trained.float().mean()) if trained.numel() else 0.0,
        "async/staleness_max": float(trained.max()) if trained.numel() else 0.0,
        "async/dropped": float(total - trained.numel()),
        "async/dropped_frac": (total - trained.numel()) / total,
    }
    for s in range(max_staleness + 1):
        metrics[f"async/staleness_count/{s}"] = float(counts.get(s, 0))
    return metrics


class AsyncPipeline:
    """The generation calls in flight for a trainer (see the module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.max_staleness = trainer.cfg.async_training.max_staleness
        self.queue: deque[Batch] = deque()
        self.submitted = 0  # the last step whose generation call was submitted

    def in_flight(self) -> int:
        """Generation calls submitted and not trained on yet (their prompts are not in a checkpoint)."""
        return len(self.queue)

    def _submit(self, step: int, prompts: list[dict] | None = None) -> Batch:
        trainer = self.trainer
        cfg = trainer.cfg
        rollout_cfg = cfg.actor_rollout_ref.rollout
        prompts = trainer._next_prompts() if prompts is None else prompts
        faults.point("rollout", step)
        keys = prompt_keys(cfg.trainer.seed, step, 0, len(prompts))  # the synchronous loop's keys
        faults.point("reward", step)
        pending = trainer.workers.submit_generate(
            prompts,
            n=rollout_cfg.n,
            keys=keys,
            max_new_tokens=trainer.response_length,
            temperature=rollout_cfg.temperature,
            top_p=rollout_cfg.top_p,
            top_k=rollout_cfg.top_k,
            version=trainer.policy_version,
        )
        return Batch(step=step, version=trainer.policy_version, prompts=prompts, pending=pending)

    def collect(self, step: int, timer: Timer) -> tuple[Rollout, list[str], dict[str, float]]:
        """Step ``step``'s batch, with the samples too old for it dropped, after submitting the
        generation calls of the next ``max_staleness`` steps; (rollout, uid per response, metrics)."""
        trainer = self.trainer
        last = min(step + self.max_staleness, trainer.total_steps)
        while self.submitted < last:
            self.submitted = max(self.submitted + 1, step)
            self.queue.append(self._submit(self.submitted))
        batch = self.queue.popleft()
        assert batch.step == step, f"the generation call of step {batch.step} came up at step {step}"
        start = time.perf_counter()
        rollout = batch.rollout or trainer.workers.wait_generate(batch.pending)
        waited = time.perf_counter() - start
        n = trainer.cfg.actor_rollout_ref.rollout.n
        versions = batch.versions
        metrics: dict[str, float] = {}
        if versions is None and rollout.out.token_versions is not None:
            versions, metrics = response_versions(rollout.out.token_versions, rollout.out.response_mask)
        if versions is None:
            versions = torch.full((len(rollout.items),), batch.version, dtype=torch.long)
        kept, staleness = fresh_groups(versions, trainer.policy_version, self.max_staleness, n)
        metrics.update(staleness_metrics(staleness, kept, self.max_staleness))
        if kept.numel() == 0:  # every sample too old: this step's prompts again, with today's weights
            retry = self._submit(step, batch.prompts)
            start = time.perf_counter()
            rollout = trainer.workers.wait_generate(retry.pending)
            waited += time.perf_counter() - start
            kept = torch.arange(len(rollout.items))
        elif kept.numel() < len(rollout.items):
            rollout = select(rollout, kept)
        for name, seconds in rollout.seconds.items():
            timer.seconds[name] += seconds
        timer.seconds["wait_rollout"] += waited
        timer.seconds["train_idle"] += waited
        uids = [f"{step}-1-{int(i) // n}" for i in kept]
        metrics["async/policy_version"] = float(trainer.policy_version)
        return rollout, uids, {**rollout.metrics, **metrics}

    def sync_idle(self, timer: Timer, received: float) -> None:
        """Add to ``timing_s/train_idle`` the part of the weight sync spent waiting for the rollout
        workers to finish the generation calls ahead of it (its wall time minus their copying).
        With partial rollouts they take the weights at their next token: nothing is added."""
        if not self.trainer.cfg.async_training.partial_rollout:
            timer.seconds["train_idle"] += max(0.0, timer.seconds["update_weights"] - received)
