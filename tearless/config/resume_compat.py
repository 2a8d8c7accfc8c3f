"""Is a checkpoint's run the run being resumed? Compare the saved config with the new one.

Each checkpoint keeps its config (``trainer_state.pt``'s ``config``). On resume every key is compared
(paths as resolved absolute paths), and each difference falls in one of three kinds:

- **identity** (:data:`tearless.config.identity.IDENTITY_KEYS`: model, tokenizer, LoRA rank and
  targets, critic, distillation teacher, training data, advantage estimator; the embedded task's
  generator settings when no paths are given): a different run. Always refused, naming the keys and
  suggesting an experiment name for the new run.
- **bookkeeping** (:func:`is_bookkeeping`: how long to train, where and how often to log, save and
  validate, micro-batch sizes and token budgets, which leave the gradient unchanged, worker counts
  and timeouts, devices): may always change.
- **everything else changes the optimisation** (learning rate, batch sizes, clip ratios, KL, seeds,
  rewards, sampling, …): refused unless ``trainer.resume_allow_changes`` lists the key. An allowed
  optimizer setting (``optim.lr``, ``weight_decay``, ``betas``) is written into the restored
  optimizer and its schedule's base rate by :func:`apply_config` (on main the restored optimizer
  silently kept the old rate while ``config.json`` claimed the new one); a fixed KL coefficient
  replaces the restored one. An adaptive KL controller's starting coefficient cannot take effect
  mid-run, so a change to it is refused even when listed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tearless.config import Config, to_dict
from tearless.config.identity import (
    IDENTITY_KEYS,
    TASK_KEYS,
    default_experiment_name,
    flatten,
    normalise,
    uses_embedded_task,
)
from tearless.config.schema import KLCtrlConfig

_BOOKKEEPING_KEYS = {
    *(
        f"trainer.{k}"
        for k in (
            "total_epochs", "total_training_steps", "project_name", "experiment_name", "logger",
            "default_local_dir", "save_freq", "save_final_checkpoint", "test_freq", "val_before_train",
            "val_only", "resume_mode", "resume_from_path", "resume_allow_changes", "max_actor_ckpt_to_keep",
            "device", "num_threads", "keep_freed_memory", "log_freq", "num_rollout_samples",
            "rollout_log_max_mb", "max_bad_steps", "nnodes", "n_gpus_per_node", "placement",
            "colocate", "worker_timeout_s", "num_cpus_per_worker",
        )
    ),
    "actor_rollout_ref.rollout.nnodes", "actor_rollout_ref.rollout.n_gpus_per_node",
    "task.cache_dir", "task.fresh", "data.val_files", "data.val_batch_size", "data.val_max_samples",
    "reward_model.num_workers", "reward_model.timeout_s",
}  # fmt: skip
_BOOKKEEPING_SUFFIXES = (
    "micro_batch_size_per_gpu", "micro_batch_size", "max_token_len_per_gpu", "use_dynamic_bsz",
    "enable_gradient_checkpointing", "share_prompt_forward", "use_remove_padding", "use_fused_kernels",
    "lora_save_merged", "param_offload", "calculate_entropy", "entropy_from_logits_with_chunking",
    "entropy_checkpointing",
    "optimizer_offload", "reshard_after_forward", "param_dtype", "compute_copies", "use_torch_compile",
)  # fmt: skip
_BOOKKEEPING_PREFIXES = ("actor_rollout_ref.rollout.val_kwargs.", "ray_init.")
_OPTIMIZER_FIELDS = ("lr", "weight_decay", "betas")


class ResumeMismatch(ValueError):
    """The checkpoint belongs to another run, or the new config changes it without leave."""


def is_bookkeeping(key: str) -> bool:
    """Whether a change of ``key`` leaves the optimisation as it was (see the module docs)."""
    return (
        key in _BOOKKEEPING_KEYS
        or key.endswith(_BOOKKEEPING_SUFFIXES)
        or key.startswith(_BOOKKEEPING_PREFIXES)
    )


def config_differences(saved: dict[str, Any], cfg: Config) -> tuple[list[str], list[str]]:
    """``(identity keys, other non-bookkeeping keys)`` whose values differ between the saved config
    (a nested dict, as checkpoints keep it) and ``cfg``; keys only one of them has are skipped."""
    old, new = flatten(saved), flatten(json.loads(json.dumps(to_dict(cfg), default=str)))
    compared = IDENTITY_KEYS + (TASK_KEYS if uses_embedded_task(old) or uses_embedded_task(new) else ())
    identity = [k for k in compared if normalise(k, old.get(k)) != normalise(k, new.get(k))]
    # A key only one side has (added or removed by another tearless version) cannot be compared.
    others = [
        k
        for k in sorted(set(old) & set(new))
        if k not in IDENTITY_KEYS
        and k not in TASK_KEYS
        and not is_bookkeeping(k)
        and normalise(k, old.get(k)) != normalise(k, new.get(k))
    ]
    return identity, others


def check_resume(saved: dict[str, Any] | None, cfg: Config, checkpoint: Path, log=print) -> list[str]:
    """Refuse (:class:`ResumeMismatch`) a resume from ``checkpoint`` into a different run or with
    changes not listed in ``trainer.resume_allow_changes``; return the allowed keys that changed."""
    if saved is None:
        log(f"warning: {checkpoint} keeps no config (an older checkpoint); resuming without comparing it")
        return []
    identity, others = config_differences(saved, cfg)
    old, new = flatten(saved), flatten(json.loads(json.dumps(to_dict(cfg), default=str)))
    where = f"cannot resume from {checkpoint}"
    if identity:
        suggestion = default_experiment_name(to_dict(cfg))
        if suggestion == cfg.trainer.experiment_name:
            suggestion += "-2"
        raise ResumeMismatch(
            f"{where}: it belongs to another run (different model, data or estimator: "
            f"{_diff(identity, old, new)}). Start the new run in its own directory with "
            f"trainer.experiment_name={suggestion} (or delete {checkpoint.parent} to start over)"
        )
    allowed = set(cfg.trainer.resume_allow_changes)
    refused = [k for k in others if k not in allowed]
    if refused:
        listed = ",".join(sorted(allowed | set(refused)))
        raise ResumeMismatch(
            f"{where}: the new config changes the optimisation ({_diff(refused, old, new)}). To resume "
            f"with these changes, list them: trainer.resume_allow_changes=[{listed}]; to keep the run as "
            "it was, drop the overrides; or start another run with a new trainer.experiment_name"
        )
    cannot = [
        k
        for k in others
        if k == "algorithm.kl_ctrl.kl_coef" and new.get("algorithm.kl_ctrl.type") == "adaptive"
    ]
    cannot += [k for k in others if k == "algorithm.kl_ctrl.type"]
    if cannot:
        raise ResumeMismatch(
            f"{where}: {_diff(cannot, old, new)} cannot take effect in a resumed run (the restored "
            "state carries the old value); start another run with a new trainer.experiment_name"
        )
    if others:
        log(
            f"resuming from {checkpoint} with changes allowed by trainer.resume_allow_changes: "
            f"{_diff(others, old, new)}"
        )
    return others


def apply_config(
    optimizers: dict[str, tuple[Any, Any, Any]], kl_ctrl: Any = None, kl: KLCtrlConfig | None = None
) -> None:
    """Make the restored state what the config says: for each ``name -> (optimizer, scheduler,
    optim_cfg)`` the learning rate (initial rate, the schedule's base rate and the current rate
    base × schedule(step)), weight decay and betas; a fixed KL controller's coefficient (``kl_ctrl``,
    set from ``algorithm.kl_ctrl``, ``kl``).

    A no-op where nothing changed (the restored values equal the config's)."""
    for optimizer, scheduler, optim in optimizers.values():
        for i, group in enumerate(optimizer.param_groups):
            group["initial_lr"] = optim.lr
            group["weight_decay"] = optim.weight_decay
            group["betas"] = tuple(optim.betas)
            scheduler.base_lrs[i] = optim.lr
            group["lr"] = optim.lr * scheduler.lr_lambdas[i](scheduler.last_epoch)
        scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
    if kl_ctrl is not None and kl.type == "fixed":
        kl_ctrl.value = float(kl.kl_coef)


def _diff(keys: list[str], old: dict[str, Any], new: dict[str, Any]) -> str:
    return "; ".join(f"{k}: {_short(old.get(k))} in the checkpoint, {_short(new.get(k))} now" for k in keys)


def _short(value: Any) -> str:
    """A value for a message: whole up to 240 characters (a file path fits), else its two ends."""
    text = json.dumps(value, default=str)
    return text if len(text) <= 240 else f"{text[:118]}…{text[-118:]}"
