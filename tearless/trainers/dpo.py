r"""Offline preference optimisation: the ``dpo_loss`` family on pairs, ``kto_loss`` on unpaired examples.

The log-probability of a response is the sum over its tokens,
:math:`\log\pi(y \mid x) = \sum_t m_t \log\pi(y_t \mid x, y_{<t})`, with :math:`m_t` its assistant-token
mask, and its length L is :math:`\sum_t m_t`. The reference's log-probs of both sides of an item (a
pair's chosen and rejected responses; a KTO example's response and its mismatched KL sequence) are
computed when the item is first used, batch by batch (TRL's default; the whole file up front kept a
real model silent for minutes), by a frozen copy of the starting model or by ``model.ref_path`` (zero
with ``reference_free`` and for the reference-free cpo, simpo and orpo), stored by item index and
saved in each checkpoint, so each is computed once and a resumed run reuses the same numbers. One step
on pairs:
  1. forward the chosen and the rejected sides of each micro-batch in one batch;
  2. ``dpo_loss`` (``algorithm.loss_type``) of the summed log-probs, their lengths and the step's mean
     chosen length (so token-mean NLL terms stay the step's token mean), weighted by the micro-batch's
     share of the step's pairs, so the gradient is that of the step's mean;
  3. clip, AdamW step, lr schedule.
KTO (:mod:`tearless.trainers.kto`) first estimates its reference point z from the step's KL sequences,
then runs 1-3 on the responses with ``kto_loss``.
Metrics (TRL's names): ``rewards/chosen`` and ``rewards/rejected`` (means of the implicit rewards,
:math:`\beta(\log\pi - \log\pi_{ref})` for the DPO family), ``rewards/accuracies`` (share of pairs
whose chosen reward is higher), ``rewards/margins``, ``logps/chosen``, ``logps/rejected``; held-out
items give the same under ``val/``, and the held-out prompts give greedy task accuracy.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tearless.algos import KTO_LOSSES, REFERENCE_FREE, dpo_loss
from tearless.config.dpo import DPOConfig
from tearless.data import load_many
from tearless.data.pairs import PairDataset, UnpairedDataset, side_lengths
from tearless.data.sft import read_many
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.tasks.bootstrap import TaskSpec
from tearless.tasks.preferences import prepare_pairs
from tearless.trainers import offline
from tearless.trainers.kto import kto_step
from tearless.trainers.progress import Progress
from tearless.trainers.sft import side_logps
from tearless.trainers.warmup import prepare_task

PAIR_SIDES = ("chosen", "rejected")
KTO_SIDES = ("completion", "kl")


@torch.no_grad()
def reference_logps(
    model: torch.nn.Module,
    dataset: Sequence[dict],
    *,
    pad_token_id: int,
    micro_batch_size: int = 64,
    sides: Sequence[str] = PAIR_SIDES,
) -> dict[int, tuple[float, ...]]:
    """``{item index: (log π_ref(side 0), log π_ref(side 1))}`` for every item of ``dataset``."""
    model.eval()
    items = [dataset[i] for i in range(len(dataset))]
    out: dict[int, tuple[float, ...]] = {}
    for start in range(0, len(items), micro_batch_size):
        chunk = items[start : start + micro_batch_size]
        logps = side_logps(model, chunk, pad_token_id=pad_token_id, sides=sides).tolist()
        for it, values in zip(chunk, logps, strict=True):
            out[it["index"]] = tuple(values)
    return out


def preference_step(
    model: torch.nn.Module,
    items: Sequence[dict],
    ref: dict[int, tuple[float, ...]],
    *,
    pad_token_id: int,
    micro_batch_size: int | None = None,
    train: bool = True,
    **loss: Any,
) -> dict[str, float]:
    """Loss (backward when ``train``) and the DPO metrics over the pairs ``items``, micro-batched.

    ``loss`` holds :func:`~tearless.algos.dpo_loss`'s keyword arguments (``beta``, ``kind``,
    ``label_smoothing``, …); the token counts come from the items.
    """
    size = micro_batch_size or len(items)
    mean_chosen = float(side_lengths(items, "chosen").float().mean())
    sums = dict.fromkeys(("loss", "chosen", "rejected", "accuracies", "margins", "logp_c", "logp_r"), 0.0)
    for start in range(0, len(items), size):
        chunk = items[start : start + size]
        with torch.set_grad_enabled(train):
            logps = side_logps(model, chunk, pad_token_id=pad_token_id)
            refs = torch.tensor([ref[it["index"]] for it in chunk], dtype=logps.dtype, device=logps.device)
            lengths = {f"{s}_lengths": side_lengths(chunk, s).to(logps.device) for s in PAIR_SIDES}
            loss_value, chosen, rejected = dpo_loss(
                logps[:, 0],
                logps[:, 1],
                refs[:, 0],
                refs[:, 1],
                mean_chosen_length=mean_chosen,
                **lengths,
                **loss,
            )
            weighted = loss_value * len(chunk) / len(items)
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
        **pair_reward_metrics(sums, n),
        "logps/chosen": sums["logp_c"] / n,
        "logps/rejected": sums["logp_r"] / n,
    }


def pair_reward_metrics(sums: dict[str, float], n: int) -> dict[str, float]:
    r"""A pair step's ``loss`` and TRL's ``rewards/*`` metrics (``tearless dpo`` and ``rm``) from the
    sums over its ``n`` pairs of the rewards :math:`r_c, r_r` (DPO: the implicit
    :math:`\beta(\log\pi - \log\pi_{ref})`; rm: the head's scores): ``rewards/chosen`` =
    :math:`\frac{1}{n}\sum_i r_{c,i}`, ``rewards/rejected`` likewise, ``rewards/accuracies`` = the share
    of pairs with :math:`r_c > r_r`, ``rewards/margins`` = :math:`\frac{1}{n}\sum_i (r_{c,i} - r_{r,i})`.
    ``sums["loss"]`` is already the step's mean (micro-batch losses weighted by their share of pairs).
    """
    return {
        "loss": sums["loss"],
        "rewards/chosen": sums["chosen"] / n,
        "rewards/rejected": sums["rejected"] / n,
        "rewards/accuracies": sums["accuracies"] / n,
        "rewards/margins": sums["margins"] / n,
    }


def pair_paths(
    model_path: Any, data: Any, task: Any, *, log: Callable[[str], None]
) -> tuple[Any, Any, Any, str | None]:
    """``(model, train pairs, held-out pairs, held-out prompts)``: ``model_path`` and ``data``'s files
    where given, else the embedded task's warm-up model and the pairs made from its answers (built and
    cached on first use; ``task`` is a :class:`~tearless.config.dpo.DPOTaskConfig`). The held-out
    prompts are the task's when its pairs are used, else None."""
    if model_path is not None and data.train_files is not None:
        return model_path, data.train_files, data.val_files, None
    spec = TaskSpec.from_config(task)
    files = prepare_task(spec, task.cache_dir, fresh=task.fresh, log=log)
    if data.train_files is not None:
        return files.model_dir, data.train_files, data.val_files, None
    pairs = prepare_pairs(
        spec,
        files,
        task.cache_dir,
        samples_per_prompt=task.samples_per_prompt,
        temperature=task.temperature,
        max_new_tokens=data.max_response_length,
        fresh=task.fresh,
        log=log,
    )
    return model_path or files.model_dir, pairs.train_file, pairs.val_file, files.val_file


# The data section's keys every pair dataset takes, by the same names.
PAIR_DATA_KEYS = ("max_length", "truncation", "prompt_key", "chosen_key", "rejected_key")


def pair_datasets(
    dataset: Callable[..., Any], data: Any, train_files: Any, val_files: Any, tokenizer: Any, **keys: Any
) -> tuple[Any, Any | None]:
    """``(training set, held-out set or None)`` of ``dataset`` (a :mod:`tearless.data.pairs` class) read
    from the files :func:`pair_paths` resolved, with ``data``'s length and column keys plus ``keys``; the
    held-out set keeps its first ``data.val_max_samples`` rows when that is > 0 (``tearless dpo`` and
    ``rm``)."""
    keys = {**{k: getattr(data, k) for k in PAIR_DATA_KEYS}, **keys}
    train_set = dataset(read_many(train_files), tokenizer, source=str(train_files), **keys)
    val_records = read_many(val_files) if val_files else []
    if data.val_max_samples > 0:
        val_records = val_records[: data.val_max_samples]
    val_set = dataset(val_records, tokenizer, source=str(val_files), **keys) if val_records else None
    return train_set, val_set


class DPOTrainer:
    """Single-process offline preference trainer (every ``algorithm.loss_type``, pairs or KTO).
    ``DPOTrainer(cfg).fit()`` trains and returns a summary."""

    def __init__(self, cfg: DPOConfig, *, log: Callable[[str], None] = print) -> None:
        state, resume_dir = offline.begin(self, cfg, log)
        data, t = cfg.data, cfg.trainer
        model_path, train_files, val_files, prompt_files = self._resolve_paths()
        # The held-out scorer is checked before anything of the model (its tokenizer included) loads.
        self.prompt_rows = load_many(prompt_files) if prompt_files else []
        if data.val_max_samples > 0:
            self.prompt_rows = self.prompt_rows[: data.val_max_samples]
        self.score_fn = offline.held_out_scorer(cfg.custom_reward_function, self.prompt_rows)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or model_path, "model.path")
        self.unpaired = cfg.algorithm.loss_type in KTO_LOSSES
        unpaired_keys = (
            dict(completion_key=data.completion_key, label_key=data.label_key, kl_seed=t.seed)
            if self.unpaired
            else {}
        )
        dataset = UnpairedDataset if self.unpaired else PairDataset
        self.train_set, self.val_set = pair_datasets(
            dataset, data, train_files, val_files, self.tokenizer, **unpaired_keys
        )
        self.loader, self.total_steps = offline.make_loader(self.train_set, data, t)
        self.model = load_causal_lm(
            resume_dir / "actor" if resume_dir else model_path,
            dtype=cfg.model.dtype,
            gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
            key="model.path",
        )
        offline.start_optimizer(self, state, resume_dir)
        # Reference log-probs are computed batch by batch as items are first used (TRL's default), by a
        # frozen copy of the starting model (or model.ref_path), and kept in checkpoints.
        self.ref_source = cfg.model.ref_path or model_path
        self.ref_model: torch.nn.Module | None = None
        self.ref: dict[str, dict[int, tuple[float, ...]]] = {"train": {}, "val": {}}
        if state is not None:
            self.ref.update(state["reference_logps"])
        elif cfg.model.ref_path is None and not self._reference_free():
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

    def _resolve_paths(self) -> tuple[Any, Any, Any, Any]:
        """Model, train pairs, held-out pairs and held-out prompts; the embedded task's where null."""
        data = self.cfg.data
        model_path, train, val, prompts = pair_paths(self.cfg.model.path, data, self.cfg.task, log=self.log)
        return model_path, train, val, data.val_prompt_files if data.train_files is not None else prompts

    def _reference_free(self) -> bool:
        alg = self.cfg.algorithm
        return alg.reference_free or alg.loss_type in REFERENCE_FREE

    def _fill_reference(self, split: str, items: Sequence[dict]) -> dict[int, tuple[float, ...]]:
        """``self.ref[split]`` with the reference log-probs of both sides of ``items`` added where missing
        (zeros without a reference: ``reference_free``, or a reference-free loss type)."""
        known = self.ref[split]
        todo = [it for it in items if it["index"] not in known]
        if not todo:
            return known
        if self._reference_free():
            known.update({it["index"]: (0.0, 0.0) for it in todo})
            return known
        if self.ref_model is None:  # model.ref_path, or a resumed run's starting model
            key = "model.ref_path" if self.cfg.model.ref_path else "model.path"
            model = load_causal_lm(self.ref_source, dtype=self.cfg.model.dtype, key=key)
            self.ref_model = model.to(self.device).eval().requires_grad_(False)
        size = self.cfg.data.micro_batch_size_per_gpu or 64
        sides = KTO_SIDES if self.unpaired else PAIR_SIDES
        progress = Progress(self.log, f"reference log-probs ({split})", len(todo), "items")
        for start in range(0, len(todo), size):
            chunk = todo[start : start + size]
            known.update(
                reference_logps(
                    self.ref_model,
                    chunk,
                    pad_token_id=self.tokenizer.pad_token_id,
                    micro_batch_size=size,
                    sides=sides,
                )
            )
            progress.update(start + len(chunk))
        return known

    def _step_kwargs(self) -> dict[str, Any]:
        alg = self.cfg.algorithm
        common = dict(
            pad_token_id=self.tokenizer.pad_token_id,
            beta=alg.beta,
            kind=alg.loss_type,
            micro_batch_size=self.cfg.data.micro_batch_size_per_gpu,
        )
        if self.unpaired:
            return dict(
                common, desirable_weight=alg.desirable_weight, undesirable_weight=alg.undesirable_weight
            )
        return dict(
            common,
            label_smoothing=alg.label_smoothing,
            f_divergence=alg.f_divergence_type,
            f_alpha=alg.f_alpha_divergence_coef,
            discopop_tau=alg.discopop_tau,
            simpo_gamma=alg.simpo_gamma,
            cpo_alpha=alg.cpo_alpha,
        )

    def _step(self, items: list[dict], ref: dict, **kwargs: Any) -> dict[str, float]:
        step = kto_step if self.unpaired else preference_step
        return step(self.model, items, ref, **{**self._step_kwargs(), **kwargs})

    def train_step(self, items: list[dict]) -> dict[str, float]:
        started = time.perf_counter()
        self.model.train()
        return offline.finish_step(self, self._step(items, self._fill_reference("train", items)), started)

    def validate(self) -> dict[str, float]:
        """``val/*`` preference metrics on the held-out pairs and greedy accuracy on held-out prompts."""
        metrics: dict[str, float] = {}
        if self.val_set is not None:
            self.model.eval()
            items = [self.val_set[i] for i in range(len(self.val_set))]
            # aot sorts over the whole batch: score the held-out pairs in one piece, as in training.
            sorts = self.cfg.algorithm.loss_type in ("aot", "aot_unpaired")
            micro = None if sorts else self.cfg.data.micro_batch_size_per_gpu or 64
            val = self._step(items, self._fill_reference("val", items), train=False, micro_batch_size=micro)
            metrics.update({f"val/{k}": v for k, v in val.items()})
        metrics.update(offline.prompt_accuracy(self))
        return metrics

    def save(self, step: int) -> Path:
        return offline.save(self, step, reference_logps=self.ref)

    def fit(self) -> dict[str, Any]:
        """Train to ``total_steps``; return the run directory, validation before/after, checkpoint."""
        return offline.fit(self)
