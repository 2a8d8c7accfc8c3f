"""The two performance cases shared by ``vs_trl.py`` and ``ceiling.py``: model files, data, settings.

- small: a Llama-style model, hidden 256, 4 layers, the embedded arithmetic task (warmed up by the
  task's own 300-step recipe), 8 prompts × 8 generations, up to 16 new tokens, no reference model.
- medium: hidden 512, 8 layers, :mod:`tearless.tasks.long_addition` (answers of 37–51 tokens),
  16 prompts × 8 generations, up to 64 new tokens, a reference model and a k3 KL loss (β = 0.04).
  Its warm-up is a short supervised pass on correct worked answers (``MEDIUM_WARMUP_STEPS``
  steps of 32; about 30 minutes on the shared 2-core machine): it learns the shape of the answer but
  not the sums (greedy accuracy 0), so the task's graded similarity reward is what differs within
  groups. The medium case measures speed and memory; its accuracy comparison is weak by design.

Files are built once under ``$TEARLESS_CACHE`` (or ``~/.cache/tearless``) and reused.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tearless.models.loading import quiet_transformers

MEDIUM_WARMUP_STEPS = 60


@dataclass(frozen=True)
class Case:
    name: str
    model_dir: str
    train_file: str
    val_file: str
    data_source: str
    prompts_per_step: int
    n: int
    max_new_tokens: int
    lr: float
    beta: float  # KL coefficient (0: no reference model)


def small_case(cache: Path | None = None) -> Case:
    from tearless.tasks.bootstrap import TaskSpec, prepare_task

    files = prepare_task(TaskSpec(hidden_size=256, num_layers=4), cache)
    return Case("small", files.model_dir, files.train_file, files.val_file, "arithmetic", 8, 8, 16, 1e-4, 0.0)


def medium_case(cache: Path | None = None) -> Case:
    from tearless.tasks.bootstrap import default_cache_dir

    root = (cache or default_cache_dir()) / f"bench-long-addition-512x8-w{MEDIUM_WARMUP_STEPS}"
    if not (root / "done.json").is_file():
        build_medium(root)
    return Case(
        "medium",
        str(root / "model"),
        str(root / "train.parquet"),
        str(root / "test.parquet"),
        "long_addition",
        16,
        8,
        64,
        5e-5,
        0.04,
    )


def build_medium(root: Path, *, seed: int = 1) -> None:
    """Data, a fresh 512×8 Llama and its short supervised warm-up, written under ``root``."""
    from tearless.config.sft import OfflineOptimConfig
    from tearless.data import PromptLoader, write_parquet
    from tearless.data.sft import SFTDataset
    from tearless.tasks import long_addition
    from tearless.tasks.bootstrap import tokenizer_llama
    from tearless.tasks.tokenizer import build_char_tokenizer
    from tearless.trainers.offline import make_optimizer
    from tearless.trainers.sft import collate_fn, sft_step

    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    val = long_addition.generate_rows(200, seed=seed * 1000 + 1, split="test")
    held = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in val}
    train = long_addition.generate_rows(4000, seed=seed * 1000 + 2, split="train", exclude=held)
    write_parquet(train, root / "train.parquet")
    write_parquet(val, root / "test.parquet")
    tok = build_char_tokenizer()
    model = tokenizer_llama(tok, hidden_size=512, num_layers=8, seed=seed)
    demos = [
        {**r, "response": long_addition.worked_answer(r["extra_info"]["a"], r["extra_info"]["b"])}
        for r in train
    ]
    batch = 32
    loader = PromptLoader(SFTDataset(demos, tok), batch, shuffle=True, seed=seed)
    opt, sched = make_optimizer(model, OfflineOptimConfig(lr=1e-3), MEDIUM_WARMUP_STEPS)
    collate = collate_fn(pad_token_id=tok.pad_token_id)
    losses = []
    for i in range(MEDIUM_WARMUP_STEPS):
        losses.append(sft_step(model, loader.batch(0, i), opt, sched, collate=collate)["train/loss"])
        print(f"medium warm-up step {i + 1}/{MEDIUM_WARMUP_STEPS}: loss {losses[-1]:.3f}", flush=True)
    with quiet_transformers():
        model.save_pretrained(root / "model")
        tok.save_pretrained(root / "model")
    info = {"final_loss": losses[-1], "seconds": round(time.perf_counter() - start, 1)}
    (root / "done.json").write_text(json.dumps(info))


def make_case(name: str, cache: Path | None = None) -> Case:
    return {"small": small_case, "medium": medium_case}[name](cache)


def load_prompts(case: Case, tokenizer, split: str = "train") -> list[dict]:
    """Rows of the case's parquet file with their rendered prompt ids (``input_ids``)."""
    from tearless.data import load_many, render_prompt

    rows = load_many(case.train_file if split == "train" else case.val_file)
    return [{**r, "input_ids": render_prompt(tokenizer, r["prompt"])} for r in rows]


def threads(n: int) -> None:
    torch.set_num_threads(n)
