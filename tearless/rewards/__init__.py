"""Rewards: rule-based scorers by ``data_source``, custom reward functions, and the reward managers."""

from tearless.rewards.manager import (
    RewardError,
    RewardFunctionError,
    RewardManager,
    ScoreResult,
    load_reward_function,
)
from tearless.rewards.managers import REWARD_MANAGERS, make_reward_manager, reward_config_problems
from tearless.rewards.registry import (
    UnknownDataSource,
    compute_score,
    get_scorer,
    known_sources,
    register_scorer,
)

__all__ = [
    "REWARD_MANAGERS",
    "RewardError",
    "RewardFunctionError",
    "RewardManager",
    "ScoreResult",
    "UnknownDataSource",
    "compute_score",
    "get_scorer",
    "known_sources",
    "load_reward_function",
    "make_reward_manager",
    "register_scorer",
    "reward_config_problems",
]
