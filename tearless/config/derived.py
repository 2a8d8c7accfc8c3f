"""Values the workers need that several config keys decide together (resolved where they are used)."""

from __future__ import annotations

from tearless.config.schema import ActorConfig, Config


def response_length(cfg: Config) -> int:
    """The response cap in tokens: ``rollout.response_length``, else ``data.max_response_length``."""
    return cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length


def loss_scale_factor(cfg: Config) -> float:
    """The constant S of ``seq-mean-token-sum-norm`` for the actor: ``actor.loss_scale_factor``, else the
    response cap. A constant, not the padded width of a step's rollout, so the step size does not change
    with the longest sample (veRL, TRL's ``dr_grpo`` and the Dr. GRPO paper all use the cap)."""
    given = cfg.actor_rollout_ref.actor.loss_scale_factor
    return float(given if given is not None else response_length(cfg))


def policy_loss_knobs(actor: ActorConfig) -> dict[str, float | None]:
    """The loss-mode knobs :func:`tearless.algos.policy_loss` takes from the actor section (veRL's
    ``actor.policy_loss.*`` and ``actor.tau_pos`` / ``tau_neg``); each mode reads only its own."""
    pl = actor.policy_loss
    return {
        "clip_cov_ratio": pl.clip_cov_ratio,
        "clip_cov_lb": pl.clip_cov_lb,
        "clip_cov_ub": pl.clip_cov_ub,
        "kl_cov_ratio": pl.kl_cov_ratio,
        "ppo_kl_coef": pl.ppo_kl_coef,
        "dro_beta": pl.dro_beta,
        "tau_pos": actor.tau_pos,
        "tau_neg": actor.tau_neg,
    }


def world_size(cfg: Config) -> int:
    """Ranks per pool: ``trainer.nnodes × trainer.n_gpus_per_node`` (CPU worker processes on CPU)."""
    return cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node


def uses_ray(cfg: Config) -> bool:
    """``trainer.placement`` is ray, or auto with more than one worker."""
    placement = cfg.trainer.placement
    return placement == "ray" or (placement == "auto" and world_size(cfg) > 1)


def critic_enabled(cfg: Config) -> bool:
    """A critic is trained when ``critic.enable`` says so, or (null) when the estimator is GAE."""
    enable = cfg.critic.enable
    return cfg.algorithm.adv_estimator == "gae" if enable is None else bool(enable)


def roles(cfg: Config) -> tuple[str, ...]:
    """The roles the training ranks hold: the actor, the reference when a KL term needs it
    (``actor.use_kl_loss`` or ``algorithm.use_kl_in_reward``), the teacher when the estimator is
    ``on_policy_distill``, the critic when it is enabled."""
    arr = cfg.actor_rollout_ref
    ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    return (
        ("actor",)
        + (("ref",) if ref else ())
        + (("teacher",) if distills(cfg) else ())
        + (("critic",) if critic_enabled(cfg) else ())
    )


def distills(cfg: Config) -> bool:
    """The run distils a teacher: ``algorithm.adv_estimator=on_policy_distill``."""
    return cfg.algorithm.adv_estimator == "on_policy_distill"
