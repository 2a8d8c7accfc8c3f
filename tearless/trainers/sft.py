r"""Supervised fine-tuning: the token-mean negative log-likelihood of assistant tokens.

One step (:func:`sft_step`, which the embedded task's warm-up runs too):
  1. split the step's sequences into micro-batches and pad or pack each;
  2. forward each micro-batch: :math:`\log\pi(x_t \mid x_{<t})` of every next token;
  3. backward :math:`-\frac{1}{N}\sum_t m_t \log\pi(x_t \mid x_{<t})`, with :math:`m_t` the
     assistant-token mask and N the number of trained tokens in the *whole step*, so the summed
     micro-batch gradients are exactly the gradient of the step's token mean;
  4. clip, AdamW step, advance the lr schedule.
:class:`SFTTrainer` adds data, validation (held-out loss and greedy task accuracy), metrics,
checkpoints and resume around it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tearless.algos import logprobs_from_logits
from tearless.config.sft import SFTConfig
from tearless.data import load_many
from tearless.data.pairs import collate_pairs
from tearless.data.sft import SFTDataset, pack_batch, pad_batch, read_many
from tearless.models.loading import (
    enable_activation_checkpointing,
    load_causal_lm,
    load_tokenizer,
    resolve_dtype,
)
from tearless.tasks.bootstrap import TaskSpec, task_model, task_rows, warmup_demos
from tearless.tasks.tokenizer import build_char_tokenizer
from tearless.trainers import offline


def block_causal_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive (R, 1, L, L) mask: query q sees key k iff k ≤ q and both are in the same segment.

    Padding (segment 0) sees earlier padding only, so no query row is fully masked.
    """
    width = segment_ids.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=segment_ids.device).tril()
    allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=segment_ids.device)
    return mask.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


def token_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    r""":math:`\log\pi(x_t \mid x_{<t})` for t = 1 … L−1, shape (B, L−1), of a padded or packed batch.

    Position t of the result scores token ``input_ids[:, t + 1]``; pair it with ``loss_mask[:, 1:]``.
    """
    device = next(model.parameters()).device
    ids = batch["input_ids"].to(device)
    if "segment_ids" in batch:
        dtype = next(model.parameters()).dtype
        attention = block_causal_mask(batch["segment_ids"].to(device), dtype)
    else:
        attention = batch["attention_mask"].to(device)
    logits = model(
        input_ids=ids,
        attention_mask=attention,
        position_ids=batch["position_ids"].to(device),
        use_cache=False,
    ).logits[:, :-1]
    return logprobs_from_logits(logits, ids[:, 1:])


def side_logps(
    model: torch.nn.Module,
    items: Sequence[dict],
    *,
    pad_token_id: int,
    sides: Sequence[str] = ("chosen", "rejected"),
) -> torch.Tensor:
    """Summed response log-probs, shape (P, len(sides)): column k is side ``sides[k]`` of each item
    (by default 0 the chosen response, 1 the rejected one), all sides forwarded in one batch."""
    batch = collate_pairs(items, pad_token_id=pad_token_id, sides=sides)
    logps = token_logps(model, batch)
    mask = batch["loss_mask"][:, 1:].to(logps.device).bool()
    sums = torch.where(mask, logps, 0.0).sum(-1)
    return torch.stack(sums.chunk(len(sides)), dim=1)


def sft_loss(logps: torch.Tensor, loss_mask: torch.Tensor, num_tokens: int) -> torch.Tensor:
    r""":math:`-\frac{1}{N}\sum_{b,t} m_{b,t}\,\log p_{b,t}` for (B, T) log-probs and 0/1 mask, N given.

    N is the trained-token count of the whole optimizer step (not of this micro-batch). Masked
    positions contribute exactly 0, even where their log-prob is not finite.
    """
    mask = loss_mask.to(logps.device).bool()
    return -torch.where(mask, logps, 0.0).sum() / num_tokens


def collate_fn(
    *, pad_token_id: int, packing: bool = False, max_length: int | None = None
) -> Callable[[Sequence[dict]], dict]:
    """The batch maker of ``data.packing``: :func:`pack_batch` into rows of ``max_length`` tokens, or
    :func:`pad_batch`."""
    if packing:
        if max_length is None:
            raise ValueError("packing needs max_length, the longest packed row")
        return functools.partial(pack_batch, pad_token_id=pad_token_id, max_length=max_length)
    return functools.partial(pad_batch, pad_token_id=pad_token_id)


def sft_backward(
    model: torch.nn.Module,
    items: Sequence[dict],
    *,
    collate: Callable[[Sequence[dict]], dict],
    micro_batch_size: int | None = None,
) -> tuple[float, int]:
    """Accumulate the gradient of the step's token-mean loss over micro-batches of ``items`` (dicts
    with ``input_ids`` and ``loss_mask``); return (loss, trained tokens N)."""
    model.train()
    num_tokens = sum(sum(it["loss_mask"]) for it in items)
    size = micro_batch_size or len(items)
    total = 0.0
    for start in range(0, len(items), size):
        batch = collate(items[start : start + size])
        loss = sft_loss(token_logps(model, batch), batch["loss_mask"][:, 1:], num_tokens)
        loss.backward()
        total += loss.item()
    return total, num_tokens


