"""Checks of the ``algorithm`` section: the advantage and KL estimators by name, dynamic sampling
(``filter_groups``), and the group size the group-relative estimators need."""

from __future__ import annotations

from tearless.config.errors import fail, one_of, positive
from tearless.config.schema import Config

# The estimators that compare responses within a prompt's group.
GROUP_ESTIMATORS = ("rloo", "grpo_passk", "opo")


def validate_estimators(cfg: Config) -> None:
    """Raise ``ConfigError`` for a KL or advantage estimator that is not registered."""
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.algos import ADV_ESTIMATORS, KL_ESTIMATORS

    straight_through = [f"{k}+" for k in KL_ESTIMATORS if k != "full"]
    one_of(
        "actor_rollout_ref.actor.kl_loss_type",
        cfg.actor_rollout_ref.actor.kl_loss_type,
        [*KL_ESTIMATORS, *straight_through],
    )
    one_of("algorithm.kl_penalty", cfg.algorithm.kl_penalty, [k for k in KL_ESTIMATORS if k != "full"])
    one_of("algorithm.kl_ctrl.type", cfg.algorithm.kl_ctrl.type, ("fixed", "adaptive"))
    one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, sorted(ADV_ESTIMATORS))


def validate_dynamic_sampling(cfg: Config) -> None:
    """Raise ``ConfigError`` for ``filter_groups`` settings DAPO's dynamic sampling cannot run with, or a
    generation batch (``data.gen_batch_size``) that is not positive."""
    fg = cfg.algorithm.filter_groups
    if fg.enable:
        one_of("algorithm.filter_groups.metric", fg.metric, ("score",))
        positive("algorithm.filter_groups.max_num_gen_batches", fg.max_num_gen_batches, allow_zero=True)
        if cfg.actor_rollout_ref.rollout.n < 2:
            fail(
                "algorithm.filter_groups.enable",
                "dynamic sampling keeps groups whose scores differ, which "
                "needs at least 2 responses per prompt",
                "Set actor_rollout_ref.rollout.n >= 2.",
            )
    if cfg.data.gen_batch_size is not None:
        positive("data.gen_batch_size", cfg.data.gen_batch_size)


def validate_group_size(cfg: Config) -> None:
    """Raise ``ConfigError`` when a group-relative estimator has one response per prompt."""
    if cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and cfg.actor_rollout_ref.rollout.n < 2:
        fail(
            "actor_rollout_ref.rollout.n",
            f"{cfg.algorithm.adv_estimator} compares responses within a group, "
            "so it needs at least 2 per prompt",
            "Set actor_rollout_ref.rollout.n >= 2.",
        )
