r"""Offline DPO: preference pairs, reference log-probs computed once, the ``dpo_loss`` family.

The log-probability of a response is the sum over its tokens,
:math:`\log\pi(y \mid x) = \sum_t m_t \log\pi(y_t \mid x, y_{<t})`, with :math:`m_t` its assistant-token
mask. Before the first step the reference's :math:`\log\pi_{ref}(y_c)` and :math:`\log\pi_{ref}(y_r)`
of every training and held-out pair are computed once (the reference is the starting model, or
``model.ref_path``; zero with ``reference_free``), stored by pair index and saved in each checkpoint,
so no reference model stays in memory and a resumed run reuses the same numbers. One step:
  1. forward the chosen and the rejected sides of each micro-batch in one batch;
  2. ``dpo_loss`` (``algorithm.loss_type``) of
     :math:`h = (\log\pi(y_c) - \log\pi_{ref}(y_c)) - (\log\pi(y_r) - \log\pi_{ref}(y_r))`,
     weighted by the micro-batch's share of the step's pairs, so the gradient is that of the step's mean;
  3. clip, AdamW step, lr schedule.
Metrics (TRL's names): ``rewards/chosen`` and ``rewards/rejected`` (means of
:math:`\beta(\log\pi - \log\pi_{ref})`), ``rewards/accuracies`` (share of pairs whose chosen reward is
higher), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``; held-out pairs give the same
under ``val/``, and the held-out prompts give greedy task accuracy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tearless.algos import dpo_loss
from tearless.config.dpo import DPOConfig
from tearless.data.pairs import PairDataset, collate_pairs
from tearless.data.sft import read_many
from tearless.trainers import offline
from tearless.trainers.sft import token_logps


def pair_logps(model: torch.nn.Module, items: Sequence[dict], *, pad_token_id: int) -> torch.Tensor:
    """Summed response log-probs, shape (P, 2): column 0 the chosen side, 1 the rejected side."""
    batch = collate_pairs(items, pad_token_id=pad_token_id)
    logps = token_logps(model, batch)
    mask = batch["loss_mask"][:, 1:].to(logps.device).bool()
    sums = torch.where(mask, logps, 0.0).sum(-1)
    return torch.stack(sums.chunk(2), dim=1)


@torch.no_grad()
def reference_logps(
    model: torch.nn.Module, dataset: Sequence[dict], *, pad_token_id: int, micro_batch_size: int = 64
) -> dict[int, tuple[float, float]]:
    """``{pair index: (log π_ref(chosen), log π_ref(rejected))}`` for every pair of ``dataset``."""
    model.eval()
    items = [dataset[i] for i in range(len(dataset))]
    out: dict[int, tuple[float, float]] = {}
    for start in range(0, len(items), micro_batch_size):
        chunk = items[start : start + micro_batch_size]
        for it, (c, r) in zip(
            chunk, pair_logps(model, chunk, pad_token_id=pad_token_id).tolist(), strict=True
        ):
            out[it["index"]] = (c, r)
    return out


def preference_step(
    model: torch.nn.Module,
    items: Sequence[dict],
    ref: dict[int, tuple[float, float]],
    *,
    pad_token_id: int,
    beta: float,
    label_smoothing: float = 0.0,
    kind: str = "sigmoid",
    micro_batch_size: int | None = None,
    train: bool = True,
) -> dict[str, float]:
    """Loss (backward when ``train``) and the DPO metrics over ``items``, micro-batched."""
    size = micro_batch_size or len(items)
    sums = dict.fromkeys(("loss", "chosen", "rejected", "accuracies", "margins", "logp_c", "logp_r"), 0.0)
    for start in range(0, len(items), size):
        chunk = items[start : start + size]
        with torch.set_grad_enabled(train):
            logps = pair_logps(model, chunk, pad_token_id=pad_token_id)
            refs = torch.tensor([ref[it["index"]] for it in chunk], dtype=logps.dtype, device=logps.device)
            loss, chosen, rejected = dpo_loss(
                logps[:, 0], logps[:, 1], refs[:, 0], refs[:, 1], beta, label_smoothing, kind
            )
            weighted = loss * len(chunk) / len(items)
        if train:
            weighted.backward()
        sums["loss"] += weighted.item()
        sums["chosen"] += chosen.sum().item()
        sums["rejected"] += rejected.sum().item()
        sums["accuracies"] += (chosen > rejected).float().sum().item()
        sums["margins"] += (chosen - rejected).sum().item()
        sums["logp_c"] += logps[:, 0].detach().sum().item()
        sums["logp_r"] += logps[:, 1].detach().sum().item()
    n = len(items)
    return {
        "loss": sums["loss"],
        "rewards/chosen": sums["chosen"] / n,
        "rewards/rejected": sums["rejected"] / n,
        "rewards/accuracies": sums["accuracies"] / n,
        "rewards/margins": sums["margins"] / n,
        "logps/chosen": sums["logp_c"] / n,
        "logps/rejected": sums["logp_r"] / n,
    }


class DPOTrainer:
    """Single-process offline DPO trainer. ``DPOTrainer(cfg).fit()`` trains and returns a summary."""

    def __init__(self, cfg: DPOConfig, *, log: Callable[[str], None] = print) -> None:
        from tearless.data import PromptLoader, load_many
        from tearless.models.loading import load_causal_lm, load_tokenizer

        self.cfg, self.log = cfg, log
        data, t = cfg.data, cfg.trainer
        self.device = offline.setup_torch(t)
        self.run_dir = Path(t.default_local_dir)
        self.start_step, state, resume_dir = offline.find_resume(t, self.run_dir)
        model_path, train_files, val_files, prompt_files = self._resolve_paths()
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_path, "model.path")
        keys = dict(
            max_length=data.max_length,
            truncation=data.truncation,
            prompt_key=data.prompt_key,
            chosen_key=data.chosen_key,
            rejected_key=data.rejected_key,
        )
        self.train_set = PairDataset(read_many(train_files), self.tokenizer, source=str(train_files), **keys)
        val_records = read_many(val_files) if val_files else []
        self.prompt_rows = load_many(prompt_files) if prompt_files else []
        if data.val_max_samples > 0:
            val_records = val_records[: data.val_max_samples]
            self.prompt_rows = self.prompt_rows[: data.val_max_samples]
        self.val_set = PairDataset(val_records, self.tokenizer, **keys) if val_records else None
        self.loader = PromptLoader(
            self.train_set,
            data.train_batch_size,
            shuffle=data.shuffle,
            seed=t.seed if data.seed is None else data.seed,
        )
        self.total_steps = t.total_training_steps or t.total_epochs * self.loader.num_batches
        self.model = load_causal_lm(
            resume_dir / "actor" if resume_dir else model_path,
            dtype=cfg.model.dtype,
            gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
            key="model.path",
        ).to(self.device)
        self.optimizer, self.scheduler = offline.make_optimizer(self.model, cfg.optim, self.total_steps)
        if state is not None:
            offline.restore(state, self.optimizer, self.scheduler)
            self.ref = state["reference_logps"]
            log(f"resumed from {resume_dir} at step {self.start_step}")
        else:
            self.ref = self._reference(cfg.model.ref_path or model_path)

    def _resolve_paths(self) -> tuple[Any, Any, Any, Any]:
        """Model, train pairs, held-out pairs and held-out prompts; the embedded task's where null."""
        cfg = self.cfg
        model_path, data = cfg.model.path, cfg.data
        if model_path is not None and data.train_files is not None:
            return model_path, data.train_files, data.val_files, data.val_prompt_files
        from tearless.tasks.bootstrap import TaskSpec, prepare_task
        from tearless.tasks.preferences import prepare_pairs

        task = cfg.task
        spec = TaskSpec.from_config(task)
        files = prepare_task(spec, task.cache_dir, fresh=task.fresh, log=self.log)
        if data.train_files is not None:
            return files.model_dir, data.train_files, data.val_files, data.val_prompt_files
        pairs = prepare_pairs(
            spec,
            files,
            task.cache_dir,
            samples_per_prompt=task.samples_per_prompt,
            temperature=task.temperature,
            max_new_tokens=data.max_response_length,
            fresh=task.fresh,
            log=self.log,
        )
        return model_path or files.model_dir, pairs.train_file, pairs.val_file, files.val_file

    def _reference(self, ref_path: Any) -> dict[str, dict[int, tuple[float, float]]]:
        """Reference log-probs of every train and held-out pair (zeros when reference-free)."""
        from tearless.models.loading import load_causal_lm

        sets = {"train": self.train_set, "val": self.val_set}
        if self.cfg.algorithm.reference_free:
            return {k: {s[i]["index"]: (0.0, 0.0) for i in range(len(s))} for k, s in sets.items() if s}
        same = self.cfg.model.ref_path is None
        ref_model = (
            self.model if same else load_causal_lm(ref_path, dtype=self.cfg.model.dtype, key="model.ref_path")
        )
        ref_model.to(self.device)
        size = self.cfg.data.micro_batch_size_per_gpu or 64
        pad = self.tokenizer.pad_token_id
        return {
            k: reference_logps(ref_model, s, pad_token_id=pad, micro_batch_size=size)
            for k, s in sets.items()
            if s
        }

    def _step_kwargs(self) -> dict[str, Any]:
        alg = self.cfg.algorithm
        return dict(
            pad_token_id=self.tokenizer.pad_token_id,
            beta=alg.beta,
            label_smoothing=alg.label_smoothing,
            kind=alg.loss_type,
            micro_batch_size=self.cfg.data.micro_batch_size_per_gpu,
        )

    def train_step(self, items: list[dict]) -> dict[str, float]:
        started = time.perf_counter()
        self.model.train()
        metrics = preference_step(self.model, items, self.ref["train"], **self._step_kwargs())
        metrics["train/loss"] = metrics.pop("loss")
        metrics.update(
            offline.optimizer_step(self.model, self.optimizer, self.scheduler, self.cfg.optim.clip_grad)
        )
        metrics["timing_s/step"] = time.perf_counter() - started
        return metrics

    def validate(self) -> dict[str, float]:
        """``val/*`` preference metrics on the held-out pairs and greedy accuracy on held-out prompts."""
        metrics: dict[str, float] = {}
        if self.val_set is not None:
            self.model.eval()
            items = [self.val_set[i] for i in range(len(self.val_set))]
            kwargs = {**self._step_kwargs(), "micro_batch_size": self.cfg.data.micro_batch_size_per_gpu or 64}
            val = preference_step(self.model, items, self.ref["val"], train=False, **kwargs)
            metrics.update({f"val/{k}": v for k, v in val.items()})
        if self.prompt_rows:
            metrics.update(
                offline.greedy_accuracy(
                    self.model,
                    self.tokenizer,
                    self.prompt_rows,
                    max_new_tokens=self.cfg.data.max_response_length,
                )
            )
        return metrics

    def save(self, step: int) -> Path:
        return offline.save(self, step, reference_logps=self.ref)

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``; return the run directory, validation before/after, checkpoint."""
        return offline.fit(self)
