"""Placement-invariant sampling: every sample's random numbers derive from its identity alone.

A sample is identified by (``trainer.seed``, step, stream, the prompt's index in the step's batch,
the sample's index among the prompt's ``n``) and, in a multi-turn rollout, the turn. Its key is a
64-bit hash of those integers (:func:`mix`), and the uniform number that draws its t-th token is a
counter-based hash of (key, t) (:func:`uniforms`), so a sample draws the same tokens whichever
process generates it, in whatever batch, next to whatever other samples: one process, 2 workers
and 3 workers give the same rollout (to float rounding of the logits), which is what lets the tests
compare placements end to end, and a resumed run redraws what the uninterrupted run drew.

The hash is SplitMix64's finaliser (Steele, Lea and Flood 2014): a bijection on 64-bit integers
whose outputs pass BigCrush; numpy's uint64 arithmetic wraps modulo 2^64 by definition, so the
numbers are identical on every machine. A token is drawn by inverting the distribution's CDF at the
sample's uniform number (:func:`inverse_cdf`), which draws each token with exactly its probability.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _finalise(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def mix(*values: int) -> int:
    """A 64-bit key from integers (negative ones allowed): SplitMix64 applied along the sequence."""
    key = 0
    for v in values:
        key = _finalise((key + _GOLDEN + (int(v) & _MASK)) & _MASK)
    return key


def prompt_keys(seed: int, step: int, stream: int, count: int) -> list[int]:
    """The keys of a batch's ``count`` prompts: prompt i of step ``step`` (``stream`` tells apart the
    batches of one step: training, a dynamic-sampling round, ReMax's greedy pass, validation)."""
    return [mix(seed, step, stream, i) for i in range(count)]


def sample_keys(keys: Sequence[int], n: int) -> list[int]:
    """Each prompt's ``n`` sample keys, samples of a prompt adjacent."""
    return [mix(k, j) for k in keys for j in range(n)]


def uniforms(keys: Iterable[int], length: int) -> torch.Tensor:
    """(len(keys), length) float32 uniforms in [0, 1): entry (i, t) is a hash of (keys[i], t) alone,
    so the first t columns do not depend on ``length``."""
    k = np.array([int(x) & _MASK for x in keys], dtype=np.uint64)[:, None]
    t = np.arange(1, length + 1, dtype=np.uint64)[None, :]
    x = k + t * np.uint64(_GOLDEN)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    # The top 24 bits: exact in float32, so u < 1 always.
    return torch.from_numpy(((x >> np.uint64(40)).astype(np.float32)) * np.float32(2.0**-24))


def inverse_cdf(probs: torch.Tensor, owner: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per output row: row i draws from ``probs[owner[i]]`` (probabilities, (U, V)) with its
    uniform ``u[i]``; returns (B,) token ids.

    Token v is drawn when CDF(v−1) ≤ u·Z < CDF(v), Z the row's total mass, so with u uniform each
    token comes with exactly its probability and a zero-probability token never does. The output rows
    of one model row are searched in one batched call (no (B, V) copy of the probabilities).
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    counts = torch.bincount(owner, minlength=probs.shape[0])
    order = torch.argsort(owner, stable=True)
    rank = torch.empty_like(owner)
    rank[order] = torch.arange(len(owner), device=owner.device) - (counts.cumsum(0) - counts)[owner[order]]
    targets = torch.zeros((probs.shape[0], int(counts.max())), dtype=cdf.dtype, device=cdf.device)
    targets[owner, rank] = u.to(cdf.device, cdf.dtype) * total[owner, 0]
    drawn = torch.searchsorted(cdf, targets, right=True)[owner, rank]
    return clamp_to_support(probs, drawn, owner)


def clamp_to_support(
    probs: torch.Tensor, drawn: torch.Tensor, owner: torch.Tensor | None = None, *, sync: bool = True
) -> torch.Tensor:
    """``drawn`` (B,), tokens searched in the CDF of rows ``owner`` (default: row i for i) of ``probs``
    (U, V), with every index V (past the vocabulary) replaced by that row's last token of non-zero
    probability.

    u·Z can round up to the total Z itself, and ``searchsorted(right=True)`` then returns V. Any
    smaller target lands at or before the last non-zero token (where the CDF reaches Z), so only V
    needs the fix, and the search for the last non-zero token runs on those rare rows alone. With
    ``sync=False`` it runs on every row instead, so that nothing is read back to the host.
    """
    past = drawn == probs.shape[1]
    if not sync:
        rows = probs if owner is None else probs[owner]
        last = probs.shape[1] - 1 - (rows.flip(-1) > 0).to(torch.int8).argmax(-1)
        return torch.where(past, last, drawn)
    if not bool(past.any()):
        return drawn
    rows = probs[past] if owner is None else probs[owner[past]]
    return drawn.masked_scatter(past, probs.shape[1] - 1 - (rows.flip(-1) > 0).to(torch.int8).argmax(-1))
