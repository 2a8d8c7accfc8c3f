"""Mixed precision: bf16 compute under ``torch.autocast`` (or FSDP2's policy), float32 everything else.

``fsdp_config.param_dtype`` (veRL's ``fsdp_config.mixed_precision.param_dtype``) is the dtype the
matmuls of a role's forward and backward run in; unset, it is bfloat16 on GPU and float32 on CPU.
Sharded GPU models (Ray placement, world > 1) get it from FSDP2's ``MixedPrecisionPolicy``; a model
of one GPU process runs under ``torch.autocast("cuda", dtype=torch.bfloat16)``, and TF32 is on for
what stays float32 (:func:`configure_cuda`). On CPU, a role whose ``param_dtype`` is ``bfloat16``
runs its forwards under ``torch.autocast("cpu", dtype=torch.bfloat16)``: linear layers, matmuls and
SDPA cast their inputs to bf16 (products rounded to 8 significant bits, unit roundoff u = 2⁻⁸,
accumulated in float32 inside the kernel); everything else stays float32:

- the parameters (master weights) and AdamW's moments are float32, and so are the gradients
  (autocast's casts are differentiable: the bf16 gradient of a cast weight flows back into the float32
  parameter);
- the logits are upcast before log-softmax, log-sum-exp and entropy (``.float()`` in
  :mod:`tearless.models.logprobs`; the chunked path computes each chunk's z = h Wᵀ in bf16 and the rest
  in float32), and the losses are computed from those float32 log-probs outside autocast.

A model of one process can instead hold its weights in bf16 (``fsdp_config.compute_copies``,
:mod:`tearless.models.copies`): bf16 copies of the float32 masters cast once per optimizer step, no
autocast.

The hardware matters: CPUs with AVX-512 BF16 (``avx512_bf16``) or AMX (``amx_bf16``) multiply bf16
natively (on this project's 2-core EPYC, a 1024² matmul at 208 GFLOP/s against 84 in fp32); without
them oneDNN converts element by element and bf16 has measured ~100× slower than fp32
(BENCHMARKS.md). So bf16 is used only where :func:`cpu_has_native_bf16` finds one of those; a request
for it elsewhere warns, naming the key, and computes in float32.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch

from tearless.models.loading import compute_device, resolve_dtype

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX-BF16).

    Asks torch's own CPU probe (cpuinfo, any OS) first, then the Linux ``/proc/cpuinfo`` flags, so
    that a torch without the (private) probe still detects it."""
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            return True
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = {word for line in f if line.startswith("flags") for word in line.split(":", 1)[1].split()}
    except OSError:
        return False
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def compute_dtype(
    name: str | None, device: str | torch.device, key: str, *, warn: bool = True
) -> torch.dtype:
    """The dtype a role's forwards compute in for the config value ``name`` of ``key`` on ``device``.

    ``None`` (the default): bfloat16 on GPU, float32 on CPU. ``"auto"`` is resolved by the trainer
    before ranks are built (:mod:`tearless.workers.calibrate`); one that reaches here unresolved (a
    role built outside a trainer) is treated as ``None``. On CPU only float32 and, where
    :func:`cpu_has_native_bf16`, bfloat16 are computed; any other request (bf16 without the
    instructions, float16) warns (``warn``) and gives float32.
    """
    kind = torch.device(device).type
    if name is None or name == "auto":
        return torch.bfloat16 if kind == "cuda" else torch.float32
    dtype = resolve_dtype(name)
    if kind != "cpu" or dtype == torch.float32:
        return dtype
    if dtype == torch.bfloat16 and cpu_has_native_bf16():
        return dtype
    if warn:
        why = (
            "this CPU has neither AVX-512 BF16 nor AMX (no avx512_bf16/amx_bf16 flag), so bf16 matmuls would "
            "take an emulated path measured ~100x slower than float32"
            if dtype == torch.bfloat16
            else "float16 has no fast matmul on CPU"
        )
        warnings.warn(
            f"{key}={name}: {why}; computing in float32 instead. Set {key}=float32 to silence this.",
            UserWarning,
            stacklevel=2,
        )
    return torch.float32


def configure_cuda() -> None:
    """Process-wide GPU settings: float32 matmuls may use TF32 tensor cores
    (``torch.set_float32_matmul_precision("high")``: 10 explicit mantissa bits in the products,
    float32 accumulation, relative error ~2⁻¹¹ per product; what veRL and TRL run with). It touches
    the float32 parts of a mixed-precision step (the LM head's log-softmax inputs stay float32
    tensors; only matmuls that are float32 end to end, e.g. a float32 critic, take the TF32 path)."""
    torch.set_float32_matmul_precision("high")


def set_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Mark ``model`` to compute in ``dtype`` (read by :func:`autocast_for`); returns ``model``."""
    model.tearless_compute_dtype = dtype
    return model


def autocast(device: str | torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on CPU or GPU for a reduced ``dtype``; a no-op for float32/None or another
    device. Sharded GPU models are not marked (:func:`set_compute_dtype`): FSDP2's mixed-precision
    policy casts their parameters instead."""
    kind = torch.device(device).type
    if dtype is None or dtype == torch.float32 or kind not in ("cpu", "cuda"):
        return contextlib.nullcontext()
    return torch.autocast(kind, dtype=dtype)


@contextlib.contextmanager
def autocast_for(model: torch.nn.Module) -> Iterator[None]:
    """The autocast context of ``model``'s forwards (its ``tearless_compute_dtype``, set by
    :func:`set_compute_dtype`; none set = its parameters' dtype, no autocast)."""
    dtype = getattr(model, "tearless_compute_dtype", None)
    if dtype is None:
        yield
        return
    device = compute_device(model)
    with autocast(device, dtype):
        yield


def forward_only(device: str | torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """The no-gradient context of a forward-only pass on ``device`` that computes in ``dtype``.

    ``torch.inference_mode()`` for float32 and on GPU (its tensors skip autograd's version counting;
    the GPU decode loop's CUDA graphs must not capture cast weights that a cache frees when the region
    ends), but ``torch.no_grad()`` under a reduced autocast dtype on CPU: autocast keeps the bf16 cast
    of each float32 weight for the rest of its region only outside inference mode; inside it every
    matmul casts its weight again. A decode step of SmolLM2-135M then re-casts all 135 M weights (the
    tied 49,152 × 576 LM head alone reads 113 MB and writes 57 MB), and those casts took half of bf16
    decoding's time on a CPU with AMX (BENCHMARKS.md, "bf16 on a CPU with native bf16"). A caller
    that changes weights in place inside one region must :func:`torch.clear_autocast_cache` after it.
    """
    if dtype is None or dtype == torch.float32 or torch.device(device).type != "cpu":
        return torch.inference_mode()
    return torch.no_grad()


def active_dtype(device_type: str) -> torch.dtype | None:
    """The reduced dtype autocast computes matmuls in on ``device_type`` right now, or None."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
