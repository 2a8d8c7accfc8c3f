"""tearless: RL post-training that runs on a laptop CPU and scales out.

The Python API (:mod:`tearless.api`): ``tearless.Trainer(model, reward_funcs, args=tearless.RLConfig(...),
train_dataset=rows).train()``, with the config objects ``RLConfig``, ``SFTConfig``, ``DPOConfig`` and
their sections (``DataConfig``, ``ActorConfig``, …). ``tearless.train(config, overrides)`` is the
same from a config and dotted overrides. Heavy modules (torch, transformers) are imported only when
something is used, so ``import tearless`` stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tearless.api_names import API_NAMES

# local imports: ``import tearless`` stays light: the API (and torch behind it) loads on first use

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # the API's names are served lazily (PEP 562), so that importing tearless imports no config code
    if name in API_NAMES:
        from tearless import api

        return getattr(api, name)
    raise AttributeError(f"module 'tearless' has no attribute {name!r}")


def train(
    config: Any = None,
    overrides: Iterable[str] = (),
    *,
    preset: str | None = None,
    reward_fn: Callable[..., Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run RL training and return its summary (run directory, validation before and after).

    ``config`` is a :class:`tearless.RLConfig`, a nested dict or a YAML path; ``overrides`` are dotted
    ``key=value`` strings applied last; ``preset`` (``grpo``, ``ppo``, ``dapo``, …) is merged
    before both. ``reward_fn`` is a Python callable with veRL's
    signature ``(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`` that
    replaces the built-in scorers (it runs where rewards are scored: forked reward workers, so
    closures work, or Ray worker processes, which unpickle it). The same as
    ``tearless.Trainer(reward_funcs=reward_fn, args=config, overrides=overrides, preset=preset).train()``.
    """
    from tearless.api import Trainer

    return Trainer(reward_funcs=reward_fn, args=config, overrides=overrides, preset=preset, log=log).train()


# Spelled out (mkdocstrings reads __all__ statically and takes string literals only); tests/api checks
# that it is __version__, train and API_NAMES.
__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "MetricCallback",
    "ModelConfig",
    "OptimConfig",
    "RLConfig",
    "RMConfig",
    "RewardFunc",
    "RewardModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "SummedReward",
    "Trainer",
    "TrainerConfig",
    "__version__",
    "train",
]
