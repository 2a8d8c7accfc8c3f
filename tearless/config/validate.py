"""The RL config's validation: one pass, before anything heavy, that raises ``ConfigError`` naming the
first wrong key and its fix.

Each idea is checked in a module of its own beside this one (``validate_sizes.py``, ``validate_loss.py``,
… ``validate_multi_turn.py``), from the small checks of :mod:`tearless.config.errors`. The order of the
calls below is part of the behaviour: it decides which error a config with several gets first.
"""

from __future__ import annotations

from tearless.config.external import import_external_libs
from tearless.config.schema import Config
from tearless.config.validate_algorithm import (
    validate_dynamic_sampling,
    validate_estimators,
    validate_group_size,
)
from tearless.config.validate_async import validate_is_cap, validate_offpolicy
from tearless.config.validate_critic import validate_critic
from tearless.config.validate_data import validate_data_files, validate_truncation
from tearless.config.validate_distill import validate_distill
from tearless.config.validate_lora import validate_lora
from tearless.config.validate_loss import validate_dual_clip, validate_loss
from tearless.config.validate_multi_turn import validate_multi_turn
from tearless.config.validate_optim import validate_schedule
from tearless.config.validate_placement import validate_placement, validate_workers
from tearless.config.validate_precision import (
    validate_fsdp_dtypes,
    validate_model_dtype,
    validate_rollout_dtype,
)
from tearless.config.validate_ranges import validate_ranges
from tearless.config.validate_reward import validate_reward, validate_step_reward
from tearless.config.validate_rollout import validate_sampling, validate_vllm
from tearless.config.validate_sizes import validate_sizes, validate_update_batches
from tearless.config.validate_task import validate_forget_carry, validate_task
from tearless.config.validate_trainer import validate_device_and_loggers, validate_resume
from tearless.config.validate_vision import validate_vision


def validate(cfg: Config) -> None:
    """Raise ``ConfigError`` naming the first key that is wrong and how to fix it."""
    # First: a loss or estimator the user's modules register must be in the registries checked below.
    import_external_libs(cfg.actor_rollout_ref.model)
    validate_vision(cfg)  # first: a vision-language run's refusals name what it lacks, not a package
    validate_sizes(cfg)
    validate_update_batches(cfg)
    validate_loss(cfg)
    validate_offpolicy(cfg)
    validate_estimators(cfg)
    validate_critic(cfg)
    validate_dynamic_sampling(cfg)
    validate_distill(cfg)
    validate_group_size(cfg)
    validate_dual_clip(cfg)
    validate_sampling(cfg)
    validate_schedule("actor_rollout_ref.actor.optim", cfg.actor_rollout_ref.actor.optim)
    validate_model_dtype(cfg)
    validate_lora(cfg)
    validate_truncation(cfg)
    validate_resume(cfg)
    validate_device_and_loggers(cfg)
    validate_reward(cfg)
    validate_workers(cfg)
    validate_rollout_dtype(cfg)
    validate_placement(cfg)
    validate_fsdp_dtypes(cfg)
    validate_is_cap(cfg)
    validate_vllm(cfg)
    validate_data_files(cfg)
    validate_ranges(cfg)
    validate_task(cfg)
    validate_step_reward(cfg)
    validate_multi_turn(cfg)
    validate_forget_carry(cfg)
