"""What the offline trainers (SFT, DPO and the reward model's) share around their losses.

Device and threads, AdamW with the warm-up + constant/cosine schedule of the RL actor, the
optimizer step (clip, skip a non-finite gradient norm), resume and checkpoints in the RL trainer's
format (``global_step_N/actor`` is a ``save_pretrained`` directory), the metrics tracker, and the
greedy task accuracy on veRL-schema prompt rows (``val-core/<data_source>/acc/greedy``, the RL
trainer's metric name, so runs of every trainer compare directly).
"""

from __future__ import annotations

import functools
import json
import random
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from tearless import faults
from tearless.config import to_dict
from tearless.config.sft import OfflineOptimConfig, OfflineTrainerConfig
from tearless.cpu import configure_cpu
from tearless.data import PromptLoader
from tearless.data.rows import DataError
from tearless.data.sft import sft_prompt
from tearless.rewards import UnknownDataSource, compute_score, get_scorer
from tearless.rewards.manager import load_reward_function
from tearless.rollout.hf import HFRollout
from tearless.run import checkpoint as ckpt
from tearless.run.tracking import Tracker, truncate_jsonl
from tearless.trainers.progress import Progress, run_tracker, say_if_complete
from tearless.workers.optim import adamw, lr_schedule

KEY_METRICS = {"train/loss": "loss", "rewards/accuracies": "acc", "train/grad_norm": "grad", "train/lr": "lr"}


def setup_torch(t: OfflineTrainerConfig) -> torch.device:
    """Seed torch and Python, apply the CPU settings (threads, malloc), and pick the device."""
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    configure_cpu(t.num_threads, t.keep_freed_memory)
    use_cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if use_cuda else "cpu")


def make_optimizer(
    model: torch.nn.Module, optim: OfflineOptimConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters and its schedule (:mod:`tearless.workers.optim`): linear
    warm-up over ``warmup_steps_ratio × total_steps`` steps, then constant or a half-cosine from ``lr``
    down to ``min_lr_ratio × lr`` at the last step."""
    # A LoRA model's frozen base takes no optimizer slot: its checkpoints hold the adapters' moments only.
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(trainable, optim.lr, optim.betas, optim.weight_decay)
    warmup = int(optim.warmup_steps_ratio * total_steps)
    return optimizer, lr_schedule(optimizer, total_steps, warmup, optim.lr_scheduler, optim.min_lr_ratio, 0.5)


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    clip_grad: float,
) -> dict[str, float]:
    """Clip the accumulated gradients to ``clip_grad``, step (unless the norm is not finite), advance
    the schedule; return ``train/grad_norm``, ``train/lr`` (the lr used) and ``train/skipped``."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    lr = scheduler.get_last_lr()[0]
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return {"train/grad_norm": float(grad_norm), "train/lr": lr, "train/skipped": float(not finite)}


def make_loader(dataset: Any, data: Any, t: OfflineTrainerConfig) -> tuple[PromptLoader, int]:
    """The seeded loader of ``data.train_batch_size`` items (shuffled each epoch by ``data.seed``, else
    ``trainer.seed``) and the run's step count: ``trainer.total_training_steps``, else epochs × batches."""
    loader = PromptLoader(
        dataset, data.train_batch_size, shuffle=data.shuffle, seed=t.seed if data.seed is None else data.seed
    )
    return loader, t.total_training_steps or t.total_epochs * loader.num_batches


def finish_step(trainer: Any, metrics: dict[str, float], started: float) -> dict[str, float]:
    """After a step's backward: its ``loss`` renamed ``train/loss``, the optimizer step's metrics
    (:func:`optimizer_step`) and ``timing_s/step`` since ``started`` (a ``time.perf_counter()``)."""
    metrics["train/loss"] = metrics.pop("loss")
    metrics.update(
        optimizer_step(trainer.model, trainer.optimizer, trainer.scheduler, trainer.cfg.optim.clip_grad)
    )
    metrics["timing_s/step"] = time.perf_counter() - started
    return metrics


def find_resume(t: OfflineTrainerConfig, run_dir: Path) -> tuple[int, dict | None, Path | None]:
    """``(start step, trainer state, checkpoint dir)`` per ``trainer.resume_mode``; ``(0, None, None)``
    when starting fresh."""
    if t.resume_mode == "disable":
        return 0, None, None
    # The newest checkpoint whose files match its checksum manifest (a damaged one is reported).
    path = ckpt.checkpoint_to_resume(run_dir, t.resume_from_path if t.resume_mode == "resume_path" else None)
    if path is None:
        return 0, None, None
    state = ckpt.load_state(path)
    return int(state["global_step"]), state, path


def begin(trainer: Any, cfg: Any, log: Callable[[str], None]) -> tuple[dict | None, Path | None]:
    """The start of every offline trainer: ``trainer.cfg``, ``log``, ``device`` (:func:`setup_torch`),
    ``run_dir`` and ``start_step`` set; returns the state and directory of the checkpoint to resume
    (:func:`find_resume`; None, None when starting fresh)."""
    trainer.cfg, trainer.log = cfg, log
    trainer.device = setup_torch(cfg.trainer)
    trainer.run_dir = Path(cfg.trainer.default_local_dir)
    trainer.start_step, state, resume_dir = find_resume(cfg.trainer, trainer.run_dir)
    return state, resume_dir


def start_optimizer(trainer: Any, state: dict | None, resume_dir: Path | None) -> None:
    """``trainer.model`` moved to ``trainer.device`` and given its optimizer and schedule
    (:func:`make_optimizer` over ``trainer.total_steps``), both restored from ``state`` when resuming."""
    trainer.model.to(trainer.device)
    optim = trainer.cfg.optim
    trainer.optimizer, trainer.scheduler = make_optimizer(trainer.model, optim, trainer.total_steps)
    if state is not None:
        restore(state, trainer.optimizer, trainer.scheduler)
        trainer.log(f"resumed from {resume_dir} at step {trainer.start_step}")


def trainer_state(step: int, optimizer, scheduler, cfg: Any, **extra: Any) -> dict[str, Any]:
    """What a checkpoint holds besides the weights: step, optimizer, schedule, RNGs, config."""
    return {
        "global_step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "config": to_dict(cfg),
        **extra,
    }


def restore(state: dict[str, Any], optimizer, scheduler) -> None:
    """Load what :func:`trainer_state` saved back into a fresh optimizer and schedule."""
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])


