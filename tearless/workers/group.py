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
from tearless.config import Config
from tearless.config.derived import on_policy
from tearless.rollout.agent import agent_metrics
from tearless.rollout.batch import Rollout
from tearless.rollout.engine import concat_rollouts
from tearless.workers.actor import policy_update
from tearless.workers.rank import Rank, RankMethod
from tearless.workers.schedule import (
    UpdateSettings,
    balanced_partition,
    count_micro_batches,
    row_tokens,
    scheduled_update,
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

    cfg: Config
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
        **sampling: Any,
    ) -> Rollout:
        """``n`` scored responses per prompt; each generating rank takes a consecutive share.
        ``version`` is the policy version the ranks hold (recorded per token, ``token_versions``)."""
        pending = self.submit_generate(
            prompts, n=n, keys=keys, max_new_tokens=max_new_tokens, version=version, **sampling
        )
        return self.wait_generate(pending)

    def submit_generate(
        self,
        prompts: list[dict],
        *,
        n: int,
        keys: list[int] | None,
        max_new_tokens: int,
        version: int = 0,
        **sampling: Any,
    ) -> tuple[list[dict], int, Any]:
        """Start :meth:`generate` without waiting for it (the asynchronous loop); the generating ranks
        run it after the calls submitted before it, with the weights they hold then (``version``,
        or the newer one a rollout rank received since)."""
        pieces = contiguous_split(len(prompts), self.world_of("rollout"))
        args = []
        for piece in pieces:
            share_keys = None if keys is None else [keys[i] for i in piece]
            args.append(([prompts[i] for i in piece], n, share_keys, max_new_tokens, sampling, version))
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
        """(B, R) log-probs of ``td``'s responses under ``role`` (``actor`` or ``ref``), and
        entropies when asked."""
        arr = self.cfg.actor_rollout_ref
        size = (arr.rollout if role == "actor" else arr.ref).log_prob_micro_batch_size_per_gpu
        parts, num_micro = self._split(td, size, self.world_of(role))
        args = [(role, td[p or [0]], num_micro, with_entropy) for p in parts]
        results = self._call(role, Rank.compute_log_prob, args, f"{role} log-probs")
        log_prob = self._gather(td, parts, [r[0] for r in results])
        entropy = self._gather(td, parts, [r[1] for r in results]) if with_entropy else None
        return log_prob, entropy

    def compute_values(self, td: TensorDict) -> torch.Tensor:
        """(B, R) critic values of ``td``'s response positions, zero outside the loss mask."""
        parts, num_micro = self._split(
            td, self.cfg.critic.forward_micro_batch_size_per_gpu, self.world_of("critic")
        )
        args = [(td[p or [0]], num_micro) for p in parts]
        results = self._call("critic", Rank.compute_values, args, "critic values")
        return self._gather(td, parts, results)

    # ------------------------------------------------------------------ updates
    def _run(self, role: str, detached: bool):
        def run(work):
            args = [(role, rows, steps, detached) for rows, steps in work]
            return self._call(role, Rank.update, args, f"{role} update")

        return run

    def update_policy(self, td: TensorDict, *, generator: torch.Generator | None = None) -> dict[str, float]:
        """The actor's PPO epochs over ``td`` on every training rank; averaged metrics."""
        arr = self.cfg.actor_rollout_ref
        # bypass_mode: π_old is the rollout's, so the ratio is not 1 even on-policy.
        bypass = self.cfg.algorithm.rollout_correction.bypass_mode
        detached = on_policy(arr.actor, num_groups(td["uid_index"])) and not bypass
        return policy_update(
            arr.actor,
            self.settings["actor"],
            td,
            self.world_of("actor"),
            self._run("actor", detached),
            generator=generator,
            entropy_of=lambda rows: self.compute_log_prob("actor", rows, with_entropy=True)[1],
        )

    def update_critic(self, td: TensorDict, *, generator: torch.Generator | None = None) -> dict[str, float]:
        """The critic's epochs over ``td`` (needs ``values`` and ``returns``); averaged metrics."""
        return scheduled_update(
            td,
            self.settings["critic"],
            self.world_of("critic"),
            self._run("critic", False),
            generator=generator,
        )

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

    def probe_sync(self, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The sync probe (:mod:`tearless.rollout.sync_probe`): the actor's log-probs of ``ids[1:]``
        and each generating rank's engine's (ranks whose engine is the trained model give none)."""
        policy = self._call("actor", Rank.probe_policy, [(ids,)] * self.world_of("actor"), "sync probe")[0]
        engines = self._call("rollout", Rank.probe_engine, [(ids,)] * self.world_of("rollout"), "sync probe")
        return policy, [e for e in engines if e is not None]

    def check_weights(self, step: int, probe: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Stop the run (:class:`tearless.run.guards.WeightsNotFinite`) if an update left a trained
        model's weights, or the actor's logits on ``probe``, non-finite."""
        for pool in self.trained_pools():
            self._call(pool, Rank.check_weights, [(step, probe)] * self.world_of(pool), "weight check")

    def skipped_steps(self) -> int:
        """Optimizer steps skipped so far (non-finite loss or gradient norm), all trained roles."""
        return sum(
            self._call(pool, Rank.skipped_steps, [()] * self.world_of(pool), "skipped-step count")[0]
            for pool in self.trained_pools()
        )


class LocalWorkers(WorkerGroup):
    """Everything in this process: one rank that trains and generates (world size 1)."""

    def __init__(self, spec: RankSpec, pad_token_id: int) -> None:
        self.cfg, self.pad_token_id = spec.cfg, pad_token_id
        self.settings = role_settings(spec.cfg)
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
