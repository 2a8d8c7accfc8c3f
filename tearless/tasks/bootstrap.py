"""Make the embedded default task: its settings and cache key, its data, a tiny Llama-style model and
the flawed teacher's demonstrations. The warm-up that trains the model on them, and the cached build
of the whole task, are the trainers' (:mod:`tearless.trainers.warmup`): tasks only make data.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tearless.tasks import arithmetic

VERSION = 2  # bump when the generator, model recipe or warm-up changes, so stale caches are rebuilt


@dataclass(frozen=True)
class TaskSpec:
    """What determines the embedded task's files (and so its cache key)."""

    name: str = "arithmetic"
    num_train: int = 2000
    num_val: int = 200
    warmup_steps: int = 300
    forget_carry: float = 0.7
    seed: int = 1
    hidden_size: int = 128
    num_layers: int = 2

    @classmethod
    def from_config(cls, task: Any, **fields: Any) -> TaskSpec:
        """The spec of a trainer's ``task`` config section (``fields`` adds or overrides fields)."""
        common = ("name", "num_train", "num_val", "warmup_steps", "forget_carry")
        return cls(**{name: getattr(task, name) for name in common}, **fields)

    def key(self) -> str:
        blob = json.dumps({**asdict(self), "version": VERSION}, sort_keys=True)
        return f"{self.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class TaskFiles:
    model_dir: str
    train_file: str
    val_file: str
    info: dict
    tool_config_path: str | None = None  # the task's tool YAML (multi-turn tasks)


def tiny_llama(
    vocab_size: int,
    *,
    hidden_size: int,
    num_layers: int,
    pad_token_id: int,
    eos_token_id: int,
    bos_token_id: int,
    seed: int,
    max_position_embeddings: int = 128,
) -> torch.nn.Module:
    """A randomly initialised Llama-style causal LM (4 heads, SwiGLU 3×, tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def tokenizer_llama(
    tokenizer: Any, *, hidden_size: int, num_layers: int, seed: int, max_position_embeddings: int = 128
) -> torch.nn.Module:
    """:func:`tiny_llama` sized for ``tokenizer``: its vocabulary and its pad, EOS and BOS ids."""
    return tiny_llama(
        len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        seed=seed,
        max_position_embeddings=max_position_embeddings,
    )


def task_model(spec: TaskSpec, tokenizer: Any, *, max_position_embeddings: int = 128) -> torch.nn.Module:
    """The task's tiny Llama for ``tokenizer``, freshly initialised (the warm-up's starting point)."""
    return tokenizer_llama(
        tokenizer,
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        seed=spec.seed,
        max_position_embeddings=max_position_embeddings,
    )


def task_rows(spec: TaskSpec) -> tuple[list[dict], list[dict]]:
    """The task's training and held-out prompt rows (veRL schema); no problem is in both."""
    val_rows = arithmetic.generate_rows(spec.num_val, seed=spec.seed * 1000 + 1, split="test")
    held_out = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in val_rows}
    train_rows = arithmetic.generate_rows(
        spec.num_train, seed=spec.seed * 1000 + 2, split="train", exclude=held_out
    )
    return train_rows, val_rows


def arithmetic_teacher(row: dict, rng: random.Random, forget_carry: float) -> str:
    """The arithmetic task's flawed teacher (:func:`~tearless.tasks.arithmetic.flawed_teacher`) for a row."""
    return arithmetic.flawed_teacher(row["extra_info"]["a"], row["extra_info"]["b"], rng, forget_carry)


def warmup_demos(
    rows: list[dict],
    *,
    num: int,
    seed: int,
    forget_carry: float,
    teacher: Callable[[dict, random.Random, float], str] = arithmetic_teacher,
) -> list[dict]:
    """``num`` SFT rows: the prompt rows with a ``response`` from the flawed ``teacher``.

    The prompts are visited in passes, each in a fresh random order, and every visit draws a fresh
    demonstration, so a prompt seen 20 times has about ``forget_carry`` of its carries dropped.
    """
    rng = random.Random(seed)
    demos: list[dict] = []
    while len(demos) < num:
        for row in rng.sample(rows, len(rows))[: num - len(demos)]:
            demos.append({**row, "response": teacher(row, rng, forget_carry)})
    return demos
