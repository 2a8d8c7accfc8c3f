"""Checks of values a run would only trip over later, or never notice: non-finite numbers anywhere,
the optimizers' settings, coefficients that must not be negative, probabilities outside [0, 1]."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from tearless.config.derived import critic_enabled
from tearless.config.errors import fail, in_range, positive
from tearless.config.schema import Config
from tearless.config.validate_optim import validate_optim


def _numbers(obj: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted key, value) of every float field of a config, in nested sections and lists (betas);
    the user's own ``reward_kwargs`` are theirs to check."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _numbers(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _numbers(v, prefix)
    elif isinstance(obj, float):
        yield prefix, obj


def validate_ranges(cfg: Config) -> None:
    """Raise ``ConfigError`` for the first value out of its range, in the order of the docstring above."""
    for key, value in _numbers(cfg):
        if not math.isfinite(value):
            fail(key, f"must be a finite number, got {value}", "Set a finite value.")
    arr, alg, t = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    validate_optim("actor_rollout_ref.actor.optim", arr.actor.optim)
    if critic_enabled(cfg):
        validate_optim("critic.optim", cfg.critic.optim)
        positive("critic.grad_clip", cfg.critic.grad_clip)
    for key, value in [
        ("actor_rollout_ref.actor.clip_ratio", arr.actor.clip_ratio),
        ("actor_rollout_ref.actor.clip_ratio_low", arr.actor.clip_ratio_low),
        ("actor_rollout_ref.actor.clip_ratio_high", arr.actor.clip_ratio_high),
        ("actor_rollout_ref.actor.kl_loss_coef", arr.actor.kl_loss_coef),
        ("algorithm.kl_ctrl.kl_coef", alg.kl_ctrl.kl_coef),
        ("trainer.rollout_log_max_mb", t.rollout_log_max_mb),
        ("trainer.critic_warmup", t.critic_warmup),
        ("task.warmup_steps", cfg.task.warmup_steps),
    ]:
        if value is not None:
            positive(key, value, allow_zero=True)
    if t.num_rollout_samples < -1:
        fail(
            "trainer.num_rollout_samples",
            f"must be -1 (every sample), 0 (none) or a count, got {t.num_rollout_samples}",
            "Use -1 to record every prompt group of each step.",
        )
    for key, value in [("algorithm.gamma", alg.gamma), ("algorithm.lam", alg.lam)]:
        in_range(key, value, 0.0, 1.0, "γ and λ are in [0, 1]; 1.0 is the usual value for LLM RL.")
    if alg.kl_ctrl.type == "adaptive":
        positive("algorithm.kl_ctrl.target_kl", alg.kl_ctrl.target_kl)
        positive("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon)
    val = arr.rollout.val_kwargs
    in_range("actor_rollout_ref.rollout.val_kwargs.top_p", val.top_p, 0, 1, "1.0 disables it.", low_open=True)
    for key, value in [
        ("actor_rollout_ref.rollout.top_k", arr.rollout.top_k),
        ("actor_rollout_ref.rollout.val_kwargs.top_k", val.top_k),
    ]:
        if value < -1:
            fail(key, f"must be -1 (off) or a number of tokens, got {value}", "Use -1 to disable top-k.")
    for key, value in [("task.num_train", cfg.task.num_train), ("task.num_val", cfg.task.num_val)]:
        positive(key, value)
