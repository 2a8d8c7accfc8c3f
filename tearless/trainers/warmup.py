"""The warm-ups that train the embedded tasks' tiny models, and the cached build of a task.

The tasks (:mod:`tearless.tasks`) make the data, the tokenizer and the untrained model; here the model
is warmed up by supervised steps on a flawed teacher's demonstrations (the SFT trainer's step and
default optimizer), and :func:`prepare_task` writes everything into a cache directory keyed by the
task's settings, built under a temporary name and renamed when complete, so a second run reuses it
and an interrupted build is never picked up.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tearless.cachedir import build_dir, cached_build
from tearless.config.sft import OfflineOptimConfig
from tearless.data import PromptLoader, write_parquet
from tearless.data.prompts import PromptDataset, render_prompt
from tearless.data.sft import SFTDataset
from tearless.models.loading import quiet_transformers
from tearless.models.vision import stack_pixels
from tearless.rollout.agent import AgentSettings, SearchR1Format
from tearless.tasks import chain_addition, multihop, vlm_count
from tearless.tasks.bootstrap import (
    VERSION,
    TaskFiles,
    TaskSpec,
    arithmetic_teacher,
    task_model,
    task_rows,
    warmup_demos,
)
from tearless.tasks.tokenizer import build_char_tokenizer
from tearless.tools.search import SearchTool
from tearless.trainers.offline import make_optimizer
from tearless.trainers.sft import collate_fn, sft_step


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
    final = build_dir(cache_dir, spec.key())

    def build(tmp: Path) -> dict:
        log(f"building the embedded '{spec.name}' task in {final} (cached for later runs)")
        start = time.perf_counter()
        if spec.name == "multihop":
            built = build_multihop(spec, tmp)
        elif spec.name == "vlm_count":
            built = build_vision_task(spec, tmp, log=log)
        elif spec.name == "chain_addition":
            built = build_warmed_task(spec, tmp, chain_addition.task_rows(spec), chain_addition.teacher)
        else:
            built = build_warmed_task(spec, tmp, task_rows(spec), log=log)
        info = {
            "spec": asdict(spec),
            "version": VERSION,
            **built,
            "build_seconds": round(time.perf_counter() - start, 1),
        }
        log(f"warm-up done in {info['build_seconds']} s (final loss {info['warmup_final_loss']:.3f})")
        return info

    info = cached_build(final, "task.json", build, fresh=fresh)
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


def build_multihop(spec: Any, out: Path) -> dict:
    """Write the task into ``out``: train/test parquet, ``corpus.jsonl``, ``tools.yaml`` and the
    warmed-up ``model`` directory; return the warm-up's summary for ``task.json``."""
    kb = multihop.make_kb(spec.seed, (max(spec.num_train // 2, 2), max(spec.num_val // 2, 2)))
    train_rows, val_rows = multihop.rows_for(kb, 0, "train"), multihop.rows_for(kb, 1, "test")
    write_parquet(train_rows, out / "train.parquet")
    write_parquet(val_rows, out / "test.parquet")
    corpus = [multihop.passage(kb, name) for name in kb["people"]]
    (out / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in corpus))
    (out / "tools.yaml").write_text(multihop.tools_yaml())
    (out / "kb.json").write_text(json.dumps(kb))

    tok = build_char_tokenizer(extra_tokens=multihop.TAGS)
    tool = SearchTool(
        str(out / "corpus.jsonl"), topk=multihop.TOPK, max_passage_chars=multihop.MAX_PASSAGE_CHARS
    )
    fmt = SearchR1Format({"search": tool}, tok, AgentSettings())
    model = task_model(spec, tok, max_position_embeddings=256)
    prompts = {i: render_prompt(tok, r["prompt"]) for i, r in enumerate(train_rows)}
    losses = multihop_warmup(
        model, tok, train_rows, prompts, kb, fmt, tool, steps=spec.warmup_steps, seed=spec.seed
    )
    with quiet_transformers():
        model.save_pretrained(out / "model")
        tok.save_pretrained(out / "model")
    return {"warmup_final_loss": sum(losses[-20:]) / len(losses[-20:]), "num_people": len(kb["people"])}


def multihop_warmup(
    model: torch.nn.Module,
    tok: Any,
    rows: list[dict],
    prompts: dict[int, list[int]],
    kb: dict,
    fmt: Any,
    tool: Any,
    *,
    steps: int,
    seed: int,
    batch_size: int = 64,
    lr: float = 3e-3,
) -> list[float]:
    """``steps`` SFT steps on fresh teacher trajectories (loss on model tokens only), two-hop questions
    ``multihop.TWO_HOP_SHARE`` of the time; return the losses."""
    rng = random.Random(seed)
    one_hop = [i for i, r in enumerate(rows) if r["extra_info"]["hops"] == 1]
    two_hop = [i for i, r in enumerate(rows) if r["extra_info"]["hops"] == 2]
    optim = OfflineOptimConfig(lr=lr)
    opt, sched = make_optimizer(model, optim, steps)
    collate = collate_fn(pad_token_id=tok.pad_token_id)
    losses = []
    for _ in range(steps):
        batch = []
        for _ in range(batch_size):
            i = rng.choice(two_hop if rng.random() < multihop.TWO_HOP_SHARE else one_hop)
            info = rows[i]["extra_info"]
            segments = multihop.teacher_segments(kb, info["person"], info["hops"], rng)
            batch.append(multihop.demo_tokens(segments, prompts[i], fmt, tool))
        metrics = sft_step(model, batch, opt, sched, collate=collate, clip_grad=optim.clip_grad)
        losses.append(metrics["train/loss"])
    return losses


def build_vision_task(spec: Any, out: Path, log: Callable[[str], None] | None = None) -> dict:
    """Write the visual counting task (:mod:`tearless.tasks.vlm_count`) into ``out``: its train/test
    parquet (veRL's multimodal rows) and its tiny Idefics3 with its processor, warmed up on the flawed
    teacher's counts; return the warm-up's summary."""
    train_rows, val_rows = vlm_count.task_rows(spec)
    write_parquet(train_rows, out / "train.parquet")
    write_parquet(val_rows, out / "test.parquet")
    tok = vlm_count.task_tokenizer()
    processor = vlm_count.task_processor(tok)
    model = vlm_count.task_model(tok, num_layers=spec.num_layers, seed=spec.seed)
    prompts = PromptDataset(train_rows, tok, processor=processor, source="the vlm_count task")
    losses = vision_warmup(
        model, tok, prompts, steps=spec.warmup_steps, seed=spec.seed, forget=spec.forget_carry, log=log
    )
    with quiet_transformers():
        model.save_pretrained(out / "model")
        processor.save_pretrained(out / "model")
    return {"warmup_final_loss": sum(losses[-20:]) / len(losses[-20:])}


def vision_warmup(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: PromptDataset,
    *,
    steps: int,
    seed: int,
    forget: float,
    batch_size: int = 64,
    lr: float = 3e-3,
    log: Callable[[str], None] | None = None,
) -> list[float]:
    """``steps`` supervised steps of a vision-language model on the flawed teacher's answers
    (:func:`~tearless.tasks.vlm_count.flawed_teacher`, a fresh draw per visit) to random batches of
    ``prompts`` (items with ``multi_modal_inputs``): the mean cross-entropy of the answer and its
    end-of-turn token given image and prompt (rows right-padded), with the offline trainers' default
    optimizer; returns the per-step losses."""
    rng = random.Random(seed)
    optim = OfflineOptimConfig(lr=lr)
    opt, sched = make_optimizer(model, optim, steps)
    model.train()
    losses = []
    for i in range(steps):
        items = [prompts[j] for j in rng.sample(range(len(prompts)), min(batch_size, len(prompts)))]
        seqs = []
        for item in items:
            answer = [*tokenizer.encode(vlm_count.flawed_teacher(item, rng, forget)), tokenizer.eos_token_id]
            seqs.append((item["input_ids"], answer))
        width = max(len(p) + len(a) for p, a in seqs)
        ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full((len(seqs), width), -100, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for r, (p, a) in enumerate(seqs):
            ids[r, : len(p) + len(a)] = torch.tensor(p + a)
            labels[r, len(p) : len(p) + len(a)] = torch.tensor(a)
            mask[r, : len(p) + len(a)] = 1
        pixels = stack_pixels([item["multi_modal_inputs"] for item in items])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, **pixels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), optim.clip_grad)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log is not None and ((i + 1) % max(1, steps // 10) == 0 or i + 1 == steps):
            log(f"  warm-up step {i + 1}/{steps}: loss {losses[-1]:.3f}")
    return losses
