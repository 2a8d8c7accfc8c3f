"""Checks of on-policy distillation: ``algorithm.adv_estimator=on_policy_distill``, its teacher and the
weight of the task reward mixed in."""

from __future__ import annotations

from tearless.config.derived import distills
from tearless.config.errors import fail
from tearless.config.schema import Config


def validate_distill(cfg: Config) -> None:
    """Raise ``ConfigError`` unless on_policy_distill has a teacher, a teacher has on_policy_distill, and a
    task-reward mix has groups to normalise over."""
    alg, teacher = cfg.algorithm, cfg.actor_rollout_ref.teacher
    distill = distills(cfg)
    if distill and not teacher.model.path:
        fail(
            "actor_rollout_ref.teacher.model.path",
            "algorithm.adv_estimator=on_policy_distill needs a teacher",
            "Set it to a causal-LM directory or Hub ID that shares the actor's tokenizer.",
        )
    if teacher.model.path and not distill:
        fail(
            "actor_rollout_ref.teacher.model.path",
            f"a teacher is only used by algorithm.adv_estimator=on_policy_distill (now {alg.adv_estimator})",
            "Set algorithm.adv_estimator=on_policy_distill, or remove the teacher.",
        )
    if not isinstance(alg.distill_reward_coef, (int, float)) or alg.distill_reward_coef < 0:
        fail(
            "algorithm.distill_reward_coef",
            f"must be a number >= 0, got {alg.distill_reward_coef!r}",
            "Set 0 (pure distillation) or a positive weight of the task reward's GRPO advantage.",
        )
    if alg.distill_reward_coef and not distill:
        fail(
            "algorithm.distill_reward_coef",
            f"weighs the task reward in on_policy_distill only (algorithm.adv_estimator={alg.adv_estimator})",
            "Remove it, or set algorithm.adv_estimator=on_policy_distill.",
        )
    if distill and alg.distill_reward_coef and cfg.actor_rollout_ref.rollout.n < 2:
        fail(
            "algorithm.distill_reward_coef",
            "the task reward's GRPO advantage compares responses within a group, so it needs at least 2",
            "Set actor_rollout_ref.rollout.n >= 2, or algorithm.distill_reward_coef=0.",
        )
