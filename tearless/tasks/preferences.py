"""Preference pairs for the embedded task, made from the warm-up model's own answers.

Each prompt is answered ``samples_per_prompt`` times by sampling; the task's verifier judges every
answer. A prompt with at least one correct and one incorrect answer gives one pair: its most
frequent correct answer (chosen) against its most frequent incorrect one (rejected), i.e. the
model's usual mistake. Prompts the model always or never gets right give no pair. The pairs land
next to the task's cache entry, keyed by the task's key and the sampling settings, built under a
temporary name and renamed when complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tearless.data import load_rows, render_prompt, write_parquet
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.rollout.hf import HFRollout
from tearless.rollout.seeds import prompt_keys
from tearless.tasks import arithmetic
from tearless.tasks.bootstrap import TaskFiles, TaskSpec, default_cache_dir

PAIRS_VERSION = 1  # bump when pair construction changes, so stale caches are rebuilt


@dataclass(frozen=True)
class PairFiles:
    train_file: str
    val_file: str
    info: dict


@torch.no_grad()
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
) -> list[dict]:
    """Preference rows (``prompt``, ``chosen``, ``rejected`` strings, plus the prompt row's
    ``data_source``, ``reward_model`` and ``extra_info`` with the sample counts) for ``rows``."""
    rollout = HFRollout(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    keys = prompt_keys(seed, 0, 0, len(rows))
    pairs = []
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        out = rollout.generate(
            [render_prompt(tokenizer, r["prompt"]) for r in part],
            n=samples_per_prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            keys=keys[start : start + chunk],
        )
        texts = [
            tokenizer.decode(ids[m.bool()], skip_special_tokens=True)
            for ids, m in zip(out.response_ids, out.response_mask, strict=True)
        ]
        for j, row in enumerate(part):
            answers = texts[j * samples_per_prompt : (j + 1) * samples_per_prompt]
            truth = row["reward_model"]["ground_truth"]
            judged = [(a, arithmetic.compute_score(a, truth) >= 1.0) for a in answers]
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
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    final = root / f"{spec.key()}-pairs-{digest}"
    if fresh and final.exists():
        shutil.rmtree(final)
    if not (final / "pairs.json").is_file():
        log(f"making preference pairs from the warm-up model's answers in {final} (cached)")
        started = time.perf_counter()
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
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
        (tmp / "pairs.json").write_text(json.dumps(info, indent=1))
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same build first; theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
        log(
            f"{info['train_pairs']} training, {info['test_pairs']} held-out pairs ({info['build_seconds']} s)"
        )
    info = json.loads((final / "pairs.json").read_text())
    return PairFiles(str(final / "train_pairs.parquet"), str(final / "test_pairs.parquet"), info)
