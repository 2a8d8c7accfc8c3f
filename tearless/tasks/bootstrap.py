"""Make the embedded default task: its data, a tiny Llama-style model and its supervised warm-up.

Everything lands in a cache directory keyed by the task's settings, built under a temporary name
and renamed when complete, so a second run reuses it and an interrupted build is never picked up.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tearless.models.loading import quiet_transformers
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


def default_cache_dir() -> Path:
    """``$TEARLESS_CACHE``, else ``$XDG_CACHE_HOME/tearless``, else ``~/.cache/tearless``."""
    if os.environ.get("TEARLESS_CACHE"):
        return Path(os.environ["TEARLESS_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg and Path(xdg).expanduser().is_absolute() else Path.home() / ".cache"
    return base / "tearless"


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


def supervised_warmup(
    model: torch.nn.Module,
    tokenizer,
    rows: list[dict],
    *,
    steps: int,
    seed: int,
    forget_carry: float,
    batch_size: int = 128,
    lr: float = 3e-3,
    teacher: Callable[[dict, random.Random, float], str] = arithmetic_teacher,
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """Train on ``steps × batch_size`` flawed-teacher demonstrations (loss on assistant tokens only)
    with the SFT trainer's step and default optimizer; return the per-step losses. ``log`` receives a
    progress line about every tenth of the steps (the warm-up takes minutes on a laptop).

    This is exactly one epoch of ``tearless sft`` with no data arguments and the same task settings.
    """
    from tearless.config.sft import OfflineOptimConfig
    from tearless.data import PromptLoader
    from tearless.data.sft import SFTDataset
    from tearless.trainers.offline import make_optimizer
    from tearless.trainers.sft import collate_fn, sft_step

    demos = warmup_demos(rows, num=steps * batch_size, seed=seed, forget_carry=forget_carry, teacher=teacher)
    loader = PromptLoader(SFTDataset(demos, tokenizer), batch_size, shuffle=True, seed=seed)
    optim = OfflineOptimConfig(lr=lr)
    opt, sched = make_optimizer(model, optim, steps)
    collate = collate_fn(pad_token_id=tokenizer.pad_token_id)
    losses = []
    for i in range(steps):
        metrics = sft_step(model, loader.batch(0, i), opt, sched, collate=collate, clip_grad=optim.clip_grad)
        losses.append(metrics["train/loss"])
        every = max(1, steps // 10)
        if log is not None and ((i + 1) % every == 0 or i + 1 == steps):
            log(f"  warm-up step {i + 1}/{steps}: loss {metrics['train/loss']:.3f}")
    return losses


def prepare_task(
    spec: TaskSpec, cache_dir: str | os.PathLike | None = None, *, fresh: bool = False, log=print
) -> TaskFiles:
    """Return the task's files, building them first if the cache does not hold them."""
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    final = root / spec.key()
    if fresh and final.exists():
        shutil.rmtree(final)
    if not (final / "task.json").is_file():
        tmp = root / f".{spec.key()}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        log(f"building the embedded '{spec.name}' task in {final} (cached for later runs)")
        start = time.perf_counter()
        if spec.name == "multihop":
            from tearless.tasks import multihop

            built = multihop.build(spec, tmp)
        elif spec.name == "chain_addition":
            from tearless.tasks import chain_addition

            built = chain_addition.build(spec, tmp)
        else:
            built = build_warmed_task(spec, tmp, task_rows(spec), log=log)
        info = {
            "spec": asdict(spec),
            "version": VERSION,
            **built,
            "build_seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / "task.json").write_text(json.dumps(info, indent=1))
        try:
            os.replace(tmp, final)
        except OSError:  # another process finished the same build first; theirs is as good
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"warm-up done in {info['build_seconds']} s (final loss {info['warmup_final_loss']:.3f})")
    info = json.loads((final / "task.json").read_text())
    tools = final / "tools.yaml"
    return TaskFiles(
        str(final / "model"),
        str(final / "train.parquet"),
        str(final / "test.parquet"),
        info,
        str(tools) if tools.is_file() else None,
    )


def build_warmed_task(
    spec: Any,
    out: Path,
    rows: tuple[list[dict], list[dict]],
    teacher: Callable[[dict, random.Random, float], str] = arithmetic_teacher,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Write a task's (train, val) ``rows`` as parquet and its model, warmed up on ``teacher``'s
    demonstrations, into ``out``; return the warm-up summary (the last 20 steps' mean loss)."""
    from tearless.data import write_parquet
    from tearless.tasks.tokenizer import build_char_tokenizer

    train_rows, val_rows = rows
    write_parquet(train_rows, out / "train.parquet")
    write_parquet(val_rows, out / "test.parquet")
    tok = build_char_tokenizer()
    model = task_model(spec, tok)
    losses = supervised_warmup(
        model,
        tok,
        train_rows,
        steps=spec.warmup_steps,
        seed=spec.seed,
        forget_carry=spec.forget_carry,
        teacher=teacher,
        log=log,
    )
    with quiet_transformers():
        model.save_pretrained(out / "model")
        tok.save_pretrained(out / "model")
    return {"warmup_final_loss": sum(losses[-20:]) / len(losses[-20:])}
