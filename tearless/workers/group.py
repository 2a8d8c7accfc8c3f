"""The one seam between the RL trainer and its workers: a :class:`WorkerGroup`.

The trainer calls ``generate`` (each generating rank samples and scores its share of the prompts),
``compute_log_prob`` / ``compute_values`` (each training rank forwards its token-balanced share of
the rows), ``update_policy`` / ``update_critic`` (the one schedule of
:mod:`tearless.workers.schedule`, every rank running its part of every optimizer step), ``save`` /
``load`` (one checkpoint format, readable by any placement and world size) and ``close``; it never
asks where the ranks are. What differs between placements is only how a call reaches the ranks:

- :class:`LocalWorkers`: one :class:`~tearless.workers.rank.Rank` in this process (world size 1);
- :class:`tearless.workers.ray_group.RayWorkers`: Ray actors holding ranks over FSDP2 shards,
  colocated with their rollout engines (hybrid) or beside separate rollout workers (split).

A batch's rows carry their prompt group (``uid_index``): a prompt's responses stay on one rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDict

from tearless.algos.groups import num_groups
from tearless.config.plan import RunPlan
from tearless.rollout.batch import Rollout
from tearless.rollout.engine import concat_rollouts
from tearless.rollout.multiturn import agent_metrics
from tearless.workers.actor import skips_zero_adv_rows
from tearless.workers.rank import Rank, RankMethod
from tearless.workers.schedule import (
    UpdateFlags,
    UpdateSettings,
    balanced_partition,
    combined_metrics,
    count_micro_batches,
    plan_updates,
    rank_work,
    row_tokens,
    skipped_rows_metrics,
)
from tearless.workers.scoring import reward_metrics
from tearless.workers.spec import RankSpec, role_settings


def contiguous_split(count: int, parts: int) -> list[range]:
    """``range(count)`` cut into ``parts`` consecutive pieces whose sizes differ by at most one."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for r in range(parts):
        bounds.append(bounds[-1] + base + (r < extra))
    return [range(bounds[r], bounds[r + 1]) for r in range(parts)]


