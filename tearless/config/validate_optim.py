"""Checks of an optimizer section (the actor's and the critic's ``optim``): AdamW's betas and weight
decay, the learning-rate schedule and its fractions."""

from __future__ import annotations

from typing import Any

from tearless.config.errors import SCHEDULERS, fail, in_range, one_of, positive


def validate_schedule(prefix: str, optim: Any) -> None:
    """Raise ``ConfigError`` for a learning-rate schedule tearless does not run."""
    one_of(f"{prefix}.lr_scheduler_type", optim.lr_scheduler_type, SCHEDULERS)


def validate_optim(prefix: str, optim: Any) -> None:
    """Raise ``ConfigError`` for betas AdamW refuses, a negative decay, or a schedule fraction outside
    [0, 1]."""
    betas = optim.betas
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas):
        fail(
            f"{prefix}.betas", f"must be two numbers [beta1, beta2], got {list(betas)!r}", "Use [0.9, 0.999]."
        )
    for b in betas:
        in_range(f"{prefix}.betas", b, 0.0, 1.0, "Each beta is in [0, 1), e.g. [0.9, 0.999].", high_open=True)
    positive(f"{prefix}.weight_decay", optim.weight_decay, allow_zero=True)
    in_range(
        f"{prefix}.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0.0, 1.0, "A fraction of the run."
    )
    in_range(f"{prefix}.min_lr_ratio", optim.min_lr_ratio, 0.0, 1.0, "A fraction of lr.")
    positive(f"{prefix}.num_cycles", optim.num_cycles, allow_zero=True)
