"""Checks of the embedded task (``task.*``, used when ``data.train_files`` is null): its name, what the
chain_addition task needs, and the flawed teacher's carry-dropping rate."""

from __future__ import annotations

from tearless.config.derived import response_length
from tearless.config.errors import fail, one_of
from tearless.config.schema import Config
from tearless.tasks.chain_addition import RESPONSE_TOKENS, WARMUP_STEPS


def validate_task(cfg: Config) -> None:
    """Raise ``ConfigError`` for an unknown task, or a chain_addition run whose warm-up is too short to
    learn to add or whose responses cut off the task's worked answers."""
    one_of("task.name", cfg.task.name, ("arithmetic", "multihop", "chain_addition", "vlm_count"))
    chain = cfg.data.train_files is None and cfg.task.name == "chain_addition"
    if chain and cfg.task.warmup_steps < WARMUP_STEPS:
        fail(
            "task.warmup_steps",
            f"{cfg.task.warmup_steps} steps leave the chain_addition model unable to add (measured: 300 "
            "steps gave 0.03 greedy accuracy; 800 give 0.27)",
            f"Set task.warmup_steps={WARMUP_STEPS} or more.",
        )
    length = response_length(cfg)
    if chain and length < RESPONSE_TOKENS:
        fail(
            "data.max_response_length",
            f"{length} tokens cut off the chain_addition task's worked answers (up to {RESPONSE_TOKENS})",
            f"Set data.max_response_length={RESPONSE_TOKENS} or more.",
        )


def validate_forget_carry(cfg: Config) -> None:
    """Raise ``ConfigError`` unless ``task.forget_carry`` is a probability."""
    if not 0 <= cfg.task.forget_carry <= 1:
        fail(
            "task.forget_carry",
            f"must be a probability, got {cfg.task.forget_carry}",
            "Use a value in [0, 1].",
        )
