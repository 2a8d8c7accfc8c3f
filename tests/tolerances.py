"""Tolerances for float results that agree in exact arithmetic but are not computed identically.

Two evaluations of one quantity are bit-for-bit equal only when they run the same kernel on the same
inputs in the same order. Anything else (another batch composition, micro-batch split, padding or
KV-cache layout, another thread count, another CPU whose SIMD width regroups a reduction, sharded
workers) rounds differently, and the tests bound the difference instead of measuring it on one
machine. The bound used throughout is the standard one for recursive summation (Higham, *Accuracy
and Stability of Numerical Algorithms*, 2nd ed., §4.2): a sum of n terms computed in any order is
within

    γ_{n-1} · Σ|x_i|,   γ_n = n·u / (1 − n·u),   u = eps / 2 (the unit roundoff),

of the exact sum, so two evaluations in different orders are within 2·γ_n·Σ|x_i| of each other. A
dot product of length n is such a sum (its products are rounded once more, which γ_n also covers).

Usage: a test names the sum (how many terms, how large) at the assertion, e.g. "the gradient of a
weight is a sum over ~170 tokens of contributions that each went through a forward and a backward of
the network", and passes those numbers here. These are worst-case bounds: real rounding errors grow
like √n, so the tolerances sit one to three orders of magnitude above the differences measured with
1 and 2 threads and with AVX-512, AVX2 and SSE4.2 kernels, while a real bug (a missing normaliser, a
factor of 2, a wrong or dropped row, a wrong position or temperature) changes the result by a
fraction of its own size, above them.

Results that *are* computed identically (the same call repeated, exact zeros, integer counts,
sums of small integers) are compared exactly in the tests, not with these.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# The logits' size, the magnitude of the sums behind them: the task's warmed-up tiny Llama reaches
# |z| = 11.4 over a rollout batch (measured); the tests train it for a few small steps at most, and
# their random-init tiny models stay below 1. Temperature T divides the logits: pass LOGIT_BOUND / T.
LOGIT_BOUND = 12.0


def eps(dtype: torch.dtype = torch.float32) -> float:
    """Machine epsilon of ``dtype``: the gap between 1 and the next float (2⁻²³ for float32)."""
    return torch.finfo(dtype).eps


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """u = eps/2: one correctly rounded operation has relative error at most u."""
    return eps(dtype) / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """Higham's γ_n = n·u / (1 − n·u): the relative error bound of n successive roundings."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"γ_{n} is unbounded in {dtype}: n·u = {nu}")
    return nu / (1 - nu)


def sum_tol(n_terms: int, magnitude: float, dtype: torch.dtype = torch.float32, safety: float = 1.0) -> float:
    """Largest |a − b| between two evaluations of one sum of ``n_terms`` terms in different orders.

    ``magnitude`` bounds Σ|x_i|, the sum of the terms' absolute values: the size of the result when
    the terms do not cancel, ``n_terms`` times the largest term otherwise. ``safety`` covers what the
    bound leaves out at a given site (terms that are themselves rounded results, some cancellation);
    each site says why it uses one. Returns ``safety · 2 · γ_n · magnitude``.
    """
    return safety * 2 * gamma(max(int(n_terms), 1), dtype) * magnitude


def forward_terms(config: Any) -> int:
    """The length of the chain of accumulations behind one logit of a Llama-style decoder.

    Per layer, a hidden state passes an attention projection (a dot product over ``hidden_size``
    terms) and the MLP's down projection (over ``intermediate_size``); then the LM head (over
    ``hidden_size``). Rounding errors of successive layers add (each layer's output is a sum of the
    previous one's, normalised by RMSNorm), so the logit carries the error of one sum of this many
    terms. For the task's tiny Llama (hidden 128, MLP 384, 2 layers): 1,152.
    """
    hidden, layers = config.hidden_size, config.num_hidden_layers
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    return layers * (hidden + intermediate) + hidden


def module_terms(module: torch.nn.Module) -> int:
    """An upper bound on the chain of accumulations behind any output of ``module``: the dot-product
    length of every linear layer (``in_features``) and convolution (in_channels/groups × kernel
    size), as if all of them ran in sequence (parallel branches make it an overestimate)."""
    total = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear):
            total += m.in_features
        elif isinstance(m, torch.nn.modules.conv._ConvNd):
            total += m.in_channels // m.groups * math.prod(m.kernel_size)
    return total


