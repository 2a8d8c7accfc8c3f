"""The GPU check's real-scale tier (issue 41): the update and the decode loop at the sizes people train.

    python benchmarks/gpu_check.py --tier real                 # on a GPU: Qwen2.5-0.5B and 1.5B shapes
    python benchmarks/gpu_check.py --tier real --dry-run       # the same code on CPU, tiny shapes (CI)

Models are built from the architecture with random weights (the GPU machine has no network; speed and
memory are those of the real weights). For each shape:

- ``update_<shape>``: the trainer's actor update (the in-process worker group a training step uses,
  with the device's defaults: packed forwards, token-budgeted micro-batches, bf16 on CUDA) of
  ``sequences`` rows of a ``prompt``-token prompt and a ``response``-token response; seconds per
  update (median of the timed ones after a warm-up), tokens/s, model FLOPs utilisation and peak memory
  beside the start-up estimate (:mod:`tearless.models.memory`). The micro-batch token budget is the
  largest power of two ≤ 16,384 whose estimate fits 85% of the card.
- ``update_<shape>_compiled``: the same with ``actor.use_torch_compile=true`` (the decoder layers
  compiled; the warm-up update holds the compile: ``first_update_extra_s`` is its time beyond a
  timed update); ``update_<shape>_copies``: with ``fsdp_config.compute_copies=true`` (bf16 copies of
  the float32 masters, cast once per optimizer step, instead of autocast's casts at every forward).
- ``decode_<shape>``: the built-in engine's static decode loop with CUDA graphs, ``sequences`` prompts
  × ``response`` new tokens: tokens/s, its share of the memory-bandwidth limit, and HF ``generate``
  over the same prompts (what TRL samples with when it has no vLLM).

The fit tier (``gpu_check.py --tier fit``, :data:`FITS`): the largest models per card, 1.5B full and 7B
LoRA (with and without compute copies), activation checkpointing on, 2 training steps each (the
engine's rollout, then the update): the peak of each phase and the bytes the model holds beside the
start-up estimate (:func:`fit`).

MFU counts the model's matmul FLOPs of the forward and backward (:func:`update_flops`) over the card's
dense bf16 peak (:data:`CARDS`). The decode limit is the bytes one step must read (bf16 weights and the
bf16 KV cache of every sequence) over the card's HBM bandwidth (:func:`decode_limit`).
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
from unittest import mock

import torch

# Qwen2.5's architectures (config.json of Qwen/Qwen2.5-0.5B, -1.5B and -7B), and a tiny one for dry runs.
SHAPES: dict[str, dict] = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "dry": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=1024, tie_word_embeddings=True),
}  # fmt: skip

# Dense bf16 tensor-core peak (FLOP/s, no sparsity) and HBM bandwidth (B/s) by device name, from
# NVIDIA's data sheets; the first name contained in torch.cuda.get_device_name() wins.
CARDS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),  # SXM (HBM3)
)


def card_peaks(name: str) -> tuple[float, float] | None:
    """(bf16 FLOP/s, HBM B/s) of the card called ``name``, or None for one not in :data:`CARDS`."""
    for key, flops, bandwidth in CARDS:
        if key in name:
            return flops, bandwidth
    return None


def qwen2(shape: str, device: str) -> torch.nn.Module:
    """A randomly initialised Qwen2 causal LM of ``shape``, float32 master weights on ``device``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **SHAPES[shape], max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config)


ARR = "actor_rollout_ref"


