"""tearless: RL post-training that runs on a laptop CPU and scales out.

``tearless.train(config, overrides)`` runs the RL trainer from Python; heavy modules (torch,
transformers) are imported only when something is used, so ``import tearless`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__version__ = "0.1.0"


def train(
    config: Any = None,
    overrides: Iterable[str] = (),
    *,
    preset: str | None = None,
    reward_fn: Callable[..., Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run RL training and return its summary (run directory, validation before and after).

    ``config`` is a :class:`tearless.config.Config`, a nested dict or a YAML path; ``overrides`` are
    dotted ``key=value`` strings applied last; ``preset`` (``grpo``, ``ppo``, ``dapo``, …) is merged
    before both. ``reward_fn`` is a Python callable with veRL's
    signature ``(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`` that
    replaces the built-in scorers (it runs where rewards are scored: forked reward workers, so
    closures work, or Ray worker processes, which unpickle it).
    """
    from tearless.config import load_config
    from tearless.trainers.rl import RLTrainer

    cfg = load_config(config, overrides, preset=preset)
    return RLTrainer(cfg, reward_fn=reward_fn, log=log).fit()


__all__ = ["__version__", "train"]
