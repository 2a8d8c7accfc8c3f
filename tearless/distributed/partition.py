"""How a batch is cut across data-parallel ranks, and the update schedule each rank follows.

Every rank of a data-parallel group must run the same number of forward/backward passes (FSDP
all-gathers parameters inside each one), while the rows themselves are split by token count so that
no rank waits long for another. Groups of responses that share a ``uid`` stay on one rank.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict


def row_tokens(td: TensorDict) -> list[int]:
    """Real (unpadded) prompt + response tokens of each row."""
    return (td["prompt_mask"].sum(-1) + td["response_mask"].sum(-1)).tolist()


def balanced_partition(
    tokens: Sequence[int], groups: Sequence[Hashable] | None, world: int
) -> list[list[int]]:
    """Split row indices into ``world`` parts of nearly equal token sums, each ``groups`` value on one part.

    Greedy longest-processing-time: units (all rows of one group, or single rows without groups) are
    taken largest first and given to the part with the fewest tokens so far (ties: fewest rows, then
    lowest rank). Its makespan is at most 4/3 of the optimum. When there are fewer units than parts,
    groups are broken into single rows so that every part gets work. Each part lists its rows in
    their original order. Returns ``world`` lists whose union is ``range(len(tokens))``.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    rows = len(tokens)
    if rows < world:
        raise ValueError(
            f"{rows} rows cannot be split across {world} workers; give each worker at least one row "
            "(raise data.train_batch_size or lower the number of workers)"
        )
    units: dict[Hashable, list[int]] = {}
    for i in range(rows):
        units.setdefault(groups[i] if groups is not None else i, []).append(i)
    unit_rows = list(units.values())
    if len(unit_rows) < world:
        unit_rows = [[i] for i in range(rows)]
    unit_rows.sort(key=lambda u: (-sum(tokens[i] for i in u), u[0]))
    parts: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for unit in unit_rows:
        r = min(range(world), key=lambda k: (load[k], len(parts[k]), k))
        parts[r].extend(unit)
        load[r] += sum(tokens[i] for i in unit)
    return [sorted(p) for p in parts]


@dataclass
class MiniBatchPlan:
    """One optimizer step: each rank's rows (indices into the step's batch), the mini-batch's global
    loss normalisers and the number of micro-batches every rank runs (the largest count of any rank;
    ranks with fewer run padding passes whose loss is multiplied by zero)."""

    rows: list[list[int]]
    norm: dict[str, torch.Tensor | float]
    num_micro: int


def mini_batch_norm(
    response_mask: torch.Tensor, loss_scale_factor: float | None = None
) -> dict[str, torch.Tensor | float]:
    """The global normalisers of one mini-batch (``norm`` of :func:`tearless.workers.actor.run_updates`,
    which calls this, and of the ranks' plans). ``loss_scale_factor`` is seq-mean-token-sum-norm's
    constant S (the trainer passes :func:`tearless.config.derived.loss_scale_factor`); None falls back
    to the padded width, which changes with the step's longest response."""
    scale = response_mask.shape[1] if loss_scale_factor is None else loss_scale_factor
    return {
        "global_num_tokens": response_mask.sum().clamp(min=1),
        "global_num_seqs": (response_mask.sum(-1) > 0).sum().clamp(min=1),
        "loss_scale_factor": float(scale),
    }


def count_micro_batches(tokens: Sequence[int], *, size: int | None, token_budget: int | None) -> int:
    """How many micro-batches :func:`tearless.workers.actor.micro_batches` makes of rows with these
    token counts (by ``size`` rows, or packed greedily under ``token_budget``)."""
    if not tokens:
        return 0
    if token_budget is None:
        return math.ceil(len(tokens) / (size or len(tokens)))
    count, used = 1, 0
    for i, length in enumerate(tokens):
        if i > 0 and used + length > token_budget:
            count, used = count + 1, 0
        used += length
    return count


def plan_updates(
    td: TensorDict,
    uids: Sequence[Hashable] | None,
    world: int,
    *,
    rows_per_mini: int,
    epochs: int,
    shuffle: bool,
    generator: torch.Generator | None,
    micro_size: int | None,
    token_budget: int | None,
    loss_scale_factor: float | None = None,
) -> list[MiniBatchPlan]:
    """The single-process update schedule (:func:`tearless.workers.actor.run_updates`: the same
    permutation draws from ``generator``, the same mini-batches, the same normalisers), with each
    mini-batch split across ``world`` ranks by token balance, uid groups kept together."""
    rows = td.batch_size[0]
    tokens = row_tokens(td)
    plans = []
    for _ in range(epochs):
        order = torch.randperm(rows, generator=generator) if shuffle else torch.arange(rows)
        for start in range(0, rows, rows_per_mini):
            mini = order[start : start + rows_per_mini].tolist()
            local = balanced_partition(
                [tokens[i] for i in mini], [uids[i] for i in mini] if uids is not None else None, world
            )
            parts = [[mini[j] for j in part] for part in local]
            num_micro = max(
                count_micro_batches([tokens[i] for i in p], size=micro_size, token_budget=token_budget)
                for p in parts
            )
            norm = mini_batch_norm(td["response_mask"][mini], loss_scale_factor)
            plans.append(MiniBatchPlan(parts, norm, num_micro))
    return plans
