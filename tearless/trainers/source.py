"""The one source of training batches: the synchronous loop (k = 0) and the asynchronous one (k > 0).

Prompts and their identity. :class:`PromptDraw` hands out the loader's batches one after another; each
prompt gets its ``uid`` when it is drawn (``"{step}-{round}-{j}"``: step, generation round of that
step, place in the drawn batch). Its ``n`` responses carry it, and every selection, filter and
grouping after that goes by it (:mod:`tearless.algos.groups`).

Policy versions. Version v is the policy after v actor updates; the weights a step s updates from are
version V_s. A generation call submitted while the driver's policy is at version v samples with
version v: the generating ranks run their calls in submission order, and in the split placement the
weights of every update are broadcast to them right after it
(:meth:`~tearless.workers.group.WorkerGroup.sync_weights`, queued behind the generation calls
submitted before), so that the rollout workers hold version v when they reach a call submitted at v.
Each sample records its version; its staleness at step s is V_s − v.

Schedule, with k = ``async_training.max_staleness`` (0 without ``async_training.enable``). Before
step s, the first-round generation calls of steps s … s + k not submitted yet are submitted, each on
the next prompts and the sampling keys (seed, step, round) of :mod:`tearless.rollout.seeds`; step s
then waits for its own call and trains on it while the rollout workers generate the next ones. A call
for step t is submitted at step t − k with version V_{t−k} ≥ V_t − k, so staleness never exceeds k
on this schedule; samples older than k (an injected batch, or any future producer) are dropped by
whole prompt groups and counted (``async/dropped_frac``), and a step left with none regenerates its
prompts with the current weights. With k = 0 each call is submitted and awaited inside its own step:
the synchronous loop, bit for bit.

Dynamic sampling (``algorithm.filter_groups``, DAPO): groups whose scores are all equal carry no
GRPO signal and are dropped; further rounds are drawn, submitted and awaited inside the step (with
the current weights, staleness 0) until ``data.train_batch_size`` groups are kept or
``max_num_gen_batches`` rounds have run. ReMax: each generation call is followed by its prompts'
greedy call, submitted right behind it, so the baseline comes from the weights that sampled the
responses (with partial rollouts, a broadcast may land between the two: the baseline is then one
version newer).

Partial rollouts (``async_training.partial_rollout``): a split rollout worker takes each broadcast
between two tokens of the call it is running (:meth:`~tearless.workers.rank.Rank.take_new_weights`);
each token records its version and a response's version is its oldest token's
(:func:`response_versions`).

Resume. Samples in flight at a checkpoint are not in it: the checkpoint's loader position is that
of the first batch drawn for a call not trained on yet (:meth:`BatchSource.resume_position`), so a
resumed run draws the in-flight prompts again and regenerates them with the restored weights. With
k > 0 the resumed run is therefore not bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tearless import faults
from tearless.algos import filter_groups
from tearless.algos.groups import first_groups, groups_within, num_groups
from tearless.config.plan import SourceSettings
from tearless.data import PromptLoader
from tearless.rollout.batch import Rollout, concat
from tearless.rollout.seeds import prompt_keys
from tearless.run.timer import Timer


class PromptDraw:
    """The loader's batches in order, ``position`` batches consumed so far (checkpointed); each
    prompt is given its ``uid`` when drawn."""

    def __init__(self, loader: PromptLoader, position: int = 0) -> None:
        self.loader, self.position = loader, position

    def draw(self, step: int, round_: int) -> tuple[list[dict], int]:
        """The next batch, each prompt with ``uid`` ``"{step}-{round_}-{j}"``, and its loader position."""
        position = self.position
        epoch, i = divmod(position, self.loader.num_batches)
        self.position += 1
        prompts = [{**p, "uid": f"{step}-{round_}-{j}"} for j, p in enumerate(self.loader.batch(epoch, i))]
        return prompts, position


@dataclass
class Call:
    """One generation call: the step and round it is for, the policy version it samples with, its
    prompts and their loader position, the worker group's pending calls (samples, and greedy for
    ReMax); or an already generated ``rollout`` with each row's policy version in ``versions`` (B,)
    (rows may differ, e.g. a batch handed in from elsewhere)."""

    step: int
    version: int
    prompts: list[dict]
    position: int = -1
    round: int = 1
    pending: Any = None
    greedy: Any = None
    rollout: Rollout | None = None
    versions: torch.Tensor | None = None


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


def fresh_groups(
    versions: torch.Tensor, uids: list[Any], current: int, max_staleness: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows to keep and each row's staleness: ``versions`` (B,) holds each sample's policy version and
    ``uids`` its prompt group; a group is kept when all its samples are at most ``max_staleness``
    versions behind ``current``. Returns (kept row indices, staleness (B,))."""
    staleness = current - versions
    if (staleness < 0).any():
        newest = int(versions.max())
        raise ValueError(f"a sample's policy version {newest} is newer than the policy ({current})")
    return groups_within(staleness, uids, max_staleness), staleness


