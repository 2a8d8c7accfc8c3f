"""The chain_addition task's tiny process reward model, trained by the package on the warm-up model's
own answers labelled step by step by the task's verifier.

The warm-up model answers every training prompt ``samples_per_prompt`` times (sampled); each line of
each answer is labelled valid or not by :func:`~tearless.tasks.chain_addition.judge_steps`. The PRM is
a ``LlamaForTokenClassification`` with two labels (bad, good), its backbone initialised from the
warm-up model (PRMs usually start from the policy's base), trained with cross-entropy on the last token
of every step only (TRL's PRM format, read back by :class:`~tearless.rewards.prm.ProcessRewardScorer`).
Held-out answers to the test prompts give its step accuracy. Everything is cached next to the task,
keyed by the task and these settings.

An implicit PRM (PRIME) needs no step labels: :func:`prepare_implicit_prm` trains a copy of the
warm-up model with ``tearless dpo algorithm.loss_type=implicit_prm`` on the same kind of sampled
answers labelled by their outcome only; its log-ratio to the warm-up model is the token reward.

    python -m tearless.trainers.step_prm   # builds the default chain_addition task and PRM, prints its path
"""

from __future__ import annotations

import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tearless.cachedir import build_dir, cached_build
from tearless.config import load_config
from tearless.config.dpo import DPOConfig
from tearless.data import load_rows, write_parquet
from tearless.models.loading import load_causal_lm, load_tokenizer, quiet_transformers
from tearless.rewards.prm import encode_steps
from tearless.tasks import chain_addition
from tearless.tasks.bootstrap import TaskFiles, TaskSpec
from tearless.tasks.preferences import sampled_answers
from tearless.trainers.dpo import DPOTrainer
from tearless.trainers.warmup import prepare_task

PRM_VERSION = 1  # bump when the recipe changes, so stale caches are rebuilt


@dataclass(frozen=True)
class PRMFiles:
    model_dir: str
    info: dict


