"""Worker groups over Ray: start the ranks, split each call's batch, gather, fail loudly.

``WorkerGroup`` starts ``world`` Ray actors (:class:`~tearless.distributed.worker.RankWorker`), one
process each, that join one ``torch.distributed`` process group. Every wait on them is bounded by
``trainer.worker_timeout_s``; the first worker that raises or dies ends the call with an error that
names its rank, process id and host and carries its traceback, and the whole group is stopped (a
surviving rank would otherwise sit in a collective until its own timeout).

The role facades (:class:`ActorGroup`, :class:`RefGroup`, :class:`CriticGroup`) have the methods of
the single-process workers the trainer calls, so ``RLTrainer``'s loop is the same for both placements.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from tearless.config.derived import loss_scale_factor
from tearless.distributed.partition import balanced_partition, count_micro_batches, plan_updates, row_tokens
from tearless.distributed.worker import RankWorker, WorkerSpec

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerError(RuntimeError):
    """A worker of a group failed, died or did not answer in time; the message names it."""


def ensure_ray(num_workers: int) -> None:
    """Connect to the Ray cluster in ``RAY_ADDRESS``, or start a local one (no dashboard) that
    counts at least one CPU per worker, so that split pools fit on a small machine."""
    import os

    import ray

    if not ray.is_initialized():
        local = not os.environ.get("RAY_ADDRESS")
        num_cpus = max(os.cpu_count() or 1, num_workers) if local else None
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)


class WorkerGroup:
    """``world`` ranks holding ``spec.roles``; see the module docstring."""

    def __init__(self, spec: WorkerSpec, world: int, *, name: str, run_dir: Path | None = None) -> None:
        import ray

        self.spec, self.world, self.name, self.timeout_s = spec, world, name, spec.timeout_s
        gpu = spec.device == "cuda"
        remote = ray.remote(RankWorker).options(num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0)
        self.handles = [remote.remote(rank, world, spec) for rank in range(world)]
        self.workers: list[dict[str, Any]] = [{"rank": r, "pid": None, "host": None} for r in range(world)]
        self.workers = self.call("info", what="start")
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / f"workers_{name}.json").write_text(json.dumps(self.workers, indent=1))
        (address,) = self.call("address", ranks=[0], what="rendezvous")
        self.call("setup", address, what="setup (process group and models)")

    def _label(self, rank: int) -> str:
        w = self.workers[rank]
        where = f"pid {w['pid']} on {w['host']}" if w["pid"] is not None else "process not started yet"
        return f"{self.name} worker rank {rank} ({where})"

    def call(
        self,
        method: str,
        *args: Any,
        ranks: Sequence[int] | None = None,
        what: str = "",
        per_rank: Sequence[tuple] | None = None,
    ) -> list[Any]:
        """Call ``method`` on the given ranks (all by default) and return their results in rank order.

        ``per_rank`` gives each rank its own positional arguments instead of ``args``. Waits at most
        ``timeout_s`` in all; on the first failure or at the timeout the group is stopped and a
        :class:`WorkerError` naming the worker is raised.
        """
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError

        ranks = list(range(self.world)) if ranks is None else list(ranks)
        refs = {
            getattr(self.handles[r], method).remote(*(per_rank[i] if per_rank is not None else args)): r
            for i, r in enumerate(ranks)
        }
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        doing = what or method
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = ", ".join(self._label(refs[p]) for p in pending)
                self.close()
                raise WorkerError(
                    f"{late}: no answer to {doing} within trainer.worker_timeout_s={self.timeout_s:g} s; "
                    "the group was stopped. Raise trainer.worker_timeout_s if the step is legitimately slow."
                )
            ref = ready[0]
            try:
                results[refs[ref]] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except RayActorError as exc:
                self.close()
                raise WorkerError(
                    f"{self._label(refs[ref])} died during {doing} (its process exited or was killed); "
                    f"the group was stopped and nothing of this step was saved.\n{exc}"
                ) from None
            except GetTimeoutError:
                pending.append(ref)
            except RayError as exc:
                self.close()
                remote = _ANSI.sub("", str(exc))  # Ray colours the remote traceback for terminals
                raise WorkerError(f"{self._label(refs[ref])} failed during {doing}:\n{remote}") from None
        return [results[r] for r in ranks]

    def close(self) -> None:
        """Stop every rank (idempotent)."""
        import ray

        for handle in self.handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception:  # a dead actor cannot be killed twice; nothing else to do
                pass
        self.handles = []


def uid_groups(td: TensorDict) -> list[Hashable] | None:
    """The group (prompt) id of each row, from ``td["uid_index"]`` when the trainer set it."""
    return td["uid_index"].tolist() if "uid_index" in td.keys() else None


def split_rows(td: TensorDict, world: int) -> list[list[int]]:
    """Each rank's rows of ``td``: token-balanced, uid groups kept together."""
    return balanced_partition(row_tokens(td), uid_groups(td), world)


def gather_rows(parts: list[list[int]], outputs: list[torch.Tensor], rows: int) -> torch.Tensor:
    """Put each rank's output rows back at their original positions."""
    out = torch.empty((rows, *outputs[0].shape[1:]), dtype=outputs[0].dtype)
    for part, value in zip(parts, outputs, strict=True):
        out[part] = value
    return out