def staleness_metrics(
    trained: torch.Tensor, dropped: int, checked: int, max_staleness: int
) -> dict[str, float]:
    """``async/staleness_mean`` and ``_max`` over the trained samples' staleness ``trained``,
    ``async/staleness_count/<s>`` (trained samples of staleness s, for s = 0 … max_staleness),
    ``async/dropped`` (samples too old) and ``async/dropped_frac`` (their share of the ``checked``
    samples, all those the step received; with dynamic sampling some are neither trained nor too old)."""
    counts = Counter(trained.tolist())
    metrics = {
        "async/staleness_mean": float(trained.float().mean()) if trained.numel() else 0.0,
        "async/staleness_max": float(trained.max()) if trained.numel() else 0.0,
        "async/dropped": float(dropped),
        "async/dropped_frac": dropped / checked if checked else 0.0,
    }
    for s in range(max_staleness + 1):
        metrics[f"async/staleness_count/{s}"] = float(counts.get(s, 0))
    return metrics


class BatchSource:
    """Each step's scored batch (see the module docstring).

    ``workers`` is the worker group (``submit_generate`` / ``wait_generate``), ``prompts`` the draw,
    ``version()`` the driver's policy version, ``report_errors(errors, rows)`` reports a round's reward
    errors (:class:`tearless.trainers.reward_errors.RewardErrors`).
    """

    def __init__(
        self,
        workers: Any,
        prompts: PromptDraw,
        settings: SourceSettings,
        *,
        version: Callable[[], int],
        report_errors: Callable[[dict, int], None],
        pad_token_id: int,
    ) -> None:
        self.workers, self.prompts, self.s = workers, prompts, settings
        self.version, self.report_errors, self.pad_token_id = version, report_errors, pad_token_id
        self.queue: deque[Call] = deque()
        self.submitted = 0  # the last step whose first generation call was submitted

    def resume_position(self) -> int:
        """The loader position a checkpoint written now resumes from: the first batch drawn for a call
        not trained on yet, or the draw's position when none is in flight."""
        return min([c.position for c in self.queue if c.position >= 0], default=self.prompts.position)

    def _submit(self, step: int, round_: int, prompts: list[dict] | None = None, position: int = -1) -> Call:
        if prompts is None:
            prompts, position = self.prompts.draw(step, round_)
        s, version = self.s, self.version()
        faults.point("rollout", step)
        keys = prompt_keys(s.seed, step, 0 if round_ == 1 else 10 + round_, len(prompts))
        faults.point("reward", step)
        kw = dict(max_new_tokens=s.max_new_tokens, version=version)
        pending = self.workers.submit_generate(prompts, n=s.n, keys=keys, **kw, **s.sampling)
        greedy = None
        if s.greedy_baselines:  # right behind the samples: the same weights
            greedy = self.workers.submit_generate(prompts, n=1, keys=None, do_sample=False, **kw)
        return Call(step, version, prompts, position, round_, pending, greedy)

    def _wait(self, call: Call, timer: Timer) -> Rollout:
        start = time.perf_counter()
        rollout = self.workers.wait_generate(call.pending)
        self.report_errors(rollout.errors, len(rollout.items))
        if call.greedy is not None:
            greedy = self.workers.wait_generate(call.greedy)
            self.report_errors(greedy.errors, len(greedy.items))
            score = dict(zip(greedy.uids, greedy.scores.tolist(), strict=True))
            rollout.baselines = torch.tensor([score[u] for u in rollout.uids], dtype=greedy.scores.dtype)
        if self.s.asynchronous:
            waited = time.perf_counter() - start
            timer.seconds["wait_rollout"] += waited
            timer.seconds["train_idle"] += waited
        return rollout

    def _fresh(self, call: Call, timer: Timer) -> tuple[Rollout, torch.Tensor, int, int, dict[str, float]]:
        """The call's rollout with the groups too old dropped (all of them too old: its prompts again,
        with today's weights); each kept row's staleness, the number of rows dropped and checked, and
        the partial-rollout metrics. Synchronous (k = 0, no async_training): the rollout as it came."""
        rollout = call.rollout or self._wait(call, timer)
        rows = len(rollout.items)
        if not self.s.asynchronous:
            return rollout, torch.zeros(rows, dtype=torch.long), 0, rows, {}
        metrics: dict[str, float] = {}
        versions = call.versions
        if versions is None and rollout.out.token_versions is not None:
            versions, metrics = response_versions(rollout.out.token_versions, rollout.out.response_mask)
        if versions is None:
            versions = torch.full((rows,), call.version, dtype=torch.long)
        kept, staleness = fresh_groups(versions, rollout.uids, self.version(), self.s.max_staleness)
        if kept.numel() == 0:
            retry = self._wait(self._submit(call.step, call.round, call.prompts, call.position), timer)
            return retry, torch.zeros(len(retry.items), dtype=torch.long), rows, rows, metrics
        if kept.numel() < rows:
            rollout = rollout.select(kept)
        return rollout, staleness[kept], rows - kept.numel(), rows, metrics

    def batch(self, step: int, timer: Timer) -> tuple[Rollout, dict[str, float]]:
        """Step ``step``'s scored batch (rows carry their uids) and its metrics, after submitting the
        first generation calls of the next ``max_staleness`` steps."""
        s = self.s
        last = min(step + s.max_staleness, s.total_steps)
        while self.submitted < last:
            self.submitted = max(self.submitted + 1, step)
            self.queue.append(self._submit(self.submitted, 1))
        call = self.queue.popleft()
        assert call.step == step, f"the generation call of step {call.step} came up at step {step}"
        parts: list[Rollout] = []
        trained: list[torch.Tensor] = []
        metrics: dict[str, float] = {}
        kept_groups, rounds, drawn, dropped, checked = 0, 0, 0, 0, 0
        while True:
            rounds += 1
            rollout, staleness, too_old, rows, partial = self._fresh(call, timer)
            metrics.update(partial)
            dropped, checked = dropped + too_old, checked + rows
            drawn += len(call.prompts) or num_groups(rollout.uids)
            for name, seconds in rollout.seconds.items():
                timer.seconds[name] += seconds
            if not s.filter_groups:
                parts, trained = [rollout], [staleness]
                break
            spread = filter_groups(rollout.scores, rollout.uids)
            keep = first_groups(rollout.uids, spread, s.target_groups - kept_groups)
            parts.append(rollout.select(keep))
            trained.append(staleness[keep])
            kept_groups += num_groups(parts[-1].uids)
            if kept_groups >= s.target_groups or 0 < s.max_num_gen_batches <= rounds:
                break
            call = self._submit(step, rounds + 1)
        if s.filter_groups and kept_groups == 0:
            raise RuntimeError(
                f"algorithm.filter_groups: every group of {drawn} prompts had equal scores after {rounds} "
                "generation rounds; raise algorithm.filter_groups.max_num_gen_batches or check the reward"
            )
        rollout = concat(parts, self.pad_token_id)
        metrics = {**rollout.metrics, **metrics}
        if s.filter_groups:
            metrics["train/num_gen_batches"] = float(rounds)
            metrics["train/kept_prompt_ratio"] = kept_groups / drawn
        if s.asynchronous:
            metrics.update(staleness_metrics(torch.cat(trained), dropped, checked, s.max_staleness))
            metrics["async/policy_version"] = float(self.version())
        return rollout, metrics

    def sync_idle(self, timer: Timer, received: float) -> None:
        """Add to ``timing_s/train_idle`` the part of the weight sync spent waiting for the rollout
        workers to finish the generation calls ahead of it (its wall time minus their copying).
        With partial rollouts they take the weights at their next token: nothing is added."""
        if self.s.asynchronous and not self.s.partial_rollout:
            timer.seconds["train_idle"] += max(0.0, timer.seconds["update_weights"] - received)
