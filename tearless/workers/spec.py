"""What a rank of a worker group builds (:class:`RankSpec`), shared by the group, the rank and Ray."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tearless.config import Config


@dataclasses.dataclass
class RankSpec:
    """What a rank builds. ``model_path`` holds the initial weights; ``resume_dir`` a checkpoint whose
    ``actor/`` (and ``critic/``) replace them; ``tool_config`` is the embedded task's tool YAML,
    used when ``multi_turn.tool_config_path`` is null."""

    cfg: Config
    roles: tuple[str, ...]
    rollout: bool
    model_path: str
    total_steps: int
    device: str
    resume_dir: str | None = None
    reward_fn: Callable[..., Any] | None = None
    tool_config: str | None = None