def sft_step(
    model: torch.nn.Module,
    items: Sequence[dict],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    *,
    collate: Callable[[Sequence[dict]], dict],
    micro_batch_size: int | None = None,
    clip_grad: float = 1.0,
) -> dict[str, float]:
    """One optimizer step on ``items``: :func:`sft_backward`, then clip and step. Returns
    ``train/loss`` (the step's token mean), ``train/grad_norm``, ``train/lr``, ``train/skipped``,
    ``train/num_tokens``."""
    loss, num_tokens = sft_backward(model, items, collate=collate, micro_batch_size=micro_batch_size)
    metrics = offline.optimizer_step(model, optimizer, scheduler, clip_grad)
    return {"train/loss": loss, **metrics, "train/num_tokens": float(num_tokens)}


@torch.no_grad()
def eval_loss(
    model: torch.nn.Module, items: Sequence[dict], *, collate: Callable, micro_batch_size: int = 256
) -> float:
    """Token-mean NLL of the trained tokens of ``items`` (no gradient)."""
    model.eval()
    num_tokens = sum(sum(it["loss_mask"]) for it in items)
    total = 0.0
    for start in range(0, len(items), micro_batch_size):
        batch = collate(items[start : start + micro_batch_size])
        total += sft_loss(token_logps(model, batch), batch["loss_mask"][:, 1:], num_tokens).item()
    return total


# The data section's keys an SFTDataset takes, by the same names.
SFT_DATA_KEYS = ("max_length", "truncation", "messages_key", "prompt_key", "response_key")


class SFTTrainer:
    """Single-process SFT trainer. ``SFTTrainer(cfg).fit()`` trains and returns a summary."""

    def __init__(self, cfg: SFTConfig, *, log: Callable[[str], None] = print) -> None:
        state, resume_dir = offline.begin(self, cfg, log)
        data, t = cfg.data, cfg.trainer
        if data.train_files is None:
            train_records, val_records, self.prompt_rows = self._embedded()
        else:
            train_records = read_many(data.train_files)
            val_records = read_many(data.val_files) if data.val_files else []
            self.prompt_rows = load_many(data.val_prompt_files) if data.val_prompt_files else []
        if data.val_max_samples > 0:
            val_records = val_records[: data.val_max_samples]
            self.prompt_rows = self.prompt_rows[: data.val_max_samples]
        self.score_fn = offline.held_out_scorer(cfg.custom_reward_function, self.prompt_rows)
        if cfg.model.path is None and cfg.model.tokenizer_path is None:
            tokenizer = build_char_tokenizer()
        else:
            tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, "model.path")
        self.tokenizer = tokenizer
        keys = {k: getattr(data, k) for k in SFT_DATA_KEYS}
        self.train_set = SFTDataset(train_records, tokenizer, source=str(data.train_files), **keys)
        self.val_set = SFTDataset(val_records, tokenizer, **keys) if val_records else None
        self.loader, self.total_steps = offline.make_loader(self.train_set, data, t)
        if resume_dir is None and cfg.model.path is None:
            self.model = self._fresh_model().to(resolve_dtype(cfg.model.dtype))
            if cfg.model.enable_gradient_checkpointing:
                enable_activation_checkpointing(self.model)
        else:
            self.model = load_causal_lm(
                resume_dir / "actor" if resume_dir else cfg.model.path,
                dtype=cfg.model.dtype,
                gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
                key="model.path",
            )
        offline.start_optimizer(self, state, resume_dir)
        self.collate = collate_fn(
            pad_token_id=tokenizer.pad_token_id, packing=data.packing, max_length=data.max_length
        )

    def _spec(self) -> TaskSpec:

        task = self.cfg.task
        return TaskSpec.from_config(
            task, seed=self.cfg.trainer.seed, hidden_size=task.hidden_size, num_layers=task.num_layers
        )

    def _embedded(self) -> tuple[list[dict], list[dict], list[dict]]:
        """The embedded task's warm-up data: ``warmup_steps × train_batch_size`` flawed-teacher
        demonstrations, one per held-out prompt for ``val/loss``, and the held-out prompts."""
        spec = self._spec()
        train_rows, val_rows = task_rows(spec)
        num = spec.warmup_steps * self.cfg.data.train_batch_size
        demos = warmup_demos(train_rows, num=num, seed=spec.seed, forget_carry=spec.forget_carry)
        val_demos = warmup_demos(
            val_rows, num=len(val_rows), seed=spec.seed + 1, forget_carry=spec.forget_carry
        )
        return demos, val_demos, val_rows

    def _fresh_model(self) -> torch.nn.Module:
        """The embedded task's tiny Llama, freshly initialised (the warm-up's starting point)."""
        return task_model(self._spec(), self.tokenizer)

    def train_step(self, items: list[dict]) -> dict[str, float]:
        started = time.perf_counter()
        metrics = sft_step(
            self.model,
            items,
            self.optimizer,
            self.scheduler,
            collate=self.collate,
            micro_batch_size=self.cfg.data.micro_batch_size_per_gpu,
            clip_grad=self.cfg.optim.clip_grad,
        )
        seconds = time.perf_counter() - started
        tokens = sum(len(it["input_ids"]) for it in items)
        metrics.update({"timing_s/step": seconds, "perf/throughput": tokens / max(seconds, 1e-9)})
        return metrics

    def validate(self) -> dict[str, float]:
        """``val/loss`` on the held-out rows and greedy accuracy on the held-out prompts (if any)."""
        metrics = {}
        if self.val_set is not None:
            items = [self.val_set[i] for i in range(len(self.val_set))]
            size = self.cfg.data.micro_batch_size_per_gpu or 256
            metrics["val/loss"] = eval_loss(self.model, items, collate=self.collate, micro_batch_size=size)
        metrics.update(offline.prompt_accuracy(self))
        return metrics

    def save(self, step: int) -> Path:
        return offline.save(self, step)

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``; return the run directory, validation before/after, checkpoint."""
        return offline.fit(self)
