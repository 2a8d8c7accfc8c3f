"""A user's module for ``actor_rollout_ref.model.external_lib``: it registers an advantage estimator and
a policy loss under names of its own, with the maths of ``grpo`` and ``vanilla``, as a user's code
would register new ones. Tests import it as ``config.user_registry`` (tests/ is on the path, in Ray
workers too)."""

from tearless.algos import ADV_ESTIMATORS, POLICY_LOSSES, register_adv_estimator, register_policy_loss

ESTIMATOR, LOSS = "user_grpo", "user_vanilla"
register_adv_estimator(ESTIMATOR)(ADV_ESTIMATORS["grpo"])
register_policy_loss(LOSS)(POLICY_LOSSES["vanilla"])
