"""``fsdp_config.param_dtype=auto``: float32 or bf16 autocast, chosen by measuring this CPU once.

Whether bf16 autocast pays on a CPU depends on the CPU and on the model: with AMX or AVX-512 BF16 a
large matmul runs ~2.5× faster in bf16, but every autocast region casts its activations and weights,
and a small model's step is cast-bound (issue 23 measured 1.27× at hidden 256 and 1.9× at 1,024 on
an AVX-512 BF16 EPYC, and a Xeon with AMX ran SmolLM2-135M's step slower in bf16: 36.8 against 23–29
CPU-seconds). Without those instructions bf16 is emulated and always slower. So ``auto`` resolves:

- on GPU: bfloat16 (as everywhere in veRL);
- on a CPU without native bf16 (:func:`~tearless.models.precision.cpu_has_native_bf16` false):
  float32, nothing measured;
- on a CPU with it: the faster of the two, timed on the model's own shapes. The probe builds the
  model's architecture (random weights) at two depths, d₁ = 1 and d₂ = 2 decoder layers, and times
  one forward + backward of a packed batch (``PROBE_ROWS`` × ``PROBE_TOKENS`` tokens, the loss a
  mean of float32 log-softmax over the vocabulary, as the trainer computes it) in each dtype; the
  full model's step time is extrapolated linearly in depth,

      t(L) = t(d₁) + (L − d₁) · (t(d₂) − t(d₁)) / (d₂ − d₁),

  so the LM head and the log-softmax over the vocabulary (the bulk of a 135M model's step) count
  once and the decoder layers L times. Each (dtype, depth) is run once to warm up, then ``PROBE_PAIRS``
  times alternating the dtypes; the medians are used. bf16 is chosen when
  t₃₂(L) / t₁₆(L) ≥ :data:`SPEEDUP_TO_SWITCH` (a 10% margin: the probe's own noise on a shared
  machine). The result is cached under ``<cache>/precision/`` by CPU model and flags, torch version,
  thread count and the model's shape, so the probe (seconds) runs once per machine and model shape.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tearless.models.precision import NATIVE_BF16_FLAGS, autocast, cpu_has_native_bf16

SPEEDUP_TO_SWITCH = 1.10
PROBE_ROWS, PROBE_TOKENS, PROBE_PAIRS = 2, 128, 3
PROBE_DEPTHS = (1, 2)
# The config fields that decide a step's cost (a model's shape, not its weights).
SHAPE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "tie_word_embeddings",
)  # fmt: skip


@dataclass(frozen=True)
class PrecisionChoice:
    """The resolved dtype (``"float32"`` or ``"bfloat16"``), why, and the probe's extrapolated
    seconds per probe step (None when nothing was measured)."""

    dtype: str
    reason: str
    float32_s: float | None = None
    bfloat16_s: float | None = None

    def line(self, sections: str) -> str:
        """The one line the trainer prints at start for the config sections (``actor_rollout_ref.actor``,
        …) whose ``fsdp_config.param_dtype`` was ``auto``."""
        return f"precision: fsdp_config.param_dtype=auto -> {self.dtype} for {sections} ({self.reason})"


def cpu_identity() -> dict[str, Any]:
    """What makes one CPU's timings another's: its model name, its bf16 flags, torch's version."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = (*NATIVE_BF16_FLAGS, "avx512f", "avx2")
    return {"cpu": name, "flags": sorted(f for f in flags if f in wanted), "torch": torch.__version__}


def model_shape(config: Any) -> dict[str, Any]:
    """The cost-deciding fields of a transformers config (its ``text_config`` for a multimodal one)."""
    config = getattr(config, "text_config", None) or config
    return {f: getattr(config, f, None) for f in SHAPE_FIELDS}