def open_run(
    run_dir: Path, cfg: Any, t: OfflineTrainerConfig, *, total_steps: int, start_step: int
) -> Tracker:
    """Create the run directory, drop metric records past the resumed step, write config.json and
    return a started :class:`Tracker`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    truncate_jsonl(run_dir / "metrics.jsonl", start_step if start_step > 0 else -1)
    (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1, default=str))
    tracker = run_tracker(run_dir, cfg, total_steps=total_steps, key_metrics=KEY_METRICS)
    tracker.start_at(start_step)
    return tracker


def should(freq: int, step: int, last: bool) -> bool:
    """Validate/save at this step: every ``freq`` steps (``freq > 0``) and always at the last."""
    return last or (freq > 0 and step % freq == 0)


class OfflineTrainer(Protocol):
    """What :func:`fit` needs from a trainer (the SFT and DPO trainers)."""

    cfg: Any
    run_dir: Path
    start_step: int
    total_steps: int
    loader: Any

    def train_step(self, items: list[dict]) -> dict[str, float]: ...
    def validate(self) -> dict[str, float]: ...
    def save(self, step: int) -> Path: ...


def fit(trainer: OfflineTrainer) -> dict[str, Any]:
    """The offline loop: validate, then for each step take the loader's batch of (epoch, i), train,
    validate and checkpoint on their frequencies (and at the end), log. Returns the run directory,
    validation ``before``/``after``, the last checkpoint, steps and seconds."""
    t = trainer.cfg.trainer
    tracker = open_run(
        trainer.run_dir, trainer.cfg, t, total_steps=trainer.total_steps, start_step=trainer.start_step
    )
    summary: dict[str, Any] = {"run_dir": str(trainer.run_dir), "start_step": trainer.start_step}
    started = time.perf_counter()
    try:
        if trainer.start_step == 0 and t.val_before_train:
            summary["before"] = trainer.validate()
            tracker.log(summary["before"], 0)
            tracker.write(format_val("before training", summary["before"]))
        again = "set trainer.resume_mode=disable or another trainer.experiment_name"
        say_if_complete(tracker, trainer.run_dir, trainer.start_step, trainer.total_steps, again)
        step = trainer.start_step
        while step < trainer.total_steps:
            epoch, i = divmod(step, trainer.loader.num_batches)
            items = trainer.loader.batch(epoch, i)
            step += 1
            faults.point("update", step)
            metrics = trainer.train_step(items)
            metrics.update({"training/global_step": float(step), "training/epoch": float(epoch)})
            last = step == trainer.total_steps
            if should(t.test_freq, step, last):
                summary["after"] = trainer.validate()
                metrics.update(summary["after"])
            if (last and t.save_final_checkpoint) or (t.save_freq > 0 and step % t.save_freq == 0):
                summary["checkpoint"] = str(trainer.save(step))
            tracker.log(metrics, step)
        if "after" in summary:
            tracker.write(format_val("after training", summary["after"]))
    finally:
        tracker.close()
    summary["seconds"] = time.perf_counter() - started
    summary["steps"] = trainer.total_steps
    return summary


def save(trainer: Any, step: int, *, write: Callable[[Path], None] | None = None, **extra: Any) -> Path:
    """Checkpoint ``trainer`` (its model and tokenizer as ``actor/``, optimizer, scheduler) at ``step``;
    ``extra`` goes into the trainer state. ``write(directory)``, when given, writes the model itself
    (in its own layout) into the checkpoint's directory instead of ``actor/``."""
    state = trainer_state(step, trainer.optimizer, trainer.scheduler, trainer.cfg, **extra)
    return ckpt.save_checkpoint(
        trainer.run_dir,
        step,
        model=None if write else trainer.model,
        tokenizer=None if write else trainer.tokenizer,
        state=state,
        keep=trainer.cfg.trainer.max_ckpt_to_keep,
        write=write,
    )


