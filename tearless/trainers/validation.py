"""Held-out validation of the RL trainer: greedy accuracy always, mean@n and pass@k when sampling;
and ``tearless eval``'s :func:`evaluate`, the same validation of a model without a trainer."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tearless.config import Config
from tearless.config.plan import RunFiles, adapter_path, build_plan
from tearless.cpu import configure_cpu
from tearless.models.loading import check_model_dir
from tearless.rollout.batch import Rollout
from tearless.rollout.seeds import prompt_keys
from tearless.trainers.metrics import pass_at_k
from tearless.trainers.progress import Progress
from tearless.trainers.reward_errors import RewardErrors
from tearless.trainers.setup import prompt_set, rule_scored_validation, run_processor, run_tokenizer
from tearless.workers.build import ModelBuilder
from tearless.workers.calibrate import resolve_auto
from tearless.workers.group import LocalWorkers
from tearless.workers.spec import RankSpec, resolve_device


def validate(
    val_set: Sequence[dict],
    generate: Callable[..., Rollout],
    val_kwargs: Any,
    *,
    seed: int,
    batch_size: int | None,
    log: Callable[[str], None],
) -> dict[str, float]:
    """``val-core/<data_source>/{acc,reward}/greedy`` and, with ``val_kwargs.do_sample``, ``mean@n``
    and unbiased ``pass@k`` for k = 1, 2, 4, … ≤ n, per data source.

    ``generate(prompts, keys=…, n=…, **sampling)`` is the trainer's scored generation;
    ``val_kwargs`` the ``actor_rollout_ref.rollout.val_kwargs`` section, ``batch_size``
    ``data.val_batch_size`` (None: one call). A sample is correct when its scorer's ``acc`` is true
    or, without one, its score is ≥ 1. The held-out prompts sample with keys of their own (step −1),
    the same at every validation, so two validations differ only by the policy.
    """
    vk = val_kwargs
    # Each held-out prompt's uid is its place in the set, given here where it is drawn.
    items = [{**val_set[i], "uid": f"val-{i}"} for i in range(len(val_set))]
    size = batch_size or len(items)
    metrics: dict[str, float] = {}
    greedy = _val_pass(generate, items, size, log, n=1, keys=None, do_sample=False)
    for src, vals in greedy.items():
        metrics[f"val-core/{src}/acc/greedy"] = sum(c for _, c in vals) / len(vals)
        metrics[f"val-core/{src}/reward/greedy"] = sum(m for m, _ in vals) / len(vals)
    if vk.do_sample:
        keys = prompt_keys(seed, -1, 2, len(items))
        sampling = dict(temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k)
        for src, vals in _val_pass(generate, items, size, log, n=vk.n, keys=keys, **sampling).items():
            metrics[f"val-core/{src}/reward/mean@{vk.n}"] = sum(m for m, _ in vals) / len(vals)
            metrics[f"val-core/{src}/acc/mean@{vk.n}"] = sum(c for _, c in vals) / (len(vals) * vk.n)
            k = 1
            while k <= vk.n:
                metrics[f"val-core/{src}/acc/pass@{k}"] = sum(pass_at_k(vk.n, c, k) for _, c in vals) / len(
                    vals
                )
                k *= 2
    return metrics


def _val_pass(
    generate: Callable[..., Rollout],
    items: list[dict],
    size: int,
    log: Callable[[str], None],
    *,
    n: int,
    keys: list[int] | None,
    **sampling: Any,
) -> dict[str, list[tuple[float, int]]]:
    """Generate ``n`` responses per item; per data_source, (mean score, number correct) per prompt,
    the responses matched to their prompt by uid."""
    per_source: dict[str, list[tuple[float, int]]] = defaultdict(list)
    kind = "greedy" if keys is None else f"sampled, n={n}"
    progress = Progress(log, f"validation ({kind})", len(items), "prompts")
    for start in range(0, len(items), size):
        chunk = items[start : start + size]
        chunk_keys = None if keys is None else keys[start : start + size]
        rollout = generate(chunk, keys=chunk_keys, n=n, **sampling)
        rows: dict[str, list[int]] = defaultdict(list)
        for row, uid in enumerate(rollout.uids):
            rows[uid].append(row)
        for it in chunk:
            mine = torch.tensor(rows[it["uid"]])
            scores, correct = rollout.scores[mine], rollout.correct[mine]
            per_source[it["data_source"]].append((float(scores.mean()), int(correct.sum())))
        progress.update(start + len(chunk))
    return per_source


def format_validation(title: str, metrics: dict[str, float]) -> str:
    lines = [f"held-out {title}:"] + [f"  {k:<40} {v:.4f}" for k, v in sorted(metrics.items())]
    return "\n".join(lines)


def evaluate(
    cfg: Config, *, reward_fn: Callable[..., Any] | None = None, log: Callable[[str], None] = print
) -> dict[str, float]:
    """:func:`validate` of ``actor_rollout_ref.model.path`` on ``data.val_files``, in this process,
    without a trainer: no training data, optimizer, run directory or checkpoint.

    The policy is the actor's model built forward-only (its ``model.dtype``, its ``param_dtype``
    compute precision, ``auto`` measured as the trainer measures it; a ``lora_adapter_path``'s
    adapters) and the built-in engine samples from it as the hybrid trainer's engine samples from the
    trained actor, so the metrics are those of ``trainer.val_only``; vLLM serves ``model.path`` from
    its own copy. The reward manager scores as in training.
    """
    t = cfg.trainer
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    configure_cpu(t.num_threads, t.keep_freed_memory)
    model_path = str(check_model_dir(cfg.actor_rollout_ref.model.path, "actor_rollout_ref.model.path"))
    files = RunFiles(model_path, None, cfg.data.val_files, None, None, lora_adapter_path=adapter_path(cfg))
    tokenizer = run_tokenizer(cfg, files)
    val_set = prompt_set(cfg, "val", files.val_files, tokenizer, reward_fn, log, run_processor(files))
    device = resolve_device(t.device)
    plan = resolve_auto(cfg, build_plan(cfg, files), gpu=device == "cuda", log=log)
    # One rank that trains no role and generates.
    spec = RankSpec(
        cfg,
        roles=(),
        rollout=True,
        model_path=model_path,
        total_steps=0,
        device=device,
        reward_fn=reward_fn,
        plan=plan,
    )
    # The built-in engine samples from the actor's model as the hybrid trainer's does; an engine holding
    # its own copy (vLLM) loads model.path itself.
    models = {}
    if not plan.capabilities.holds_own_weights:
        builder = ModelBuilder(spec, 0, 1, None, torch.device(device))
        models["actor"] = builder.causal_lm("actor", trained=False)
    workers = LocalWorkers(spec.replaced(models=models), tokenizer.pad_token_id)
    errors = RewardErrors(cfg.reward_model.tolerate_failed_steps, log)
    rule_scored = rule_scored_validation(cfg, reward_fn, val_set, log)

    def generate(prompts: list[dict], *, keys: list[int] | None, n: int, **sampling: Any) -> Rollout:
        rollout = workers.generate(
            prompts, n=n, keys=keys, max_new_tokens=plan.response_length, rule_scored=rule_scored, **sampling
        )
        errors.report(rollout.errors, len(rollout.items))
        return rollout

    try:
        vk = cfg.actor_rollout_ref.rollout.val_kwargs
        return validate(val_set, generate, vk, seed=t.seed, batch_size=cfg.data.val_batch_size, log=log)
    finally:
        workers.close()