def update_flops(config, prompt: int, response: int, sequences: int) -> float:
    r"""Matmul FLOPs of one update's forward and backward (3× the forward's):

    .. math:: 6\,(N - Vh)\,T + 6\,Vh\,T_r + 6\,L\,h_q \sum_i s_i^2

    N parameters (the embedding table counted once, as the tied LM head's matmul), T = sequences ×
    s tokens forwarded (s = prompt + response − 1: a response's last token is only a target), T_r =
    sequences × response positions through the LM head, and causal attention's QKᵀ and PV (2·s²·h_q
    per layer in the forward, half of the square skipped)."""
    from tearless.models.memory import ModelShape

    shape = ModelShape.from_config(config)
    s = prompt + response - 1
    head = shape.vocab * shape.hidden
    q_width = shape.heads * (shape.head_dim or shape.hidden // shape.heads)
    dense = 6 * (shape.parameters - head) * sequences * s + 6 * head * sequences * response
    return float(dense + 6 * shape.layers * q_width * sequences * s * s)


def decode_limit(config, prompt: int, response: int, sequences: int, bandwidth: float) -> float:
    """Tokens/s at the bandwidth limit: each step reads the bf16 weights (2N bytes) and every
    sequence's bf16 keys and values so far (2·L·k·2 bytes per cached token, on average prompt +
    response/2 of them), and makes ``sequences`` tokens."""
    from tearless.models.memory import ModelShape

    shape = ModelShape.from_config(config)
    kv = 2 * shape.layers * shape.kv_width * 2 * sequences * (prompt + response / 2)
    return sequences * bandwidth / (2 * shape.parameters + kv)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _batch(vocab: int, prompt: int, response: int, sequences: int, n: int):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(4)
    return TensorDict(
        {
            "prompt_ids": torch.randint(3, vocab, (sequences, prompt), generator=g),
            "prompt_mask": torch.ones(sequences, prompt, dtype=torch.long),
            "response_ids": torch.randint(3, vocab, (sequences, response), generator=g),
            "response_mask": torch.ones(sequences, response, dtype=torch.long),
            "old_log_prob": torch.zeros(sequences, response),
            "advantages": torch.randn(sequences, 1, generator=g).expand(sequences, response).clone(),
            "uid_index": torch.arange(sequences // n).repeat_interleave(n),
        },
        batch_size=[sequences],
    )


# The update's variants beside the device defaults (``update_<shape><suffix>``): the decoder layers
# compiled (packed: the CPU dry run's default pass would carry a KV cache, which runs eager), and bf16
# compute copies of the float32 masters instead of autocast.
VARIANTS: dict[str, tuple[str, ...]] = {
    "": (),
    "_compiled": (f"{ARR}.actor.use_torch_compile=true", f"{ARR}.model.use_remove_padding=true"),
    "_copies": (f"{ARR}.actor.fsdp_config.compute_copies=true",),
}


def _workers(task, model: torch.nn.Module, device: str, keys: list[str], prompt: int, response: int):
    """The in-process worker group training ``model`` as the actor under the config ``keys``, the
    micro-batch token budget the largest power of two ≤ 16,384 whose start-up estimate fits 85% of
    the card; (workers, that estimate, the budget)."""
    from tearless.config import load_config
    from tearless.config.memory import run_estimate
    from tearless.models.loading import load_tokenizer
    from tearless.workers.placement import make_workers
    from tearless.workers.spec import RankSpec

    total = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else None
    budget = 16384 if device == "cuda" else 2 * (prompt + response)
    while True:
        cfg = load_config(
            None, [*keys, f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}"], device=device,
            notify=lambda _: None,
        )  # fmt: skip
        est = run_estimate(cfg, model.config, device)
        if total is None or est.peak <= 0.85 * total or budget <= prompt + response:
            break
        budget //= 2
    spec = RankSpec(cfg, ("actor",), False, str(task.model_dir), 10**6, device, models={"actor": model})
    return make_workers(spec, load_tokenizer(task.model_dir).pad_token_id), est, budget


def _keys(sequences: int, n: int, prompt: int, response: int) -> list[str]:
    return [
        f"data.max_prompt_length={prompt}", f"data.max_response_length={response}",
        f"data.train_batch_size={sequences // n}", f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={sequences // n}",
        "actor_rollout_ref.actor.use_kl_loss=false", "trainer.keep_freed_memory=false",
        "actor_rollout_ref.actor.optim.lr=1e-6", "reward_model.num_workers=0",
    ]  # fmt: skip


def update(
    task, shape: str, device: str, sequences: int, prompt: int, response: int, repeats: int,
    variant: str = "",
) -> dict:  # fmt: skip
    """The ``update_<shape><variant>`` check's numbers (see the module docstring; :data:`VARIANTS`)."""
    from tearless.models.memory import GIB

    n = 8
    model = qwen2(shape, device)
    workers, est, budget = _workers(
        task, model, device, [*_keys(sequences, n, prompt, response), *VARIANTS[variant]], prompt, response
    )
    td = _batch(model.config.vocab_size, prompt, response, sequences, n)
    times = []
    try:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(repeats + 1):  # the first allocates AdamW's moments and warms the kernels up
            _sync(device)
            start = time.perf_counter()
            metrics = workers.update_policy(td.clone())
            _sync(device)
            times.append(time.perf_counter() - start)
    finally:
        workers.close()
    seconds = statistics.median(times[1:])
    warmup_extra = times[0] - seconds
    flops = update_flops(model.config, prompt, response, sequences)
    peaks = card_peaks(torch.cuda.get_device_name(0)) if device == "cuda" else None
    peak = torch.cuda.max_memory_allocated() / GIB if device == "cuda" else float("nan")
    return {
        "s_per_update": round(seconds, 3),
        "tokens_per_s": round(sequences * (prompt + response) / seconds),
        "tflops_per_s": round(flops / seconds / 1e12, 1),
        "mfu": None if peaks is None else round(flops / seconds / peaks[0], 3),
        "budget_tokens": budget,
        "first_update_extra_s": round(warmup_extra, 1),
        "peak_gib": round(peak, 2),
        "estimate_gib": round(est.peak / GIB, 2),
        "finite": math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"]),
    }


# The largest models per card (``fit_<name>``): (shape, LoRA rank (0: full fine-tuning), extra keys).
# Activation checkpointing on in each; the 7B LoRA model once with the device defaults (autocast over
# its float32 base) and once with compute copies (its frozen base held in bf16).
FITS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "1.5b": ("1.5b", 0, ()),
    "7b_lora": ("7b", 32, ()),
    "7b_lora_copies": ("7b", 32, (f"{ARR}.actor.fsdp_config.compute_copies=true",)),
}


def fit(task, name: str, device: str, sequences: int, prompt: int, response: int, steps: int = 2) -> dict:
    """The ``fit_<name>`` check (:data:`FITS`; ``dry`` shapes on CPU): ``steps`` training steps of the
    model, each the built-in engine sampling ``sequences`` responses of ``response`` tokens (as the
    hybrid rank samples: from the model's compute copies when it has them, in bf16 on CUDA) then the
    actor's update over them; peak memory of each phase beside the start-up estimate's parts."""
    from tearless.models import precision

    shape, rank, extra = FITS[name]
    # LoRA needs peft (and peft accelerate), which the GPU machine has only if carried: say so before
    # a 7B model is built for nothing
    missing = [m for m in ("peft", "accelerate") if rank and importlib.util.find_spec(m) is None]
    if missing:
        why = f"LoRA needs {' and '.join(missing)}: carry their wheels (docs/development.md)"
        return {"finite": False, "why": why}
    if device == "cpu" and extra:  # the dry run computes in bf16 too (emulated here: tiny shapes only)
        with mock.patch.object(precision, "cpu_has_native_bf16", return_value=True):
            keys = (*extra, f"{ARR}.actor.fsdp_config.param_dtype=bfloat16")
            return _fit(task, "dry", rank, keys, device, sequences, prompt, response, steps)
    return _fit(
        task, shape if device == "cuda" else "dry", rank, extra, device, sequences, prompt, response, steps
    )


def _fit(
    task, shape: str, rank: int, extra: tuple[str, ...], device: str, sequences: int, prompt: int,
    response: int, steps: int,
) -> dict:  # fmt: skip
    from tearless.models.copies import copies_for
    from tearless.models.loading import enable_activation_checkpointing
    from tearless.models.lora import add_lora
    from tearless.models.memory import GIB
    from tearless.rollout.hf import HFRollout

    cuda, n = device == "cuda", 8
    model = qwen2(shape, device)
    if rank:
        model = add_lora(
            model, rank=rank, alpha=2 * rank, target_modules="all-linear", gradient_checkpointing=True
        )
    else:
        enable_activation_checkpointing(model)
    keys = [*_keys(sequences, n, prompt, response), f"{ARR}.model.enable_gradient_checkpointing=true"]
    keys += [f"{ARR}.model.lora_rank={rank}", f"{ARR}.model.lora_alpha={2 * rank}"] if rank else []
    workers, est, budget = _workers(task, model, device, [*keys, *extra], prompt, response)
    engine = HFRollout(
        model, eos_token_ids=[2], pad_token_id=0, compute_dtype=torch.bfloat16 if cuda else None
    )
    g = torch.Generator().manual_seed(6)
    prompts = [
        torch.randint(3, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(sequences)
    ]
    copies = getattr(model, "tearless_copies", None)
    tensors = {id(t): t for t in [*model.parameters(), *(c for *_, c in (copies.slots if copies else ()))]}
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    phases: dict[str, float] = {"rollout": 0.0, "update": 0.0}
    start, finite = time.perf_counter(), True
    try:
        for _ in range(steps):
            for phase in phases:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                if phase == "rollout":
                    with copies_for(model, torch.bfloat16 if cuda else None):
                        engine.generate(prompts, n=1, max_new_tokens=response, keys=list(range(sequences)))
                else:
                    metrics = workers.update_policy(
                        _batch(model.config.vocab_size, prompt, response, sequences, n)
                    )
                    finite = finite and math.isfinite(metrics["actor/grad_norm"])
                _sync(device)
                peak = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
                phases[phase] = max(phases[phase], peak)
    finally:
        workers.close()
    seconds = time.perf_counter() - start
    top = max(phases.values())
    return {
        "s_per_step": round(seconds / steps, 2),
        "parameters_gib": round(held / GIB, 2),
        "parameters_over_estimate": round(held / est.parameters, 4),
        "rollout_peak_gib": round(phases["rollout"], 2) if cuda else None,
        "update_peak_gib": round(phases["update"], 2) if cuda else None,
        "estimate_gib": round(est.peak / GIB, 2),
        "estimate_over_peak": round(est.peak / GIB / top, 3) if cuda else None,
        "budget_tokens": budget,
        "finite": finite,
    }


def decode(shape: str, device: str, sequences: int, prompt: int, response: int) -> dict:
    """The ``decode_<shape>`` check's numbers (see the module docstring)."""
    from tearless.models.memory import GIB
    from tearless.rollout.hf import HFRollout

    cuda = device == "cuda"
    model = qwen2(shape, device).eval()
    g = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(3, model.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(sequences)
    ]
    engine = HFRollout(
        model, eos_token_ids=[2], pad_token_id=0, compute_dtype=torch.bfloat16 if cuda else None
    )
    engine.generate(prompts[:4], n=1, max_new_tokens=4, keys=list(range(4)))  # warm-up, graph capture
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    start = time.perf_counter()
    out = engine.generate(prompts, n=1, max_new_tokens=response, keys=list(range(sequences)))
    _sync(device)
    ours = float(out.response_mask.sum()) / (time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else float("nan")
    # HF generate, as TRL calls it without vLLM: bf16 autocast on the GPU, left-padded batch.
    ids = torch.tensor(prompts, device=device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda), torch.no_grad():
        model.generate(ids[:4], attention_mask=torch.ones_like(ids[:4]), max_new_tokens=4, do_sample=True)
        _sync(device)
        start = time.perf_counter()
        hf = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=response, do_sample=True, pad_token_id=0
        )
        _sync(device)
    hf_rate = (hf.shape[1] - prompt) * sequences / (time.perf_counter() - start)
    peaks = card_peaks(torch.cuda.get_device_name(0)) if cuda else None
    limit = None if peaks is None else decode_limit(model.config, prompt, response, sequences, peaks[1])
    return {
        "tok_s": round(ours),
        "hf_generate_tok_s": round(hf_rate),
        "vs_hf_generate": round(ours / hf_rate, 2),
        "bandwidth_limit_tok_s": None if limit is None else round(limit),
        "share_of_limit": None if limit is None else round(ours / limit, 3),
        "peak_gib": round(peak, 2),
    }