def _answers(
    model: torch.nn.Module, tokenizer: Any, rows: list[dict], samples_per_prompt: int, seed: int
) -> list[tuple[dict, str]]:
    """``model``'s sampled answers to the chain_addition prompts ``rows``, each with its prompt's row."""
    texts = sampled_answers(
        model,
        tokenizer,
        rows,
        samples_per_prompt=samples_per_prompt,
        max_new_tokens=chain_addition.RESPONSE_TOKENS,
        seed=seed,
    )
    return [(rows[j // samples_per_prompt], text) for j, text in enumerate(texts)]


def labelled_answers(
    model: torch.nn.Module, tokenizer: Any, rows: list[dict], *, samples_per_prompt: int, seed: int
) -> list[dict]:
    """Sampled answers with their token ids and per-step positions and labels (1 = valid step)."""
    examples = []
    for row, text in _answers(model, tokenizer, rows, samples_per_prompt, seed):
        labels, _, _ = chain_addition.judge_steps(text, row["extra_info"]["operands"])
        input_ids, positions, _ = encode_steps(
            tokenizer, row["prompt"], text, separator=chain_addition.SEPARATOR
        )
        if positions:
            examples.append(
                {"input_ids": input_ids, "positions": positions, "labels": [int(x) for x in labels]}
            )
    return examples


def _batch(examples: list[dict], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, e in enumerate(examples):
        ids[i, : len(e["input_ids"])] = torch.tensor(e["input_ids"])
        attention[i, : len(e["input_ids"])] = 1
        labels[i, e["positions"]] = torch.tensor(e["labels"])
    return ids, attention, labels


def train_prm(
    policy: torch.nn.Module,
    examples: list[dict],
    *,
    pad_token_id: int,
    steps: int,
    seed: int,
    batch_size: int = 64,
) -> tuple[torch.nn.Module, list[float]]:
    """A two-label token classifier with ``policy``'s backbone, trained on ``examples``; its losses."""
    from transformers import AutoModelForTokenClassification

    config = policy.config.__class__.from_dict({**policy.config.to_dict(), "num_labels": 2})
    torch.manual_seed(seed)
    prm = AutoModelForTokenClassification.from_config(config)
    prm.model.load_state_dict(policy.model.state_dict())
    opt = torch.optim.AdamW(prm.parameters(), lr=1e-3, weight_decay=0.0)
    rng = random.Random(seed)
    losses = []
    prm.train()
    for _ in range(steps):
        ids, attention, labels = _batch(rng.sample(examples, min(batch_size, len(examples))), pad_token_id)
        logits = prm(input_ids=ids, attention_mask=attention).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(prm.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return prm.eval(), losses


@torch.no_grad()
def step_accuracy(prm: torch.nn.Module, examples: list[dict], *, pad_token_id: int) -> dict[str, float]:
    """Share of steps classified right (P(good) > 0.5), overall and among the invalid steps."""
    ids, attention, labels = _batch(examples, pad_token_id)
    good = prm(input_ids=ids, attention_mask=attention).logits.softmax(-1)[..., 1] > 0.5
    scored = labels >= 0
    right = (good == (labels == 1)) & scored
    bad = (labels == 0) & scored
    return {
        "step_accuracy": float(right.sum() / scored.sum()),
        "bad_step_recall": float((right & bad).sum() / bad.sum().clamp(min=1)),
        "valid_share": float(((labels == 1) & scored).sum() / scored.sum()),
    }


def prepare_prm(
    spec: TaskSpec,
    task: TaskFiles,
    cache_dir: str | os.PathLike | None = None,
    *,
    samples_per_prompt: int = 4,
    steps: int = 400,
    fresh: bool = False,
    log=print,
) -> PRMFiles:
    """The task's PRM, trained and cached if the cache does not hold it."""
    if spec.name != "chain_addition":
        raise ValueError(f"the embedded PRM is made for task.name=chain_addition, not {spec.name!r}")
    settings = {
        "task": spec.key(),
        "samples_per_prompt": samples_per_prompt,
        "steps": steps,
        "version": PRM_VERSION,
    }

    def fit(policy: torch.nn.Module, tokenizer: Any, tmp: Path) -> dict[str, Any]:
        pad = tokenizer.pad_token_id
        kw = dict(samples_per_prompt=samples_per_prompt)
        train = labelled_answers(policy, tokenizer, load_rows(task.train_file), seed=spec.seed, **kw)
        held_out = labelled_answers(policy, tokenizer, load_rows(task.val_file), seed=spec.seed + 1, **kw)
        prm, losses = train_prm(policy, train, pad_token_id=pad, steps=steps, seed=spec.seed)
        info = {
            "train_answers": len(train),
            "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            **{f"held_out_{k}": v for k, v in step_accuracy(prm, held_out, pad_token_id=pad).items()},
        }
        with quiet_transformers():
            prm.save_pretrained(tmp / "model")
            tokenizer.save_pretrained(tmp / "model")
        log(f"PRM held-out step accuracy {info['held_out_step_accuracy']:.3f}")
        return info

    return _cached_prm(
        spec, task, cache_dir, "prm", "process reward model", settings, fit, fresh=fresh, log=log
    )


def _cached_prm(
    spec: TaskSpec,
    task: TaskFiles,
    cache_dir: str | os.PathLike | None,
    kind: str,
    what: str,
    settings: dict[str, Any],
    fit: Callable[[torch.nn.Module, Any, Path], dict[str, Any]],
    *,
    fresh: bool,
    log: Callable[[str], None],
) -> PRMFiles:
    """A PRM (``what``) of the task's warm-up model, built once in the cache under ``settings``:
    ``fit(policy, tokenizer, tmp)`` writes ``tmp / "model"`` and returns its metrics, which ``prm.json``
    keeps after the settings, with the build's seconds."""
    final = build_dir(cache_dir, f"{spec.key()}-{kind}", settings)

    def build(tmp: Path) -> dict:
        log(f"training the chain_addition task's {what} in {final} (cached)")
        started = time.perf_counter()
        policy, tokenizer = load_causal_lm(task.model_dir), load_tokenizer(task.model_dir)
        info = {"settings": settings, **fit(policy, tokenizer, tmp)}
        info["build_seconds"] = round(time.perf_counter() - started, 1)
        log(f"{what} trained ({info['build_seconds']} s)")
        return info

    return PRMFiles(str(final / "model"), cached_build(final, "prm.json", build, fresh=fresh))


def outcome_rows(
    model: torch.nn.Module, tokenizer: Any, rows: list[dict], *, samples_per_prompt: int, seed: int
) -> list[dict]:
    """Unpaired preference rows (``prompt``, ``completion``, ``label`` = the answer is right) from
    sampled answers of ``model``; the prompt row's ``data_source``, ``reward_model``, ``extra_info`` kept."""
    result = []
    for row, text in _answers(model, tokenizer, rows, samples_per_prompt, seed):
        label = chain_addition.compute_score(text, row["reward_model"]["ground_truth"])["acc"] == 1.0
        keep = {k: row[k] for k in ("data_source", "prompt", "reward_model", "extra_info")}
        result.append({**keep, "completion": text, "label": label})
    return result


def prepare_implicit_prm(
    spec: TaskSpec,
    task: TaskFiles,
    cache_dir: str | os.PathLike | None = None,
    *,
    samples_per_prompt: int = 2,
    beta: float = 0.5,
    epochs: int = 1,
    fresh: bool = False,
    log=print,
) -> PRMFiles:
    """The task's implicit PRM: the warm-up model trained with ``implicit_prm`` on outcome-labelled
    samples (cached). Its ``info`` holds the training run's held-out metrics and ``beta``; score with
    ``prm.kind=implicit prm.path=<model_dir> prm.ref_path=<the task's model> prm.beta=<beta>``."""
    settings = {
        "task": spec.key(),
        "samples_per_prompt": samples_per_prompt,
        "beta": beta,
        "epochs": epochs,
        "version": PRM_VERSION,
    }

    def fit(policy: torch.nn.Module, tokenizer: Any, tmp: Path) -> dict[str, Any]:
        for name, source, seed in (
            ("train", task.train_file, spec.seed),
            ("val", task.val_file, spec.seed + 1),
        ):
            rows = outcome_rows(
                policy, tokenizer, load_rows(source), samples_per_prompt=samples_per_prompt, seed=seed
            )
            write_parquet(rows, tmp / f"{name}_outcomes.parquet")
        overrides = [
            f"model.path={task.model_dir}",
            f"data.train_files={tmp / 'train_outcomes.parquet'}",
            f"data.val_files={tmp / 'val_outcomes.parquet'}",
            "algorithm.loss_type=implicit_prm",
            f"algorithm.beta={beta}",
            f"trainer.total_epochs={epochs}",
            "trainer.logger=[]",
            "trainer.resume_mode=disable",
            f"trainer.default_local_dir={tmp / 'run'}",
        ]
        summary = DPOTrainer(load_config(None, overrides, schema=DPOConfig), log=lambda _: None).fit()
        shutil.move(summary["checkpoint"] + "/actor", tmp / "model")
        shutil.rmtree(tmp / "run")
        return {"held_out_before": summary.get("before", {}), "held_out_after": summary.get("after", {})}

    return _cached_prm(
        spec, task, cache_dir, "implicit-prm", "implicit PRM", settings, fit, fresh=fresh, log=log
    )


if __name__ == "__main__":
    spec = TaskSpec(name="chain_addition")
    print(prepare_prm(spec, prepare_task(spec)).model_dir)