def held_out_scorer(crf: Any, rows: list[dict]) -> Callable[..., Any]:
    """The reward function of the held-out greedy accuracy, checked before any model loads:
    ``custom_reward_function.path``'s function (with its ``reward_kwargs``), or the built-in scorers,
    which must know every ``data_source`` of ``rows`` (else one :class:`DataError` naming the fix)."""
    if crf.path:
        fn = load_reward_function(crf.path, crf.name)
        return functools.partial(fn, **crf.reward_kwargs) if crf.reward_kwargs else fn
    for source in sorted({str(r["data_source"]) for r in rows}):
        try:
            get_scorer(source)
        except UnknownDataSource as err:
            raise DataError(f"data.val_prompt_files: {err}") from None
    return compute_score


@torch.no_grad()
def greedy_accuracy(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict],
    *,
    max_new_tokens: int,
    batch_size: int = 32,
    score_fn: Callable[..., Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Greedy held-out accuracy and mean score per ``data_source`` with ``score_fn`` (veRL's
    ``compute_score(data_source, solution_str, ground_truth, extra_info)``; default: the built-in
    scorers), generated ``batch_size`` prompts at a time with a progress line when it is slow.

    ``rows`` are veRL-schema prompt rows. A response is correct when its scorer's ``acc`` is true
    or, without one, its score is ≥ 1 (as in the RL trainer's validation).
    """
    score_fn = score_fn or compute_score
    progress = Progress(log, "held-out greedy accuracy", len(rows), "prompts")

    eos = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    rollout = HFRollout(model, eos_token_ids=sorted(eos), pad_token_id=tokenizer.pad_token_id)
    per_source: dict[str, list[tuple[float, bool]]] = defaultdict(list)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        out = rollout.generate(
            [sft_prompt(tokenizer, r["prompt"]) for r in chunk],
            max_new_tokens=max_new_tokens,
            do_sample=False,
        )
        for row, ids, mask in zip(chunk, out.response_ids, out.response_mask, strict=True):
            text = tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            result = score_fn(
                row["data_source"], text, row["reward_model"]["ground_truth"], row.get("extra_info")
            )
            score = float(result["score"]) if isinstance(result, dict) else float(result)
            acc = bool(result["acc"]) if isinstance(result, dict) and "acc" in result else score >= 1.0
            per_source[row["data_source"]].append((score, acc))
        progress.update(start + len(chunk))
    metrics = {}
    for src, vals in per_source.items():
        metrics[f"val-core/{src}/acc/greedy"] = sum(a for _, a in vals) / len(vals)
        metrics[f"val-core/{src}/reward/greedy"] = sum(s for s, _ in vals) / len(vals)
    return metrics


def prompt_accuracy(trainer: Any) -> dict[str, float]:
    """:func:`greedy_accuracy` on ``trainer``'s held-out prompts (its ``prompt_rows``, scored by its
    ``score_fn``, answers of up to ``data.max_response_length`` tokens); ``{}`` when it has none."""
    if not trainer.prompt_rows:
        return {}
    return greedy_accuracy(
        trainer.model,
        trainer.tokenizer,
        trainer.prompt_rows,
        max_new_tokens=trainer.cfg.data.max_response_length,
        score_fn=trainer.score_fn,
        log=trainer.log,
    )


def format_val(title: str, metrics: dict[str, float]) -> str:
    lines = [f"held-out {title}:"] + [f"  {k:<40} {v:.4f}" for k, v in sorted(metrics.items())]
    return "\n".join(lines)
