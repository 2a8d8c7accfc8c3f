"""Checks of the dtypes: the model's, the rollout engine's, and each role's FSDP parameter dtype."""

from __future__ import annotations

from tearless.config.errors import fail, one_of
from tearless.config.schema import Config

DTYPES = ("float32", "bfloat16", "float16")
# veRL's short spellings, taken where veRL takes them (the rollout's and FSDP's dtype keys).
SPELLINGS = (*DTYPES, "fp32", "bf16", "fp16")


def validate_model_dtype(cfg: Config) -> None:
    """Raise ``ConfigError`` for a model dtype that is not one of :data:`DTYPES`."""
    one_of("actor_rollout_ref.model.dtype", cfg.actor_rollout_ref.model.dtype, DTYPES)


def validate_rollout_dtype(cfg: Config) -> None:
    """Raise ``ConfigError`` for a rollout dtype that is not one of :data:`SPELLINGS`."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.dtype is not None:
        one_of("actor_rollout_ref.rollout.dtype", rollout.dtype, SPELLINGS)


def validate_fsdp_dtypes(cfg: Config) -> None:
    """Raise ``ConfigError`` for an unknown FSDP parameter dtype, or float16 on a role that trains."""
    arr = cfg.actor_rollout_ref
    for key, fsdp in [
        ("actor_rollout_ref.actor.fsdp_config.param_dtype", arr.actor.fsdp_config),
        ("actor_rollout_ref.ref.fsdp_config.param_dtype", arr.ref.fsdp_config),
        ("actor_rollout_ref.teacher.fsdp_config.param_dtype", arr.teacher.fsdp_config),
        ("critic.model.fsdp_config.param_dtype", cfg.critic.model.fsdp_config),
    ]:
        if fsdp.param_dtype is not None:
            one_of(key, fsdp.param_dtype, ("auto", *SPELLINGS))
        forward_only = key.startswith(("actor_rollout_ref.ref.", "actor_rollout_ref.teacher."))
        if fsdp.param_dtype in ("float16", "fp16") and not forward_only:
            fail(
                key,
                "float16 training needs a dynamic loss scaler (its gradients underflow below 6e-8), "
                "which tearless does not run",
                "Use bfloat16 (float32's range, the same tensor-core speed on GPUs that have it) or float32; "
                "the forward-only reference may keep float16.",
            )
