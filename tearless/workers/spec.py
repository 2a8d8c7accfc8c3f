"""What a rank of a worker group builds (:class:`RankSpec`), shared by the group, the rank and Ray,
and the trained roles' update settings (:func:`role_settings`), built once from the resolved config."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tearless.config import Config, ConfigError
from tearless.config.derived import loss_scale_factor
from tearless.workers.actor import actor_settings
from tearless.workers.critic import critic_settings, update_settings
from tearless.workers.schedule import UpdateSettings


def resolve_device(name: str) -> str:
    """``trainer.device`` as seen from *this* process: ``auto`` is ``cuda`` where this process sees a
    GPU, else ``cpu``. A worker decides for itself (a CPU-only head node must not make GPU workers
    train on their CPUs); ``cuda`` without a visible GPU is refused in one line."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            "trainer.device=cuda, but this process sees no CUDA device (a CPU build of torch, or "
            "CUDA_VISIBLE_DEVICES hides them); install a CUDA build of torch or set trainer.device=cpu"
        )
    return name


@dataclasses.dataclass
class RankSpec:
    """What a rank builds. ``model_path`` holds the initial weights; ``resume_dir`` a checkpoint whose
    ``actor/`` (and ``critic/``) replace them; ``tool_config`` is the embedded task's tool YAML,
    used when ``multi_turn.tool_config_path`` is null. ``device`` is ``trainer.device`` as asked
    (``auto`` included): each rank resolves it in its own process (:func:`resolve_device`).
    ``models`` are roles' models already in memory, used as given instead of loading ``model_path``
    (an in-process group, :class:`~tearless.workers.group.LocalWorkers`, over a model that a test
    or a benchmark holds; the trainer gives none)."""

    cfg: Config
    roles: tuple[str, ...]
    rollout: bool
    model_path: str
    total_steps: int
    device: str
    # Shard the models over a process group even at world size 1 (FSDP2 over one rank): what one
    # GPU process does when a role offloads its parameters or optimizer state (see Rank.setup).
    sharded: bool = False
    resume_dir: str | None = None
    reward_fn: Callable[..., Any] | None = None
    tool_config: str | None = None
    models: dict[str, torch.nn.Module] = dataclasses.field(default_factory=dict)


def role_settings(cfg: Config) -> dict[str, UpdateSettings]:
    """The update schedule of each trained role (``actor``, ``critic``) from the resolved config:
    mini-batches of ``ppo_mini_batch_size × rollout.n`` rows, the critic's null fields taken from the
    actor's (:func:`~tearless.workers.critic.critic_settings`), seq-mean-token-sum-norm's constant S
    (:func:`~tearless.config.derived.loss_scale_factor`). A group builds them once to plan the
    updates, a rank once for the roles it holds."""
    n = cfg.actor_rollout_ref.rollout.n
    return {
        "actor": actor_settings(cfg.actor_rollout_ref.actor, n, loss_scale_factor(cfg)),
        "critic": update_settings(critic_settings(cfg), n),
    }
