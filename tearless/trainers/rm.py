r"""Reward-model training: a scalar head on a language model, fitted to preference pairs (Bradley–Terry).

The reward of a response is the one-label sequence-classification model's output at the last token of
prompt + response, rendered as the ``reward_model`` role renders what it scores
(:class:`~tearless.data.pairs.RewardPairDataset`). One step on P pairs:
  1. forward the chosen and the rejected sides of each micro-batch in one batch: :math:`r_c, r_r`;
  2. :func:`~tearless.algos.bradley_terry_loss`, :math:`-\frac{1}{P}\sum_i \log\sigma(r_{c,i} - r_{r,i}
     - m_i) + c\,\frac{1}{P}\sum_i (r_{c,i}+r_{r,i})^2`,
     weighted by the micro-batch's share of the step's pairs, so the gradient is that of the step's mean;
  3. clip, AdamW step, lr schedule (:mod:`tearless.trainers.offline`, the loop of ``sft`` and ``dpo``).
Metrics: ``rewards/chosen`` and ``rewards/rejected`` (mean rewards), ``rewards/accuracies`` (share of
pairs with :math:`r_c > r_r`), ``rewards/margins`` (mean gap :math:`r_c - r_r`); the held-out pairs
give the same under ``val/`` with ``val/loss``.

Each checkpoint's ``reward_model/`` is a plain ``AutoModelForSequenceClassification`` directory (one
label, ``pad_token_id`` set, its tokenizer beside it), LoRA merged: ``reward_model.model.path`` loads
it as it is, and so does ``AutoModelForSequenceClassification.from_pretrained`` (the tests check
both); no other trainer's loader was tried. A LoRA run also writes ``lora_adapter/`` (adapters and
head), which resume loads onto ``model.path``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tearless.algos import bradley_terry_loss
from tearless.config.rm import RMConfig
from tearless.data.pairs import RewardPairDataset, collate_pairs
from tearless.models.loading import load_tokenizer, quiet_transformers
from tearless.models.lora import add_lora, load_lora
from tearless.models.value import load_reward_model
from tearless.models.weights import save_model
from tearless.trainers import offline
from tearless.trainers.dpo import pair_datasets, pair_paths, pair_reward_metrics

RM_DIR = "reward_model"
ADAPTER_DIR = "lora_adapter"


def pair_rewards(model: torch.nn.Module, items: Sequence[dict], *, pad_token_id: int) -> torch.Tensor:
    """Rewards, shape (P, 2): column 0 the chosen side of each pair, 1 the rejected, both sides in one
    right-padded forward; the model reads each row at its last token that is not padding."""
    batch = collate_pairs(items, pad_token_id=pad_token_id)
    device = next(model.parameters()).device
    logits = model(
        input_ids=batch["input_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device),
        use_cache=False,
    ).logits
    return torch.stack(logits[:, 0].chunk(2), dim=1)


def reward_step(
    model: torch.nn.Module,
    items: Sequence[dict],
    *,
    pad_token_id: int,
    micro_batch_size: int | None = None,
    center_rewards_coefficient: float | None = None,
    train: bool = True,
) -> dict[str, float]:
    """Loss (backward when ``train``) and the reward metrics over the pairs ``items``, micro-batched."""
    size = micro_batch_size or len(items)
    sums = dict.fromkeys(("loss", "chosen", "rejected", "accuracies", "margins"), 0.0)
    for start in range(0, len(items), size):
        chunk = items[start : start + size]
        with torch.set_grad_enabled(train):
            rewards = pair_rewards(model, chunk, pad_token_id=pad_token_id)
            margin = torch.tensor([it["margin"] for it in chunk], dtype=rewards.dtype, device=rewards.device)
            loss, stats = bradley_terry_loss(
                rewards[:, 0],
                rewards[:, 1],
                margin=margin,
                center_rewards_coefficient=center_rewards_coefficient,
            )
            weighted = loss * len(chunk) / len(items)
        if train:
            weighted.backward()
        sums["loss"] += weighted.item()
        sums["chosen"] += rewards[:, 0].detach().sum().item()
        sums["rejected"] += rewards[:, 1].detach().sum().item()
        sums["accuracies"] += stats["correct"].sum().item()
        sums["margins"] += stats["gap"].sum().item()
    return pair_reward_metrics(sums, len(items))


class RewardModelTrainer:
    """Single-process Bradley–Terry reward-model trainer. ``RewardModelTrainer(cfg).fit()`` trains and
    returns a summary whose ``reward_model`` is the last checkpoint's model directory."""

    def __init__(self, cfg: RMConfig, *, log: Callable[[str], None] = print) -> None:
        state, resume_dir = offline.begin(self, cfg, log)
        data, t, m = cfg.data, cfg.trainer, cfg.model
        model_path, train_files, val_files, _ = pair_paths(m.path, data, cfg.task, log=log)
        self.tokenizer = load_tokenizer(m.tokenizer_path or model_path, "model.path")
        self.train_set, self.val_set = pair_datasets(
            RewardPairDataset, data, train_files, val_files, self.tokenizer, margin_key=data.margin_key
        )
        self.loader, self.total_steps = offline.make_loader(self.train_set, data, t)
        lora = m.lora_rank > 0
        self.model = load_reward_model(
            resume_dir / RM_DIR if resume_dir and not lora else model_path,
            pad_token_id=self.tokenizer.pad_token_id,
            dtype=m.dtype,
            gradient_checkpointing=m.enable_gradient_checkpointing,
        )
        if lora and resume_dir:
            self.model = load_lora(
                self.model,
                resume_dir / ADAPTER_DIR,
                gradient_checkpointing=m.enable_gradient_checkpointing,
                key="model",
            )
        elif lora:
            self.model = add_lora(
                self.model,
                rank=m.lora_rank,
                alpha=m.lora_alpha,
                target_modules=m.target_modules,
                gradient_checkpointing=m.enable_gradient_checkpointing,
                task_type="SEQ_CLS",
                key="model",
            )
        offline.start_optimizer(self, state, resume_dir)

    def _step(self, items: Sequence[dict], *, micro_batch_size: int | None, train: bool) -> dict[str, float]:
        return reward_step(
            self.model,
            items,
            pad_token_id=self.tokenizer.pad_token_id,
            micro_batch_size=micro_batch_size,
            center_rewards_coefficient=self.cfg.algorithm.center_rewards_coefficient,
            train=train,
        )

    def train_step(self, items: list[dict]) -> dict[str, float]:
        started = time.perf_counter()
        self.model.train()
        metrics = self._step(items, micro_batch_size=self.cfg.data.micro_batch_size_per_gpu, train=True)
        return offline.finish_step(self, metrics, started)

    def validate(self) -> dict[str, float]:
        """``val/*`` on the held-out pairs: pair accuracy, mean reward gap, mean rewards, loss."""
        if self.val_set is None:
            return {}
        self.model.eval()
        items = [self.val_set[i] for i in range(len(self.val_set))]
        # null means a training step's pairs in one forward; the held-out set can be far larger
        micro = self.cfg.data.micro_batch_size_per_gpu or 64
        with torch.no_grad():
            val = self._step(items, micro_batch_size=micro, train=False)
        return {f"val/{k}": v for k, v in val.items()}

    def _write(self, directory: Path) -> None:
        """The plain model (LoRA merged) and its tokenizer as ``reward_model/``; a LoRA run's adapter
        and head as ``lora_adapter/`` too."""
        save_model(self.model, directory / RM_DIR, write=True, merged=True)
        with quiet_transformers():
            self.tokenizer.save_pretrained(directory / RM_DIR)
        if self.cfg.model.lora_rank > 0:
            save_model(self.model, directory / ADAPTER_DIR, write=True)

    def save(self, step: int) -> Path:
        return offline.save(self, step, write=self._write)

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``; return the run directory, validation before/after, the last
        checkpoint and its ``reward_model`` directory."""
        summary = offline.fit(self)
        if "checkpoint" in summary:
            summary["reward_model"] = str(Path(summary["checkpoint"]) / RM_DIR)
        return summary