def choose_cpu_dtype(
    config: Any,
    *,
    cache_dir: str | Path,
    threads: int,
    native: bool | None = None,
    timer: Callable[[Any, torch.dtype], float] | None = None,
) -> PrecisionChoice:
    """Resolve ``param_dtype=auto`` on CPU for a model of transformers config ``config``.

    ``native`` overrides :func:`cpu_has_native_bf16` and ``timer(config, dtype) -> seconds`` the
    probe step (both for tests); ``threads`` is the run's torch thread count (part of the cache key).
    """
    if not (cpu_has_native_bf16() if native is None else native):
        return PrecisionChoice(
            "float32",
            f"this CPU has no native bf16 (no {' or '.join(NATIVE_BF16_FLAGS)} flag): bf16 would be emulated",
        )
    key = {**cpu_identity(), "threads": threads, "shape": model_shape(config)}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir).expanduser() / "precision" / f"{digest}.json"
    try:
        cached = json.loads(path.read_text())
        return PrecisionChoice(
            **{**cached["choice"], "reason": cached["choice"]["reason"] + f"; cached in {path}"}
        )
    except (OSError, ValueError, KeyError, TypeError):
        pass
    # The probe seeds its random model and may draw dropout masks: the run's global RNG streams must
    # come out as they went in (a first run that measures and a later one that reads the cache draw
    # the same numbers), and its model must not outlive the measurement.
    with torch.random.fork_rng(devices=[]):
        try:
            fp32, bf16 = extrapolated_step_seconds(config, timer or probe_step_seconds)
        finally:
            _PROBES.clear()
    speedup = fp32 / bf16
    dtype = "bfloat16" if speedup >= SPEEDUP_TO_SWITCH else "float32"
    choice = PrecisionChoice(
        dtype,
        f"measured on this CPU: fwd+bwd of {PROBE_ROWS}x{PROBE_TOKENS} tokens {fp32:.3g} s in float32, "
        f"{bf16:.3g} s in bf16 autocast ({speedup:.2f}x; bf16 from {SPEEDUP_TO_SWITCH}x)",
        round(fp32, 6),
        round(bf16, 6),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "choice": asdict(choice)}, indent=1, default=str))
    tmp.replace(path)  # atomic: a crash mid-write leaves no half file for the next run to read
    return choice


def extrapolated_step_seconds(config: Any, timer: Callable[[Any, torch.dtype], float]) -> tuple[float, float]:
    """(float32, bf16) seconds of one probe step of the full-depth model, extrapolated from the two
    probe depths (module docstring); the timings alternate the dtypes, medians of :data:`PROBE_PAIRS`."""
    text = getattr(config, "text_config", None) or config
    depth = int(text.num_hidden_layers)
    medians: dict[tuple[torch.dtype, int], float] = {}
    for d in PROBE_DEPTHS:
        probe = _with_depth(config, d)
        runs: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
        for dtype in runs:
            timer(probe, dtype)  # warm-up: allocations, oneDNN kernel selection
        for _ in range(PROBE_PAIRS):
            for dtype in runs:
                runs[dtype].append(timer(probe, dtype))
        for dtype, times in runs.items():
            medians[dtype, d] = statistics.median(times)
    (d1, d2), out = PROBE_DEPTHS, []
    for dtype in (torch.float32, torch.bfloat16):
        per_layer = (medians[dtype, d2] - medians[dtype, d1]) / (d2 - d1)
        out.append(max(medians[dtype, d1] + (depth - d1) * per_layer, 1e-9))
    return out[0], out[1]


def _with_depth(config: Any, depth: int) -> Any:
    probe = config.__class__.from_dict(config.to_dict())
    text = getattr(probe, "text_config", None) or probe
    text.num_hidden_layers = depth
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types)[:depth]
    return probe


def probe_step_seconds(config: Any, dtype: torch.dtype) -> float:
    """Seconds of one forward + backward of a random-weight model of ``config`` on
    ``PROBE_ROWS × PROBE_TOKENS`` random tokens, computing in ``dtype`` (autocast for bf16); the model
    is built once per config and kept for the next call (:func:`choose_cpu_dtype` drops it when done)."""
    from transformers import AutoModelForCausalLM  # heavy; only a native-bf16 CPU gets here

    key = config.to_json_string()
    model = _PROBES.get(key)
    if model is None:
        _PROBES.clear()  # one probe model at a time: memory stays one model's
        torch.manual_seed(0)
        model = _PROBES[key] = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    text = getattr(config, "text_config", None) or config
    ids = torch.randint(
        0, text.vocab_size, (PROBE_ROWS, PROBE_TOKENS), generator=torch.Generator().manual_seed(0)
    )
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with autocast("cpu", dtype):
        logits = model(input_ids=ids).logits
    loss = -logits.float().log_softmax(-1).mean()
    loss.backward()
    return time.perf_counter() - start


_PROBES: dict[str, torch.nn.Module] = {}
