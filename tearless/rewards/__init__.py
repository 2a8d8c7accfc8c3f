"""Rewards: rule-based scorers by ``data_source``, custom reward functions, and the reward manager."""

from tearless.rewards.manager import RewardManager, ScoreResult, load_reward_function
from tearless.rewards.registry import compute_score, get_scorer, known_sources, register_scorer

__all__ = [
    "RewardManager",
    "ScoreResult",
    "compute_score",
    "get_scorer",
    "known_sources",
    "load_reward_function",
    "register_scorer",
]
