"""DAPO's reward shaping and dynamic sampling (Yu et al. 2025, arXiv 2503.14476)."""

from __future__ import annotations

import torch
from torch import Tensor

from tearless.algos.groups import GroupIndex, group_ids, group_reduce


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> Tensor:
    r"""Soft overlong punishment, a reward term per response: (B,) lengths → (B,) penalties ≤ 0.

    .. math:: L_{exp} = L_{max} - B_{buf}, \qquad
              p = \min\Big(0, -\frac{L - L_{exp}}{B_{buf}}\,\text{penalty\_factor}\Big)

    0 up to L_exp tokens, falling linearly to −penalty_factor at L_max (and continuing the line beyond
    it, for lengths that a caller did not truncate).
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer_len must be in (0, max_response_length={max_response_length}], "
            f"got {overlong_buffer_len}"
        )
    expected = max_response_length - overlong_buffer_len
    excess = (response_lengths.to(torch.get_default_dtype()) - expected) / overlong_buffer_len
    return torch.clamp(-excess * penalty_factor, max=0.0)


def filter_groups(scores: Tensor, index: GroupIndex) -> Tensor:
    """Dynamic sampling: a (B,) bool mask keeping the rows whose group's scores are not all equal.

    ``scores`` (B,) is the per-response metric (usually the outcome reward); ``index`` the group id per
    row, matched by equality. A group whose scores are all equal has zero group-relative advantage and
    so no gradient; it is dropped. A group of one is dropped too (its scores are trivially all equal);
    DAPO's recipe keeps singletons, but with group-relative estimators they carry no comparison.
    """
    ids = group_ids(index, scores.shape[0], scores.device)
    spread = group_reduce(scores, ids, "amax") - group_reduce(scores, ids, "amin")
    return (spread > 0)[ids]
