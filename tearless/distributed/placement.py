"""The Ray placement of the RL trainer's workers: which processes hold which roles, and checkpoints.

Colocated (``trainer.colocate=true``, the default): one group of ``nnodes × n_gpus_per_node`` ranks,
each holding the actor, reference and critic models that the run needs; they share devices, so the
models take turns (FSDP frees each block's gathered parameters after use). Split pools
(``trainer.colocate=false``): one group of that many ranks per role, each its own process group.

Rollout runs in the driver, on a full copy of the policy that the actor group refreshes after every
update (``hf``), or in the vLLM engine that it feeds the same way (``vllm``). Keeping generation in
one place is what makes a run on W workers draw exactly the responses of the single-process run
(same weights, same seeded generator, same batch), so the two can be compared number for number.

Checkpoints. ``global_step_N/actor`` (and ``critic``) are consolidated ``save_pretrained``
directories written by the driver, so there is no merge step; ``global_step_N/dcp/<role>`` holds the
optimizer shards in ``torch.distributed.checkpoint`` format, which reshards on load, so a run saved
on W workers resumes on any number. The LR schedule and skipped-step counts are in
``trainer_state.pt``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tearless.config import Config
from tearless.distributed import world_size
from tearless.distributed.group import ActorGroup, CriticGroup, RefGroup, WorkerGroup, ensure_ray
from tearless.distributed.worker import WorkerSpec
from tearless.workers.critic import critic_settings


class RayWorkers:
    """The groups of one run and their role facades (``actor``, ``ref``, ``critic``; None if unused)."""

    def __init__(
        self,
        cfg: Config,
        *,
        roles: list[str],
        paths: dict[str, str],
        total_steps: int,
        device: str,
        sync_to: list[Callable[[dict], None]],
        critic_model: torch.nn.Module | None,
        run_dir: Path,
    ) -> None:
        t = cfg.trainer
        world = world_size(cfg)
        self.world = world
        pools = [tuple(roles)] if t.colocate else [(r,) for r in roles]
        self.groups: dict[str, WorkerGroup] = {}
        ensure_ray(world * len(pools))
        try:
            for pool in pools:
                spec = WorkerSpec(cfg, pool, paths, total_steps, device, t.worker_timeout_s)
                group = WorkerGroup(spec, world, name="+".join(pool), run_dir=run_dir)
                self.groups.update({r: group for r in pool})
        except BaseException:
            self.close()
            raise
        self.actor = ActorGroup(self.groups["actor"], cfg, sync_to)
        self.ref = RefGroup(self.groups["ref"], cfg) if "ref" in self.groups else None
        self.critic = (
            CriticGroup(
                self.groups["critic"], critic_settings(cfg), cfg.actor_rollout_ref.rollout.n, critic_model
            )
            if "critic" in self.groups
            else None
        )

    def _trained(self) -> list[str]:
        return [r for r in ("actor", "critic") if r in self.groups]

    def save_shards(self, checkpoint_dir: Path) -> None:
        """Write each trained role's optimizer shards under ``checkpoint_dir/dcp/<role>``."""
        for role in self._trained():
            self.groups[role].call(
                "save", role, str(checkpoint_dir / "dcp" / role), what=f"{role} checkpoint"
            )

    def trainer_state(self) -> dict[str, Any]:
        """The replicated training state of each trained role, and the world size that saved it."""
        state: dict[str, Any] = {"world_size": self.world}
        for role in self._trained():
            state[role] = self.groups[role].call("train_state", role, ranks=[0], what=f"{role} state")[0]
        return state

    def load(self, checkpoint_dir: Path, state: dict[str, Any]) -> None:
        """Restore optimizer shards (resharded to this world size) and each role's schedule."""
        if "workers" not in state:
            raise ValueError(
                f"{checkpoint_dir} was written by the single-process trainer (trainer.placement=local); "
                "resume it with trainer.placement=local, or start the Ray run from its actor/ directory "
                "with actor_rollout_ref.model.path and resume_mode=disable"
            )
        for role in self._trained():
            self.groups[role].call(
                "load",
                role,
                str(checkpoint_dir / "dcp" / role),
                state["workers"][role],
                what=f"{role} resume",
            )
        self.actor.skipped_steps = state["workers"]["actor"]["skipped_steps"]

    def close(self) -> None:
        for group in {id(g): g for g in self.groups.values()}.values():
            group.close()
