"""Checks of the off-policy keys: ``algorithm.rollout_correction.*`` (the TIS weight and cap, masked IS,
the veto, bypass mode) and ``async_training``."""

from __future__ import annotations

from tearless.config.errors import count, fail, in_range, one_of
from tearless.config.schema import Config

RC = "algorithm.rollout_correction"


def _validate_correction(cfg: Config) -> None:
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is_threshold_lower is not None:
        if rc.rollout_is is None:
            fail(
                f"{RC}.rollout_is_threshold_lower",
                "is a bound of the TIS weight, and rollout_is is null (no weight)",
                f"Set {RC}.rollout_is=token or sequence, or remove the lower bound.",
            )
        in_range(
            f"{RC}.rollout_is_threshold_lower",
            rc.rollout_is_threshold_lower,
            0,
            1,
            "A floor above 1 would raise the weight of samples the policies agree on.",
            low_open=True,
        )
    if rc.rollout_rs is None:
        for key in ("rollout_rs_threshold", "rollout_rs_threshold_lower"):
            if getattr(rc, key) is not None:
                fail(
                    f"{RC}.{key}",
                    "is a bound of masked IS, and rollout_rs is null (no rejection)",
                    f"Set {RC}.rollout_rs=token, sequence or geometric, or remove {key}.",
                )
    else:
        one_of(f"{RC}.rollout_rs", rc.rollout_rs, ("token", "sequence", "geometric"))
        upper, lower = rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower
        if upper is None or upper <= 1:
            fail(
                f"{RC}.rollout_rs_threshold",
                f"must be set and > 1 with rollout_rs={rc.rollout_rs}, got {upper}",
                "Ratios above it are rejected; 2.0 for token or sequence, about 1.001 for geometric.",
            )
        if lower is not None:
            in_range(
                f"{RC}.rollout_rs_threshold_lower",
                lower,
                0,
                1,
                "Ratios below it are rejected; null = 1/rollout_rs_threshold, 0 = no lower bound.",
                high_open=True,
            )
    veto = rc.rollout_token_veto_threshold
    if veto is not None:
        in_range(
            f"{RC}.rollout_token_veto_threshold",
            veto,
            0,
            1,
            "A response is rejected when a token's ratio falls below it; veRL suggests 1e-4.",
            low_open=True,
            high_open=True,
        )
    if rc.bypass_mode:
        keys = ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")
        on = [k for k in keys if getattr(rc, k) is not None]
        if on:
            fail(
                f"{RC}.bypass_mode",
                f"takes π_old from the rollout, so π_old/π_rollout = 1 and {', '.join(on)} could never act",
                f"Set {RC}.bypass_mode=false (π_old recomputed by the trainer) or remove {', '.join(on)}.",
            )


def _validate_async(cfg: Config) -> None:
    # torch (the engine registry's modules): ``import tearless.config`` stays torch-free
    from tearless.rollout.engine import ENGINES, engine_capabilities

    at = cfg.async_training
    key = "async_training"
    count(f"{key}.max_staleness", at.max_staleness, "0 = synchronous, 1 = one-step-off.")
    if not at.enable:
        if at.partial_rollout:
            # Without async_training the loop is synchronous (k = 0): no generation is in flight while
            # the weights change, so the key could never act.
            fail(
                f"{key}.partial_rollout",
                "needs async_training.enable=true (the synchronous loop has no generation in flight "
                "during a weight update to continue)",
                "Enable it, or remove it.",
            )
        return
    if at.partial_rollout:
        rollout = cfg.actor_rollout_ref.rollout
        # (an unknown engine name is refused by name in validate_rollout.py)
        if rollout.name in ENGINES and not engine_capabilities(rollout.name).resumes_partial:
            fail(
                f"{key}.partial_rollout",
                f"the {rollout.name} engine cannot take new weights between two tokens of a response",
                "Set async_training.partial_rollout=false, or use an engine that can (hf, vllm).",
            )
        if rollout.multi_turn.enable:
            fail(
                f"{key}.partial_rollout",
                "is not supported with multi-turn tool use (the agent loop's turns are separate engine "
                "calls, which would each need the interruption)",
                "Set async_training.partial_rollout=false, or "
                "actor_rollout_ref.rollout.multi_turn.enable=false.",
            )


def validate_is_cap(cfg: Config) -> None:
    """Raise ``ConfigError`` for a TIS weight level other than token or sequence, or a cap C below 1."""
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is not None:
        one_of(f"{RC}.rollout_is", rc.rollout_is, ("token", "sequence"))
        if rc.rollout_is_threshold < 1:
            fail(
                f"{RC}.rollout_is_threshold",
                f"must be >= 1, got {rc.rollout_is_threshold}",
                "The cap C truncates weights above it; 2.0 is veRL's default.",
            )


def validate_offpolicy(cfg: Config) -> None:
    """Raise ``ConfigError`` for an off-policy key out of range or a combination that cannot act."""
    _validate_correction(cfg)
    _validate_async(cfg)
