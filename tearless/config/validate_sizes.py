"""Checks of the run's sizes and counts (each positive, seeds in range, lengths within the sanity
bounds) and of the batch arithmetic of one actor update: mini-batches of prompts, micro-batches of
responses, the token budget of dynamic batching."""

from __future__ import annotations

from tearless.config.errors import fail, positive
from tearless.config.schema import Config

MAX_ROLLOUT_N = 1024
MAX_SEQUENCE_TOKENS = 1 << 20


def validate_sizes(cfg: Config) -> None:
    """Raise ``ConfigError`` for a size or count that is not positive, a seed out of range, or a length
    past its sanity bound."""
    _required(cfg)
    _seeds(cfg)
    _sanity_bounds(cfg)
    _optional(cfg)


def _required(cfg: Config) -> None:
    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    for key, value in [
        ("data.train_batch_size", data.train_batch_size),
        ("actor_rollout_ref.rollout.n", cfg.actor_rollout_ref.rollout.n),
        ("actor_rollout_ref.actor.ppo_mini_batch_size", actor.ppo_mini_batch_size),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs),
        ("data.max_prompt_length", data.max_prompt_length),
        ("data.max_response_length", data.max_response_length),
        ("trainer.total_epochs", cfg.trainer.total_epochs),
        ("actor_rollout_ref.actor.optim.lr", actor.optim.lr),
        ("actor_rollout_ref.actor.grad_clip", actor.grad_clip),
        ("reward_model.timeout_s", cfg.reward_model.timeout_s),
    ]:
        positive(key, value)
    positive("reward_model.num_workers", cfg.reward_model.num_workers, allow_zero=True)
    positive("trainer.max_bad_steps", cfg.trainer.max_bad_steps, allow_zero=True)
    positive("trainer.num_threads", cfg.trainer.num_threads, allow_zero=True)


def _seeds(cfg: Config) -> None:
    # torch.manual_seed takes at most 2**64 - 1 and a seed past 2**63 - 1 overflows the samplers' keys.
    for key, seed in (("trainer.seed", cfg.trainer.seed), ("data.seed", cfg.data.seed)):
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**63):
            fail(key, f"must be an integer in [0, 2**63 - 1], got {seed!r}", "Use a seed in that range.")


def _sanity_bounds(cfg: Config) -> None:
    """Past these bounds a typo (an extra zero or three) would allocate for minutes, then fail."""
    data, rollout = cfg.data, cfg.actor_rollout_ref.rollout
    if rollout.n > MAX_ROLLOUT_N:
        fail("actor_rollout_ref.rollout.n", f"{rollout.n} responses per prompt is past the sanity bound "
              f"{MAX_ROLLOUT_N}", "GRPO runs use 4 to 64; check for a typo.")  # fmt: skip
    for key, value in [
        ("data.max_prompt_length", data.max_prompt_length),
        ("data.max_response_length", data.max_response_length),
        ("actor_rollout_ref.rollout.response_length", rollout.response_length or 0),
    ]:
        if value > MAX_SEQUENCE_TOKENS:
            fail(key, f"{value} tokens is past the sanity bound {MAX_SEQUENCE_TOKENS} (2^20)",
                  "Check for a typo; no model here attends over more.")  # fmt: skip


def _optional(cfg: Config) -> None:
    """The sizes whose null means "derived" or "all"; a given one must be positive."""
    rollout = cfg.actor_rollout_ref.rollout
    for key, value in [
        ("trainer.total_training_steps", cfg.trainer.total_training_steps),
        ("data.val_batch_size", cfg.data.val_batch_size),
        ("actor_rollout_ref.rollout.response_length", rollout.response_length),
        (
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
            rollout.log_prob_micro_batch_size_per_gpu,
        ),
        (
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
            cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu,
        ),
        ("trainer.max_actor_ckpt_to_keep", cfg.trainer.max_actor_ckpt_to_keep),
    ]:
        if value is not None:
            positive(key, value)


def validate_update_batches(cfg: Config) -> None:
    """Raise ``ConfigError`` unless the step's prompts split into whole mini-batches, each mini-batch's
    responses into whole micro-batches, and dynamic batching's token budget holds one sequence."""
    data, actor = cfg.data, cfg.actor_rollout_ref.actor
    n = cfg.actor_rollout_ref.rollout.n
    if data.train_batch_size < actor.ppo_mini_batch_size or data.train_batch_size % actor.ppo_mini_batch_size:
        fail(
            "actor_rollout_ref.actor.ppo_mini_batch_size",
            f"data.train_batch_size × rollout.n = {data.train_batch_size * n} is not divisible by "
            f"ppo_mini_batch_size × n = {actor.ppo_mini_batch_size * n}",
            "Make data.train_batch_size a multiple of ppo_mini_batch_size (both count prompts).",
        )
    micro = actor.ppo_micro_batch_size_per_gpu
    if micro is not None and not actor.use_dynamic_bsz:
        positive("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", micro)
        if (actor.ppo_mini_batch_size * n) % micro:
            fail(
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                f"ppo_mini_batch_size × n = {actor.ppo_mini_batch_size * n} responses is not divisible by "
                f"the micro-batch size {micro}",
                "Pick a divisor of the mini-batch's response count.",
            )
    if actor.use_dynamic_bsz:
        positive("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu)
        needed = data.max_prompt_length + data.max_response_length
        if actor.ppo_max_token_len_per_gpu < needed:
            fail(
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                f"{actor.ppo_max_token_len_per_gpu} tokens cannot hold one sequence of up to "
                f"max_prompt_length + max_response_length = {needed}",
                f"Set it to at least {needed}.",
            )
