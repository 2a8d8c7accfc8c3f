"""Prompt groups: rows that share a group id (``uid``), matched by equality of the id, never by position."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from torch import Tensor

GroupIndex = Sequence[Hashable] | Tensor


def group_ids(index: GroupIndex, batch_size: int, device: torch.device | None = None) -> Tensor:
    """Dense group number per row, ``(B,)`` int64 in ``[0, G)``, rows with equal ids sharing a number.

    ``index`` is a 1-D tensor or any sequence of hashables (str uuids, ints, a numpy object array).
    Elements that are 0-d tensors are compared by value (a tensor hashes by identity, which would put
    every row in its own group).
    """
    if isinstance(index, Tensor):
        if index.dim() != 1:
            raise ValueError(f"index tensor must be 1-D, got shape {tuple(index.shape)}")
        ids = torch.unique(index, return_inverse=True)[1]
    else:
        numbers: dict[Hashable, int] = {}
        keys = [k.item() if isinstance(k, Tensor) else k for k in index]
        ids = torch.tensor([numbers.setdefault(k, len(numbers)) for k in keys], dtype=torch.long)
    if ids.numel() != batch_size:
        raise ValueError(f"index has {ids.numel()} entries but the batch has {batch_size} rows")
    return ids.to(device)


def group_reduce(values: Tensor, ids: Tensor, reduce: Literal["sum", "amax", "amin"] = "sum") -> Tensor:
    """Reduce ``values`` (B,) within each group of ``ids`` (B,); returns (G,), G = ids.max() + 1."""
    num_groups = int(ids.max()) + 1 if ids.numel() else 0
    out = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    if reduce == "sum":
        return out.index_add_(0, ids, values)
    return out.scatter_reduce_(0, ids, values, reduce=reduce, include_self=False)


def group_sizes(ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Number of rows of each row's own group, ``(B,)``."""
    return torch.bincount(ids).to(dtype)[ids]


def num_groups(index: GroupIndex) -> int:
    """The number of distinct group ids in ``index``."""
    return int(group_ids(index, len(index)).max()) + 1 if len(index) else 0


def first_groups(index: GroupIndex, keep: Tensor, count: int) -> Tensor:
    """Rows (ascending) of the first ``count`` groups, in first-appearance order, among the rows
    where ``keep`` (B,) is True: how dynamic sampling fills a batch up to its number of groups."""
    kept = keep.nonzero().squeeze(-1)
    if kept.numel() == 0:
        return kept
    ids = group_ids([index[i] for i in kept.tolist()], kept.numel())
    return kept[ids < count]


def groups_within(values: Tensor, index: GroupIndex, bound: int) -> Tensor:
    """Rows (ascending) of the groups whose every member has ``values`` ≤ ``bound``: a prompt group
    is kept or dropped whole (``values`` (B,), e.g. each sample's staleness)."""
    ids = group_ids(index, values.numel())
    worst = group_reduce(values, ids, "amax")
    return (worst[ids] <= bound).nonzero().squeeze(-1)
