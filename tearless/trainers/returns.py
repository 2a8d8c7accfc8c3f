"""Step 3 of an RL step, in the driver: the batch's token rewards (each score on its response's last
model token, step scores on their steps' last tokens, the KL penalty when it is in the reward) and
the configured estimator's advantages and returns, grouped by each prompt's ``uid``."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from tearless.algos import compute_advantage
from tearless.config import Config
from tearless.rewards.steps import rollout_token_rewards
from tearless.rollout.batch import Rollout
from tearless.workers.actor import reward_kl


def token_rewards(
    cfg: Config, td: TensorDict, rollout: Rollout, tokenizer: Any, kl_ctrl: Any, metrics: dict
) -> torch.Tensor:
    """(B, R) rewards: each score on its response's last model token (and, when the scorer gave any,
    step scores on the last token of each reasoning step, :mod:`tearless.rewards.steps`; their mask
    goes to ``td["step_mask"]``), minus β·KL(π_old ‖ π_ref) per token when the KL is in the reward
    (``kl_ctrl`` then updated with the step's KL)."""
    mask = td["response_mask"]
    rewards, td["step_mask"] = rollout_token_rewards(
        rollout.scores, rollout.extras, rollout.texts, rollout.out, tokenizer, cfg.reward_model.step_reward
    )
    alg = cfg.algorithm
    if alg.use_kl_in_reward:
        kl, current_kl = reward_kl(td["old_log_prob"], td["ref_log_prob"], mask, alg.kl_penalty)
        rewards = rewards - kl_ctrl.value * kl
        metrics["actor/reward_kl_penalty"] = current_kl
        metrics["actor/reward_kl_penalty_coeff"] = kl_ctrl.value
        kl_ctrl.update(current_kl, n_steps=len(mask))
    return rewards


def advantages(
    cfg: Config, td: TensorDict, rewards: torch.Tensor, rollout: Rollout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns of ``algorithm.adv_estimator``, grouped by uid (ReMax's baseline: the
    score of each response's prompt's greedy response, generated with the samples)."""
    alg = cfg.algorithm
    return compute_advantage(
        alg.adv_estimator,
        token_level_rewards=rewards,
        response_mask=td["response_mask"],
        index=rollout.uids,
        gamma=alg.gamma,
        lam=alg.lam,
        norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        reward_baselines=rollout.baselines,
        values=td.get("values", None),
        step_mask=td["step_mask"],
        teacher_log_prob=td.get("teacher_log_prob", None),
        student_log_prob=td.get("student_log_prob", None),
        distill_reward_coef=alg.distill_reward_coef,
    )
