"""Checks of the actor's loss keys: the policy-loss mode, its knobs, its aggregation and the dual-clip cap."""

from __future__ import annotations

from tearless.config.errors import fail, one_of, positive
from tearless.config.schema import Config

ACTOR = "actor_rollout_ref.actor"


def validate_loss(cfg: Config) -> None:
    """Raise ``ConfigError`` for a loss key that is out of range or cannot apply to the chosen mode."""
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.algos import AGG_MODES, POLICY_LOSSES
    from tearless.algos.losses import FIXED_AGG_MODES

    actor = cfg.actor_rollout_ref.actor
    pl, mode = actor.policy_loss, actor.policy_loss.loss_mode
    one_of(f"{ACTOR}.policy_loss.loss_mode", mode, sorted(POLICY_LOSSES))
    if actor.loss_agg_mode is not None:
        one_of(f"{ACTOR}.loss_agg_mode", actor.loss_agg_mode, list(AGG_MODES))
    own = FIXED_AGG_MODES.get(mode)
    if own is not None and actor.loss_agg_mode not in (None, own):
        fail(
            f"{ACTOR}.loss_agg_mode",
            f"policy_loss.loss_mode={mode} aggregates its loss with {own} by definition (veRL 0.9.1 "
            f"pins it too), so loss_agg_mode={actor.loss_agg_mode} could not apply to it",
            f"Remove loss_agg_mode (null: {own} for the policy loss, token-mean for the KL and entropy "
            f"terms, as veRL) or set it to {own} (every term).",
        )
    for key, value in [
        (f"{ACTOR}.policy_loss.clip_cov_ratio", pl.clip_cov_ratio),
        (f"{ACTOR}.policy_loss.kl_cov_ratio", pl.kl_cov_ratio),
    ]:
        positive(key, value)
        if value > 1:
            fail(key, f"is a fraction of the tokens, got {value}", "Use a value in (0, 1]; veRL's is 2e-4.")
    if pl.clip_cov_lb >= pl.clip_cov_ub:
        fail(
            f"{ACTOR}.policy_loss.clip_cov_ub",
            f"must be above clip_cov_lb, got lb={pl.clip_cov_lb}, ub={pl.clip_cov_ub}",
            "The droppable covariance range is (lb, ub); veRL's is (1, 5).",
        )
    positive(f"{ACTOR}.policy_loss.ppo_kl_coef", pl.ppo_kl_coef, allow_zero=True)
    positive(f"{ACTOR}.tau_pos", actor.tau_pos)
    positive(f"{ACTOR}.tau_neg", actor.tau_neg)
    if pl.dro_beta is not None:
        positive(f"{ACTOR}.policy_loss.dro_beta", pl.dro_beta)
    elif mode == "dro":
        fail(
            f"{ACTOR}.policy_loss.dro_beta",
            "policy_loss.loss_mode=dro needs the coefficient β of its ½β(log π − log π_old)² penalty",
            "Set actor_rollout_ref.actor.policy_loss.dro_beta to a positive value (e.g. 0.1).",
        )
    for key, value in [
        (f"{ACTOR}.loss_scale_factor", actor.loss_scale_factor),
        ("critic.loss_scale_factor", cfg.critic.loss_scale_factor),
    ]:
        if value is not None:
            positive(key, value)


def validate_dual_clip(cfg: Config) -> None:
    """Raise ``ConfigError`` unless dual-clip's cap c is above 1 (it bounds the loss at c·|A| for A < 0)."""
    c = cfg.actor_rollout_ref.actor.clip_ratio_c
    if c <= 1:
        fail(
            f"{ACTOR}.clip_ratio_c",
            f"must be > 1, got {c}",
            "Dual-clip caps the loss at c·|A|; c = 3 is the usual value.",
        )
