"""Splitting batches across ranks and planning the sharded update (no processes needed)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tearless.distributed.group import gather_rows
from tearless.distributed.partition import (
    balanced_partition,
    count_micro_batches,
    mini_batch_norm,
    plan_updates,
)
from tearless.workers.actor import micro_batches


def batch(lengths: list[int], width: int = 6) -> TensorDict:
    """Rows with a 2-token prompt and ``lengths[i]`` response tokens."""
    rows = len(lengths)
    response_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        response_mask[i, :n] = 1
    return TensorDict(
        {
            "prompt_ids": torch.zeros(rows, 2, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
            "response_ids": torch.zeros(rows, width, dtype=torch.long),
            "response_mask": response_mask,
            "row": torch.arange(rows),
        },
        batch_size=[rows],
    )


def test_groups_stay_together_and_tokens_balance():
    # 4 groups of 2 rows; group token sums: g0 = 10+10 = 20, g1 = 2+2 = 4, g2 = 9+9 = 18, g3 = 3+3 = 6.
    # Largest first: g0 → rank 0 (20), g2 → rank 1 (18), g3 → rank 1 (24), g1 → rank 0 (24).
    tokens = [10, 10, 2, 2, 9, 9, 3, 3]
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    parts = balanced_partition(tokens, groups, 2)
    assert parts == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [sum(tokens[i] for i in p) for p in parts] == [24, 24]


def test_fewer_groups_than_ranks_splits_rows_and_every_rank_gets_work():
    parts = balanced_partition([5, 1, 1, 1], [0, 0, 0, 0], 3)
    assert sorted(i for p in parts for i in p) == [0, 1, 2, 3]
    assert all(parts)
    with pytest.raises(ValueError, match="at least one row"):
        balanced_partition([1], None, 2)


def test_micro_batch_count_matches_the_actors_split():
    td = batch([6, 1, 6, 2, 5, 6, 1])
    tokens = (td["prompt_mask"].sum(-1) + td["response_mask"].sum(-1)).tolist()  # 8, 3, 8, 4, 7, 8, 3
    for size, budget in [(3, None), (2, None), (None, None), (None, 11), (None, 8), (None, 100)]:
        expected = len(micro_batches(td, size=size, token_budget=budget))
        assert count_micro_batches(tokens, size=size, token_budget=budget) == expected, (size, budget)


def test_plan_reproduces_the_single_process_schedule_and_normalisers():
    td = batch([6, 1, 6, 2, 5, 6, 1, 3])
    uids = [0, 0, 1, 1, 2, 2, 3, 3]
    plans = plan_updates(
        td,
        uids,
        2,
        rows_per_mini=4,
        epochs=2,
        shuffle=True,
        generator=torch.Generator().manual_seed(3),
        micro_size=1,
        token_budget=None,
    )
    # run_updates draws one permutation per epoch from the same generator and cuts it in order
    gen = torch.Generator().manual_seed(3)
    expected = []
    for _ in range(2):
        order = torch.randperm(8, generator=gen).tolist()
        expected += [sorted(order[:4]), sorted(order[4:])]
    assert len(plans) == 4
    for plan, rows in zip(plans, expected, strict=True):
        assert sorted(plan.rows[0] + plan.rows[1]) == rows
        assert plan.rows[0] and plan.rows[1]
        mask = td["response_mask"][rows]
        assert plan.norm["global_num_tokens"] == mask.sum() == mini_batch_norm(mask)["global_num_tokens"]
        assert plan.norm["loss_scale_factor"] == 6.0
        assert plan.num_micro == max(len(r) for r in plan.rows)  # one row per micro-batch


def test_gather_puts_rows_back_in_place():
    parts = [[0, 3], [1, 2, 4]]
    outs = [torch.tensor([[0.0], [3.0]]), torch.tensor([[1.0], [2.0], [4.0]])]
    assert gather_rows(parts, outs, 5).squeeze(-1).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