class _RoleGroup:
    def __init__(self, group: WorkerGroup, role: str) -> None:
        self.group, self.role = group, role

    def _forward(self, method: str, td: TensorDict, micro_size: int | None, *extra: Any) -> torch.Tensor:
        parts = split_rows(td, self.group.world)
        num_micro = max(count_micro_batches([0] * len(p), size=micro_size, token_budget=None) for p in parts)
        outs = self.group.call(
            method, per_rank=[(*extra, td[p], num_micro) for p in parts], what=f"{self.role} {method}"
        )
        return gather_rows(parts, outs, td.batch_size[0])

    def _update(self, td: TensorDict, generator, s, rows_per_mini: int, detached: bool) -> dict[str, float]:
        world = self.group.world
        plans = plan_updates(
            td,
            uid_groups(td),
            world,
            rows_per_mini=rows_per_mini,
            epochs=s.ppo_epochs,
            shuffle=s.shuffle,
            generator=generator,
            micro_size=s.ppo_micro_batch_size_per_gpu,
            token_budget=s.ppo_max_token_len_per_gpu if s.use_dynamic_bsz else None,
            loss_scale_factor=self.loss_scale_factor,
        )
        per_rank = []
        for r in range(world):
            rows = sorted({i for p in plans for i in p.rows[r]})
            local = {g: j for j, g in enumerate(rows)}
            steps = [([local[i] for i in p.rows[r]], p.norm, p.num_micro) for p in plans]
            per_rank.append((self.role, td[rows], steps, detached))
        results = self.group.call("update", per_rank=per_rank, what=f"{self.role} update")
        metrics = dict(results[0][1])
        for additive, _ in results:
            for k, v in additive.items():
                metrics[k] = metrics.get(k, 0.0) + v
        return metrics

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.group.call("state_dict", self.role, what=f"{self.role} weight gather")[0]


class ActorGroup(_RoleGroup):
    """The sharded actor, with the single-process :class:`~tearless.workers.actor.Actor`'s interface.

    After each update the consolidated weights are pushed to ``sync_to`` (the driver's rollout model,
    or the vLLM engine), within the group's timeout.
    """

    def __init__(self, group: WorkerGroup, cfg, sync_to: list[Callable[[dict], None]]) -> None:
        super().__init__(group, "actor")
        self.cfg, self.rollout_n, self.sync_to = (
            cfg.actor_rollout_ref.actor,
            cfg.actor_rollout_ref.rollout.n,
            sync_to,
        )
        self.micro_size = cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu
        self.loss_scale_factor = loss_scale_factor(cfg)
        self.skipped_steps = 0

    def on_policy(self, num_prompts: int) -> bool:
        return self.cfg.ppo_epochs == 1 and num_prompts == self.cfg.ppo_mini_batch_size

    def compute_log_prob(self, td: TensorDict, *, with_entropy: bool = False):
        return self._forward("compute_log_prob", td, self.micro_size, "actor"), None

    def update_policy(self, td: TensorDict, *, generator: torch.Generator | None = None) -> dict[str, float]:
        detached = self.on_policy(td.batch_size[0] // self.rollout_n)
        metrics = self._update(
            td, generator, self.cfg, self.cfg.ppo_mini_batch_size * self.rollout_n, detached
        )
        if self.cfg.use_kl_loss:
            metrics["actor/kl_coef"] = self.cfg.kl_loss_coef
        self.skipped_steps = int(metrics["actor/skipped_steps"])
        started = time.perf_counter()
        self.sync_weights()
        metrics["timing_s/update_weights"] = time.perf_counter() - started
        return metrics

    def sync_weights(self) -> None:
        """Gather the consolidated weights and load them into every sync target."""
        state = self.full_state_dict()
        for load in self.sync_to:
            load(state)


class RefGroup(_RoleGroup):
    """The sharded reference policy: ``compute_log_prob`` only."""

    def __init__(self, group: WorkerGroup, cfg) -> None:
        super().__init__(group, "ref")
        self.micro_size = cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu

    def compute_log_prob(self, td: TensorDict, *, with_entropy: bool = False):
        return self._forward("compute_log_prob", td, self.micro_size, "ref"), None


class CriticGroup(_RoleGroup):
    """The sharded critic: values and updates; ``model`` is the consolidated value model (gathered
    into ``driver_model`` on each access, for checkpoints)."""

    def __init__(self, group: WorkerGroup, settings, rollout_n: int, driver_model: torch.nn.Module) -> None:
        super().__init__(group, "critic")
        self.s, self.rollout_n, self._model = settings, rollout_n, driver_model
        self.loss_scale_factor = settings.loss_scale_factor

    def compute_values(self, td: TensorDict) -> torch.Tensor:
        return self._forward("compute_values", td, self.s.forward_micro_batch_size_per_gpu)

    def update_critic(self, td: TensorDict, *, generator: torch.Generator | None = None) -> dict[str, float]:
        return self._update(td, generator, self.s, self.s.ppo_mini_batch_size * self.rollout_n, False)

    @property
    def model(self) -> torch.nn.Module:
        self._model.load_state_dict(self.full_state_dict())
        return self._model
