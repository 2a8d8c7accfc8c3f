"""Checks of the ``critic`` section: whether GAE has its critic, and the critic's own update batches,
loss aggregation and optimizer."""

from __future__ import annotations

from tearless.config.derived import critic_enabled
from tearless.config.errors import fail, one_of, positive
from tearless.config.schema import Config
from tearless.config.validate_optim import validate_schedule


def validate_critic(cfg: Config) -> None:
    """Raise ``ConfigError`` when GAE's critic is switched off, or a key of the critic that runs is wrong."""
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.algos import AGG_MODES

    c, a = cfg.critic, cfg.actor_rollout_ref.actor
    if cfg.algorithm.adv_estimator == "gae" and c.enable is False:
        fail(
            "critic.enable",
            "algorithm.adv_estimator=gae needs the critic's values",
            "Remove critic.enable=false or pick a critic-free estimator (grpo, rloo, …).",
        )
    if not critic_enabled(cfg):
        return
    mini = c.ppo_mini_batch_size or a.ppo_mini_batch_size
    n = cfg.actor_rollout_ref.rollout.n
    positive("critic.ppo_mini_batch_size", mini)
    if cfg.data.train_batch_size % mini:
        fail(
            "critic.ppo_mini_batch_size",
            f"data.train_batch_size × rollout.n = {cfg.data.train_batch_size * n} "
            f"is not divisible by critic.ppo_mini_batch_size × n = {mini * n}",
            "Make data.train_batch_size a multiple of it (both count prompts).",
        )
    micro = c.ppo_micro_batch_size_per_gpu
    dynamic = a.use_dynamic_bsz if c.use_dynamic_bsz is None else c.use_dynamic_bsz
    if micro is not None and not dynamic and (mini * n) % micro:
        fail(
            "critic.ppo_micro_batch_size_per_gpu",
            f"critic mini-batch of {mini * n} responses is not divisible by {micro}",
            "Pick a divisor of the critic mini-batch's response count.",
        )
    if c.loss_agg_mode is not None:
        one_of("critic.loss_agg_mode", c.loss_agg_mode, list(AGG_MODES))
    positive("critic.cliprange_value", c.cliprange_value)
    positive("critic.optim.lr", c.optim.lr)
    validate_schedule("critic.optim", c.optim)
