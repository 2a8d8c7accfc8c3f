"""Checks of the reward: the user's reward function file, the ``reward_model`` section (through the
reward managers' own list of problems) and step rewards."""

from __future__ import annotations

import math
import re

from tearless.config.derived import response_length
from tearless.config.errors import existing_file, fail, one_of
from tearless.config.schema import Config
from tearless.rewards.managers import reward_config_problems


def validate_reward(cfg: Config) -> None:
    """Raise ``ConfigError`` for a reward function file that is not there, or the first problem the
    reward managers find in ``reward_model``."""
    crf = cfg.custom_reward_function
    if crf.path is not None:
        existing_file(
            "custom_reward_function.path",
            crf.path,
            "code",
            "Point it at a Python file that "
            f"defines {crf.name}(data_source, solution_str, ground_truth, extra_info=None).",
        )
    for key, problem, fix in reward_config_problems(cfg.reward_model, response_length(cfg)):
        fail(key, problem, fix)


def validate_step_reward(cfg: Config) -> None:
    """Raise ``ConfigError`` unless step rewards have a separator (a valid pattern when it is a regular
    expression), finite weights not both 0, and a known PRM kind (the PRM's path is checked with the
    other reward_model keys, in reward_config_problems)."""
    sr = cfg.reward_model.step_reward
    if not sr.separator:
        fail("reward_model.step_reward.separator", "is empty", "Use the text between steps, e.g. '\\n'.")
    if sr.separator_regex:
        try:
            re.compile(sr.separator)
        except re.error as exc:
            fail(
                "reward_model.step_reward.separator",
                f"is not a regular expression ({exc})",
                "Fix the pattern.",
            )
    for key in ("outcome_weight", "step_weight"):
        if not math.isfinite(getattr(sr, key)):
            fail(f"reward_model.step_reward.{key}", "must be a finite number", "Use e.g. 1.0.")
    if sr.outcome_weight == 0 and sr.step_weight == 0:
        fail(
            "reward_model.step_reward.step_weight",
            "and outcome_weight are both 0, so every reward is 0",
            "Give one of them a nonzero weight.",
        )
    one_of(
        "reward_model.step_reward.prm.kind", sr.prm.kind, ("token_classification", "causal_lm", "implicit")
    )
