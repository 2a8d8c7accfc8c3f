"""Preference pairs for the embedded task, made from the warm-up model's own answers.

Each prompt is answered ``samples_per_prompt`` times by sampling; the task's verifier judges every
answer. A prompt with at least one correct and one incorrect answer gives one pair: its most
frequent correct answer (chosen) against its most frequent incorrect one (rejected), i.e. the
model's usual mistake. Prompts the model always or never gets right give no pair. The pairs land
next to the task's cache entry, keyed by the task's key and the sampling settings, built under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tearless.cachedir import build_dir, cached_build
from tearless.data import load_rows, render_prompt, write_parquet
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.rollout.hf import HFRollout
from tearless.rollout.seeds import prompt_keys
from tearless.tasks import arithmetic
from tearless.tasks.bootstrap import TaskFiles, TaskSpec

PAIRS_VERSION = 1  # bump when pair construction changes, so stale caches are rebuilt


@dataclass(frozen=True)
class PairFiles:
    train_file: str
    val_file: str
    info: dict


@torch.no_grad()
def sampled_answers(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    seed: int,
    temperature: float = 1.0,
    chunk: int | None = None,
) -> list[str]:
    """``model``'s answers to each row's prompt, sampled ``samples_per_prompt`` times and decoded
    (answer ``j`` is to ``rows[j // samples_per_prompt]``), each prompt with its own sampling key
    (:func:`~tearless.rollout.seeds.prompt_keys` of ``seed``); ``chunk`` prompts are generated at a
    time (``None``: all at once)."""
    rollout = HFRollout(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    keys = prompt_keys(seed, 0, 0, len(rows))
    size = chunk or max(1, len(rows))
    texts = []
    for start in range(0, len(rows), size):
        out = rollout.generate(
            [render_prompt(tokenizer, r["prompt"]) for r in rows[start : start + size]],
            n=samples_per_prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            keys=keys[start : start + size],
        )
        texts += [
            tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(out.response_ids, out.response_mask, strict=True)
        ]
    return texts


def make_pairs(
    model: torch.nn.Module,
    tokenizer: Any,
    rows: list[dict],
    *,
    samples_per_prompt: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    chunk: int = 500,
    score: Callable[[str, Any], float] = arithmetic.compute_score,
) -> list[dict]:
    """Preference rows (``prompt``, ``chosen``, ``rejected`` strings, plus the prompt row's
    ``data_source``, ``reward_model`` and ``extra_info`` with the sample counts) for ``rows``.
    An answer is correct when ``score(answer, ground_truth) >= 1`` (the embedded task's scorer by
    default; another task's ``compute_score`` makes pairs for its rows)."""
    texts = sampled_answers(
        model,
        tokenizer,
        rows,
        samples_per_prompt=samples_per_prompt,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed,
        chunk=chunk,
    )
    pairs = []
    for j, row in enumerate(rows):
        answers = texts[j * samples_per_prompt : (j + 1) * samples_per_prompt]
        truth = row["reward_model"]["ground_truth"]
        judged = [(a, score(a, truth) >= 1.0) for a in answers]
        right = Counter(a for a, ok in judged if ok)
        wrong = Counter(a for a, ok in judged if not ok)
        if not right or not wrong:
            continue
        pairs.append(
            {
                "data_source": row["data_source"],
                "prompt": row["prompt"],
                "chosen": right.most_common(1)[0][0],
                "rejected": wrong.most_common(1)[0][0],
                "reward_model": row["reward_model"],
                "extra_info": {
                    **row["extra_info"],
                    "num_correct": sum(right.values()),
                    "num_samples": samples_per_prompt,
                },
            }
        )
    return pairs


def prepare_pairs(
    spec: TaskSpec,
    task: TaskFiles,
    cache_dir: str | os.PathLike | None = None,
    *,
    samples_per_prompt: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 16,
    fresh: bool = False,
    log=print,
) -> PairFiles:
    """Training and held-out pairs from ``task``'s warm-up model on its train and test prompts."""
    settings = {
        "task": spec.key(),
        "samples_per_prompt": samples_per_prompt,
        "temperature": temperature,
        "max_new_tokens": max_new_tokens,
        "version": PAIRS_VERSION,
    }
    final = build_dir(cache_dir, f"{spec.key()}-pairs", settings)

    def build(tmp: Path) -> dict:
        log(f"making preference pairs from the warm-up model's answers in {final} (cached)")
        started = time.perf_counter()
        model, tokenizer = load_causal_lm(task.model_dir), load_tokenizer(task.model_dir)
        info: dict[str, Any] = {"settings": settings}
        for name, source, seed in (
            ("train", task.train_file, spec.seed),
            ("test", task.val_file, spec.seed + 1),
        ):
            rows = load_rows(source)
            pairs = make_pairs(
                model,
                tokenizer,
                rows,
                samples_per_prompt=samples_per_prompt,
                temperature=temperature,
                max_new_tokens=max_new_tokens,
                seed=seed,
            )
            if not pairs:
                raise RuntimeError(
                    f"no {name} prompt got both a correct and an incorrect answer in {samples_per_prompt} "
                    "samples; raise task.samples_per_prompt or task.temperature"
                )
            write_parquet(pairs, tmp / f"{name}_pairs.parquet")
            info[f"{name}_pairs"], info[f"{name}_prompts"] = len(pairs), len(rows)
        info["build_seconds"] = round(time.perf_counter() - started, 1)
        log(
            f"{info['train_pairs']} training, {info['test_pairs']} held-out pairs ({info['build_seconds']} s)"
        )
        return info

    info = cached_build(final, "pairs.json", build, fresh=fresh)
    return PairFiles(str(final / "train_pairs.parquet"), str(final / "test_pairs.parquet"), info)
