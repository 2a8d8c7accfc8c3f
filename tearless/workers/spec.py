"""What a rank of a worker group builds (:class:`RankSpec`), shared by the group, the rank and Ray."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from tearless.config import Config, ConfigError


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
    (``auto`` included): each rank resolves it in its own process (:func:`resolve_device`)."""

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