def logit_tol(config: Any, dtype: torch.dtype = torch.float32, logit_bound: float = LOGIT_BOUND) -> float:
    """Two forwards of one model (another batch layout, padding, KV cache or kernel) give logits this
    close: a sum of :func:`forward_terms` terms of size up to ``logit_bound``, in ``dtype``."""
    return sum_tol(forward_terms(config), logit_bound, dtype)


def log_softmax_tol(vocab_size: int, logit_bound: float = LOGIT_BOUND) -> float:
    """Two float32 evaluations of z_y − log Σ_v e^{z_v} on the same logits (any implementation).

    After the max shift the sum has ``vocab_size`` terms in (0, 1] adding up to at least 1, so its log
    is off by at most 2·γ_V (absolute); the shift and subtraction of logits up to ``logit_bound`` add
    a rounding each.
    """
    return sum_tol(vocab_size, 1.0) + 2 * eps(torch.float32) * logit_bound


def logprob_tol(config: Any, dtype: torch.dtype = torch.float32, logit_bound: float = LOGIT_BOUND) -> float:
    """Token log-probs of two differently batched forwards of one model (any batch layout, padding,
    KV cache, kernel or thread count).

    The logits' error (:func:`logit_tol`, in the model's ``dtype``) moves z_y − lse(z) by at most twice
    that (the log-sum-exp's gradient is a probability vector), plus the float32 log-softmax's own
    rounding (:func:`log_softmax_tol`; tearless takes log-probs in float32 whatever the model's dtype).
    """
    return 2 * logit_tol(config, dtype, logit_bound) + log_softmax_tol(config.vocab_size, logit_bound)


def entropy_tol(config: Any, dtype: torch.dtype = torch.float32, logit_bound: float = LOGIT_BOUND) -> float:
    """As :func:`logprob_tol` for the entropy H = lse(z) − Σ_v p_v z_v: one more float32 sum over the
    vocabulary, of terms p_v·z_v adding up to at most ``logit_bound`` in size."""
    return logprob_tol(config, dtype, logit_bound) + sum_tol(config.vocab_size, logit_bound)


def kl_of_equal_policies(kind: str, delta: float) -> float:
    """The largest per-token KL estimate (hence mean) between two log-prob tensors of one policy that
    agree to within ``delta`` (e.g. :func:`logprob_tol`): the estimate of a zero KL, to rounding.

    k1 = x − y and |x − y| are at most δ; k2 = ½(x − y)² at most δ²/2; k3 = e^u − u − 1 ≈ u²/2 is
    evaluated in float32 next to 1, so it carries one more rounding of 1 (eps) on top of δ²/2·e^δ.
    """
    if kind in ("kl", "k1", "abs"):
        return delta
    if kind in ("mse", "k2"):
        return 0.5 * delta**2
    if kind in ("low_var_kl", "k3"):
        return 0.5 * delta**2 * math.exp(delta) + 2 * eps(torch.float32)
    raise ValueError(f"no bound for KL estimator {kind!r}")


def gradient_terms(config: Any, n_tokens: int) -> int:
    """The accumulation behind one entry of a loss gradient: each token's contribution went through a
    forward and a backward of the network (two chains of :func:`forward_terms`), and the entry sums
    ``n_tokens`` of them."""
    return 2 * forward_terms(config) + int(n_tokens)


def loss_rel(config: Any, n_tokens: int) -> float:
    """Relative tolerance of a logged loss, KL, entropy or gradient norm of an update, between two
    layouts of the same batch (micro-batches, shards): the same sums as the gradient's
    (:func:`gradient_terms`), whose per-token terms have both signs (advantages ±1, log-ratios), so
    that their absolute sum may be ~10x the result (safety 10)."""
    return sum_tol(gradient_terms(config, n_tokens), 1.0, safety=10)


__all__ = [
    "LOGIT_BOUND",
    "entropy_tol",
    "eps",
    "forward_terms",
    "gamma",
    "gradient_terms",
    "kl_of_equal_policies",
    "log_softmax_tol",
    "logit_tol",
    "logprob_tol",
    "loss_rel",
    "module_terms",
    "sum_tol",
    "unit_roundoff",
]
