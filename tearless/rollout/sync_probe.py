r"""Every weight sync into a separate engine, verified: the engine's log-probs of a fixed probe
against the trainer's.

After the trainer's weights are loaded into a vLLM engine (the first load, and after every actor
update), the engine scores a fixed token sequence, the probe (the first training prompt followed by
its ground-truth answer where the data has one), and the trainer's actor scores the same sequence
teacher-forced; both at temperature 1. The metric is

.. math:: d = \max_i \lvert \log \pi_e(x_i \mid x_{<i}) - \log \pi_t(x_i \mid x_{<i}) \rvert

(:math:`\pi_e` the engine, :math:`\pi_t` the trainer; ``rollout/sync_probe_max_diff``, the largest
over the generating ranks). Loading the same weights
leaves only rounding: the engine holds them in the rollout dtype, with relative rounding error
:math:`\epsilon` (float32 :math:`2^{-23}`, bfloat16 :math:`2^{-7}`) that reaches a log-prob through
sums of thousands of rounded products. The bound is

.. math:: b = 8 \sqrt{\epsilon}

(float32 0.0028, float16 0.25, bfloat16 0.71): it sits far above that rounding (measured in float32:
below :math:`10^{-4}`, BENCHMARKS.md) and far below what one wrong tensor does (one layer's weights
from another step, or a projection loaded transposed, moves some token's log-prob by whole nats). A
difference beyond it stops the run naming the step and the bound: silent corruption after a sync
trains on samples from a model nobody is training.
"""

from __future__ import annotations

import math

import torch

from tearless.models.loading import resolve_dtype

METRIC = "rollout/sync_probe_max_diff"


def probe_bound(dtype: str | torch.dtype) -> float:
    r""":math:`8 \sqrt{\epsilon}` of the engine's dtype (see the module docstring)."""
    dtype = resolve_dtype(dtype) if isinstance(dtype, str) else dtype
    return 8.0 * math.sqrt(torch.finfo(dtype).eps)


def probe_ids(item: dict, tokenizer) -> list[int]:
    """The probe: ``item``'s prompt tokens, then its ground-truth answer's (when it has a string
    one), so the probe covers both the prompt and a response the policy learns to give."""
    ids = list(item["input_ids"])
    answer = item.get("ground_truth")
    if isinstance(answer, str) and answer:
        ids += list(tokenizer.encode(answer, add_special_tokens=False))
    return ids


def max_difference(engine: torch.Tensor, trainer: torch.Tensor) -> float:
    """:math:`\\max_i |a_i - b_i|` over the probe's scored tokens (same length)."""
    if engine.shape != trainer.shape:
        raise ValueError(f"the engine scored {engine.shape[0]} probe tokens, the trainer {trainer.shape[0]}")
    return float((engine.float() - trainer.float()).abs().max())


def _when(step: int | None) -> str:
    return "the first weight load" if step is None else f"the weight sync after step {step}"


def checksum_message(step: int | None, fault: str) -> str:
    """The one line that stops a run whose sync (after ``step``; None: the first load) failed the weight
    checksum (:mod:`tearless.rollout.weight_checksum`; ``fault`` names the tensor and the worker)."""
    return (
        f"{_when(step)}: weight checksum: {fault}; the engine does not hold the trained weights, so the "
        "run stopped before training on its samples. Check the vLLM version against constraints-vllm.txt "
        "(a kernel that repacks weights wrongly) and the weight names the engine loads; "
        "actor_rollout_ref.rollout.weight_checksum=false turns this check off"
    )


def mismatch_message(step: int | None, diff: float, bound: float, dtype: str) -> str:
    """The one line that stops a run whose sync (after ``step``; None: the first load) left the engine
    with other weights than the trainer."""
    when = _when(step)
    return (
        f"{when}: the rollout engine's log-probs of the probe differ from the trainer's by {diff:.4g} "
        f"(bound {bound:.4g} for rollout dtype {dtype}, {METRIC}); the engine does not hold the "
        "trained weights, so the run stopped before training on its samples. Check the weight names "
        "and dtypes the engine loads (actor_rollout_ref.rollout.dtype)"
    )