class WorkerGroup:
    """Pools of ranks: the ones holding each model role (``actor``, ``ref``, ``critic``) and the
    ones that generate (``rollout``). In the hybrid placement one pool holds every role and
    generates. Subclasses say how a call reaches a pool's ranks."""

    plan: RunPlan  # the run's derived facts and the config's sections (tearless.config.plan), the spec's
    pad_token_id: int
    device: str  # where the training ranks compute: trainer.device as the ranks resolved it
    settings: dict[str, UpdateSettings]  # the trained roles' update settings (spec.role_settings)

    # ------------------------------------------------------------------ how calls reach the ranks
    def world_of(self, pool: str) -> int:
        """The number of ranks in ``pool`` (a role, or ``rollout``)."""
        raise NotImplementedError

    def _call(self, pool: str, method: RankMethod, per_rank: Sequence[tuple], what: str) -> list[Any]:
        """Call ``method`` (a :class:`Rank` method, e.g. ``Rank.update``) on every rank of ``pool`` with its
        own arguments; results in rank order."""
        raise NotImplementedError

    def trained_pools(self) -> list[str]:
        """One role per distinct pool that trains (``actor`` and, in its own pool, ``critic``)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _submit(self, pool: str, method: RankMethod, per_rank: Sequence[tuple], what: str) -> Any:
        """Start ``method`` on every rank of ``pool``; :meth:`_wait` returns the results. Ranks run
        their calls in submission order. Here the call runs at once; Ray returns pending calls."""
        return self._call(pool, method, per_rank, what)

    def _wait(self, pending: Any, what: str) -> list[Any]:
        return pending

    def sync_weights(self, version: int | None = None) -> float:
        """Bring separate rollout workers the policy after an update (split placement; in the hybrid
        placement the engines already sample from the trained weights, or took them in-process);
        ``version`` is its policy version (None: unknown, the first load). Returns the slowest rollout
        rank's seconds receiving them (0 when there is nothing to send, or when, with partial
        rollouts, the rollout ranks take them between two tokens without the trainer waiting)."""
        return 0.0

    # ------------------------------------------------------------------ rollout
    def generate(
        self,
        prompts: list[dict],
        *,
        n: int,
        keys: list[int] | None,
        max_new_tokens: int,
        version: int = 0,
        rule_scored: bool = False,
        **sampling: Any,
    ) -> Rollout:
        """``n`` scored responses per prompt; each generating rank takes a consecutive share.
        ``version`` is the policy version the ranks hold (recorded per token, ``token_versions``);
        ``rule_scored``: scored by the rule scorers alone, not a reward model or judge (validation)."""
        pending = self.submit_generate(
            prompts, n=n, keys=keys, max_new_tokens=max_new_tokens, version=version, rule_scored=rule_scored,
            **sampling,
        )  # fmt: skip
        return self.wait_generate(pending)

    def submit_generate(
        self,
        prompts: list[dict],
        *,
        n: int,
        keys: list[int] | None,
        max_new_tokens: int,
        version: int = 0,
        rule_scored: bool = False,
        **sampling: Any,
    ) -> tuple[list[dict], int, Any]:
        """Start :meth:`generate` without waiting for it (the asynchronous loop); the generating ranks
        run it after the calls submitted before it, with the weights they hold then (``version``,
        or the newer one a rollout rank received since)."""
        pieces = contiguous_split(len(prompts), self.world_of("rollout"))
        args = []
        for piece in pieces:
            share_keys = None if keys is None else [keys[i] for i in piece]
            args.append(
                ([prompts[i] for i in piece], n, share_keys, max_new_tokens, sampling, version, rule_scored)
            )
        return prompts, n, self._submit("rollout", Rank.generate_share, args, "generation")

    def wait_generate(self, pending: tuple[list[dict], int, Any]) -> Rollout:
        """The scored rollout of a :meth:`submit_generate` call."""
        prompts, n, handle = pending
        parts = [p for p in self._wait(handle, "generation") if p is not None]
        out = concat_rollouts([p["out"] for p in parts], self.pad_token_id)
        items = [q for q in prompts for _ in range(n)]
        info = [row for p in parts for row in p["info"]] if parts[0]["info"] is not None else None
        if info is not None:
            items = [{**it, "tool_calls": row["tool_calls"]} for it, row in zip(items, info, strict=True)]
        extras = [e for p in parts for e in p["extras"]]
        errors: dict[str, list] = {}
        for p in parts:
            for message, (count, tb) in p["errors"].items():
                errors.setdefault(message, [0, tb])[0] += count
        metrics = reward_metrics(
            extras, sum(p["failures"] for p in parts), sum(p["lost_workers"] for p in parts)
        )
        if info is not None:
            metrics.update(agent_metrics(info, out.response_mask, out.response_attention_mask))
        return Rollout(
            out=out,
            items=items,
            scores=torch.cat([p["scores"] for p in parts]),
            correct=torch.cat([p["correct"] for p in parts]),
            texts=[t for p in parts for t in p["texts"]],
            extras=extras,
            metrics=metrics,
            seconds={
                k: max(p["seconds"].get(k, 0.0) for p in parts)
                for k in dict.fromkeys(k for p in parts for k in p["seconds"])
            },
            errors=errors,
        )

    # ------------------------------------------------------------------ forward-only passes
    def _split(self, td: TensorDict, micro_size: int | None, world: int) -> tuple[list[list[int]], int]:
        """Each rank's rows (token-balanced, prompt groups together; a rank with none gets
        row 0 to run as padding) and the number of passes every rank runs."""
        uids = td["uid_index"].tolist() if "uid_index" in td.keys() else None
        tokens = row_tokens(td)
        parts = balanced_partition(tokens, uids, world)
        num_micro = max(
            count_micro_batches([tokens[i] for i in p], size=micro_size, token_budget=None)
            for p in parts
            if p
        )
        return parts, num_micro

    def _gather(self, td: TensorDict, parts: list[list[int]], outputs: list[torch.Tensor]) -> torch.Tensor:
        rows = td.batch_size[0]
        first = next(o for p, o in zip(parts, outputs, strict=True) if p)
        result = torch.empty((rows, *first.shape[1:]), dtype=first.dtype)
        for part, value in zip(parts, outputs, strict=True):
            if part:
                result[part] = value[: len(part)]
        return result

    def compute_log_prob(
        self, role: str, td: TensorDict, *, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, R) log-probs of ``td``'s responses under ``role`` (``actor``, ``ref`` or ``teacher``),
        and entropies when asked."""
        sections = self.plan.sections
        section = sections.rollout if role == "actor" else getattr(sections, role)
        size = section.log_prob_micro_batch_size_per_gpu
        parts, num_micro = self._split(td, size, self.world_of(role))
        args = [(role, td[p or [0]], num_micro, with_entropy) for p in parts]
        results = self._call(role, Rank.compute_log_prob, args, f"{role} log-probs")
        log_prob = self._gather(td, parts, [r[0] for r in results])
        entropy = self._gather(td, parts, [r[1] for r in results]) if with_entropy else None
        return log_prob, entropy

    def compute_values(self, td: TensorDict) -> torch.Tensor:
        """(B, R) critic values of ``td``'s response positions, zero outside the loss mask."""
        parts, num_micro = self._split(
            td, self.plan.sections.critic.forward_micro_batch_size_per_gpu, self.world_of("critic")
        )
        args = [(td[p or [0]], num_micro) for p in parts]
        results = self._call("critic", Rank.compute_values, args, "critic values")
        return self._gather(td, parts, results)

    # ------------------------------------------------------------------ updates
    def update_policy(self, td: TensorDict, *, generator: torch.Generator | None = None) -> dict[str, float]:
        """The actor's PPO epochs over ``td`` on every training rank; averaged metrics.

        Plans the optimizer steps (:func:`~tearless.workers.schedule.plan_updates`); on-policy, rows
        whose advantages are all zero are left out where their gradient is exactly zero
        (:func:`~tearless.workers.actor.skips_zero_adv_rows`), their entropy metric the sampler's
        (``rollout_entropy``) or, without it and with ``calculate_entropy``, the policy's before the
        update (:meth:`compute_log_prob`); then each rank runs its share (``Rank.update``)."""
        actor = self.plan.sections.actor
        prompts = num_groups(td["uid_index"])
        world = self.world_of("actor")
        on_policy = self.plan.on_policy(prompts)
        skip = None
        if skips_zero_adv_rows(actor, on_policy):
            skip = ~((td["advantages"] * td["response_mask"]) != 0).any(-1)
        plans = plan_updates(td, self.settings["actor"], world, generator=generator, skip_rows=skip)
        work = rank_work(td, plans, world)
        metrics: dict[str, float] = {}
        if skip is not None:
            entropies = [self._entropy_before_update(td[p.skipped]) if p.skipped else None for p in plans]
            metrics = skipped_rows_metrics(td, plans, actor.loss_agg_mode, entropies)
        # bypass_mode: π_old is the rollout's, so the ratio is not 1 even on-policy.
        flags = UpdateFlags(detached=on_policy and not self.plan.sections.rollout_correction.bypass_mode)
        args = [("actor", rows, steps, flags) for rows, steps in work]
        out = combined_metrics(self._call("actor", Rank.update, args, "actor update"), metrics)
        if actor.use_kl_loss:
            out["actor/kl_coef"] = actor.kl_loss_coef
        return out

    def _entropy_before_update(self, rows: TensorDict) -> torch.Tensor | None:
        """(b, R) entropies of ``rows`` under the policy that sampled them: the sampler's, else the
        actor's (with ``calculate_entropy``), else None (no metric, as for the rows the update runs)."""
        if "rollout_entropy" in rows.keys():
            return rows["rollout_entropy"]
        if self.plan.sections.actor.calculate_entropy:
            return self.compute_log_prob("actor", rows, with_entropy=True)[1]
        return None

    def update_critic(self, td: TensorDict, *, generator: torch.Generator | None = None) -> dict[str, float]:
        """The critic's epochs over ``td`` (needs ``values`` and ``returns``); averaged metrics."""
        world = self.world_of("critic")
        plans = plan_updates(td, self.settings["critic"], world, generator=generator)
        args = [("critic", rows, steps, UpdateFlags()) for rows, steps in rank_work(td, plans, world)]
        return combined_metrics(self._call("critic", Rank.update, args, "critic update"), {})

    # ------------------------------------------------------------------ state
    def save(self, directory: str) -> dict[str, Any]:
        """Write the trained roles into a checkpoint directory; their schedule state, for the
        trainer's state file."""
        state: dict[str, Any] = {}
        for pool in self.trained_pools():
            state.update(self._call(pool, Rank.save, [(directory,)] * self.world_of(pool), "checkpoint")[0])
        return state

    def load(self, directory: str, state: dict[str, Any]) -> None:
        """Restore optimizer state and schedules saved by any placement."""
        for pool in self.trained_pools():
            self._call(pool, Rank.load, [(directory, state)] * self.world_of(pool), "resume")

    def probe_sync(self, ids: list[int]) -> tuple[torch.Tensor, list[tuple[torch.Tensor, str | None]]]:
        """The sync checks: the actor's log-probs of ``ids[1:]`` (:mod:`tearless.rollout.sync_probe`),
        and each generating rank's engine's, with its weight checksum's fault
        (:mod:`tearless.rollout.weight_checksum`); ranks whose engine is the trained model give none."""
        policy = self._call("actor", Rank.probe_policy, [(ids,)] * self.world_of("actor"), "sync probe")[0]
        engines = self._call("rollout", Rank.probe_engine, [(ids,)] * self.world_of("rollout"), "sync probe")
        return policy, [e for e in engines if e is not None]

    def check_weights(self, step: int, probe: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Stop the run (:class:`tearless.run.guards.WeightsNotFinite`) if an update left a trained
        model's weights, or the actor's logits on ``probe``, non-finite."""
        for pool in self.trained_pools():
            self._call(pool, Rank.check_weights, [(step, probe)] * self.world_of(pool), "weight check")


class LocalWorkers(WorkerGroup):
    """Everything in this process: one rank that trains and generates (world size 1)."""

    def __init__(self, spec: RankSpec, pad_token_id: int) -> None:
        self.plan, self.pad_token_id = spec.plan, pad_token_id
        self.settings = role_settings(spec)
        self.rank = Rank(0, 1, spec)
        try:
            self.rank.setup()
            self.device = self.rank.device.type
            if self.rank.separate_engine:
                self.rank.sync_engine()
        except BaseException:
            self.rank.close()
            raise

    def world_of(self, pool: str) -> int:
        return 1

    def _call(self, pool: str, method: RankMethod, per_rank: Sequence[tuple], what: str) -> list[Any]:
        return [method(self.rank, *per_rank[0])]

    def trained_pools(self) -> list[str]:
        return ["actor"]

    def close(self) -> None:
        self.rank.close()
