"""Statistics over the valid entries of a tensor.

``mask`` is any tensor broadcastable to ``x`` whose nonzero entries mark valid positions (bool, int or
float 0/1). Entries outside the mask never influence a result, not even when they are NaN or inf: they are
replaced by zero with ``torch.where`` before any arithmetic (``x * mask`` would turn NaN·0 into NaN), which
also keeps their gradient exactly zero.
"""

from __future__ import annotations

import torch
from torch import Tensor


def zero_masked(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` with every position outside ``mask`` set to 0 (gradient there is 0 too)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def _count(x: Tensor, mask: Tensor, dim: int | None) -> Tensor:
    valid = mask.bool().expand_as(x)
    return valid.sum() if dim is None else valid.sum(dim)


def _require_valid(n: Tensor, minimum: int, what: str) -> None:
    if int(n) < minimum:
        raise ValueError(f"{what} needs at least {minimum} valid element(s) under the mask, got {int(n)}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    r"""Sum of the valid entries: :math:`\sum_j x_j m_j`.

    Shapes: ``x`` (...), ``mask`` broadcastable to ``x``; returns a 0-d tensor (``dim=None``) or ``x``
    reduced over ``dim``. An empty mask sums to 0.
    """
    masked = zero_masked(x, mask)
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    r"""Mean of the valid entries: :math:`\sum_j x_j m_j / \sum_j m_j`.

    Shapes as :func:`masked_sum`. With ``dim=None`` an all-zero mask raises ValueError (the mean is
    undefined). With ``dim`` given, a slice whose mask is empty gives 0, so that a padded row in a batch
    contributes nothing instead of poisoning the result with NaN.
    """
    n = _count(x, mask, dim)
    if dim is None:
        _require_valid(n, 1, "masked_mean")
        return masked_sum(x, mask) / n
    return masked_sum(x, mask, dim) / n.clamp(min=1)


def _mean_var(x: Tensor, mask: Tensor, unbiased: bool) -> tuple[Tensor, Tensor]:
    n = _count(x, mask, None)
    _require_valid(n, 2 if unbiased else 1, f"masked_var(unbiased={unbiased})")
    mean = masked_sum(x, mask) / n
    centred = zero_masked(x - mean, mask)
    return mean, centred.square().sum() / (n - 1 if unbiased else n)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    r"""Variance of all valid entries of ``x`` (0-d tensor).

    .. math:: \sigma^2 = \frac{\sum_j m_j (x_j - \mu)^2}{N - 1} \ (\text{unbiased}) \quad\text{or}\quad
              \frac{\cdots}{N}, \qquad N = \sum_j m_j

    Raises ValueError for an empty mask, and for a single valid entry when ``unbiased`` (N − 1 = 0).
    """
    return _mean_var(x, mask, unbiased)[1]


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    r"""Normalise ``x`` with the mean and unbiased variance of all its valid entries.

    .. math:: \hat x = \frac{x - \mu}{\sqrt{\sigma^2 + \epsilon}} \ (+\mu \text{ if not shift\_mean})

    μ and σ² are taken over the whole tensor (for a (B, T) batch: over every valid token of the batch).
    Returns the shape of ``x``, zero outside the mask. Needs at least two valid entries (see
    :func:`masked_var`).
    """
    x = zero_masked(x, mask)
    mean, var = _mean_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return zero_masked(whitened, mask)
