"""The names of the Python API (:mod:`tearless.api`), listed once.

``tearless.api.__all__`` is this list, and the package serves each name lazily as ``tearless.X``
(PEP 562): the list lives in a module with no imports, so ``import tearless`` reads it without
importing the API, the config code behind it, or torch.
"""

from __future__ import annotations

API_NAMES: tuple[str, ...] = (
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
)
