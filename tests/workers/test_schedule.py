"""The one update schedule's planning: splitting batches across ranks, mini-batches, padding passes,
zero-advantage rows (no processes needed; the Ray tests run the plans)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tearless import devices
from tearless.workers import schedule
from tearless.workers.group import contiguous_split
from tearless.workers.optim import make_optimizer
from tearless.workers.schedule import (
    UpdateFlags,
    UpdateSettings,
    balanced_partition,
    count_micro_batches,
    micro_batches,
    mini_batch_norm,
    plan_updates,
    rank_steps,
    rank_work,
    run_plan,
    skipped_rows_metrics,
)


def batch(lengths: list[int], width: int = 6, uids: list[int] | None = None) -> TensorDict:
    """Rows with a 2-token prompt and ``lengths[i]`` response tokens, in prompt groups ``uids``."""
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
            "uid_index": torch.tensor(uids if uids is not None else list(range(rows))),
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
    assert balanced_partition([1], None, 2) == [[0], []]  # the schedule gives the empty rank padding


def test_micro_batch_count_matches_the_actors_split():
    td = batch([6, 1, 6, 2, 5, 6, 1])
    tokens = (td["prompt_mask"].sum(-1) + td["response_mask"].sum(-1)).tolist()  # 8, 3, 8, 4, 7, 8, 3
    for size, budget in [(3, None), (2, None), (None, None), (None, 11), (None, 8), (None, 100)]:
        expected = len(micro_batches(td, size=size, token_budget=budget))
        assert count_micro_batches(tokens, size=size, token_budget=budget) == expected, (size, budget)


def settings(**kw) -> UpdateSettings:
    base = dict(rows_per_mini=4, epochs=2, shuffle=True, micro_size=1, token_budget=None, grad_clip=1.0)
    return UpdateSettings(**{**base, "prefix": "actor", **kw})


def test_plan_reproduces_the_single_process_schedule_and_normalisers():
    td = batch([6, 1, 6, 2, 5, 6, 1, 3], uids=[0, 0, 1, 1, 2, 2, 3, 3])
    plans = plan_updates(td, settings(), 2, generator=torch.Generator().manual_seed(3))
    # the schedule draws one permutation per epoch from the same generator and cuts it in order,
    # whatever the world size
    single = plan_updates(td, settings(), 1, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    expected = []
    for _ in range(2):
        order = torch.randperm(8, generator=gen).tolist()
        expected += [sorted(order[:4]), sorted(order[4:])]
    assert len(plans) == 4
    for plan, one, rows in zip(plans, single, expected, strict=True):
        assert sorted(plan.rows[0] + plan.rows[1]) == rows == sorted(one.rows[0])
        assert plan.rows[0] and plan.rows[1] and plan.padding == [False, False]
        mask = td["response_mask"][rows]
        assert plan.norm["global_num_tokens"] == mask.sum() == mini_batch_norm(mask)["global_num_tokens"]
        assert plan.norm["global_num_tokens"] == one.norm["global_num_tokens"]
        assert plan.norm["loss_scale_factor"] == 6.0
        assert plan.num_micro == max(len(r) for r in plan.rows)  # one row per micro-batch


def test_a_rank_without_rows_runs_padding_passes():
    # 2 rows of one prompt over 3 ranks: the prompt's group stays on one rank... unless there are fewer
    # groups than ranks, when rows are split; the third rank gets row 0 again, marked as padding, and
    # runs as many passes as the busiest rank (its loss is multiplied by 0 by run_plan).
    td = batch([3, 5], uids=[0, 0])
    (plan,) = plan_updates(td, settings(epochs=1, shuffle=False), 3)
    assert plan.padding == [False, False, True]
    assert plan.rows[2] == [0] and plan.num_micro == 1
    rows, steps = rank_steps([plan], 2)
    assert rows == [0] and steps == [([0], True, plan.norm, 1)]


def test_zero_advantage_rows_leave_the_passes_not_the_normalisers():
    td = batch([6, 1, 6, 2], uids=[0, 0, 1, 1])
    skip = torch.tensor([True, True, False, False])
    (plan,) = plan_updates(td, settings(epochs=1, shuffle=False), 1, skip_rows=skip)
    assert plan.rows == [[2, 3]] and plan.skipped == [0, 1] and plan.size == 4
    assert plan.norm["global_num_tokens"] == 15  # all four rows' tokens
    (none_left,) = plan_updates(
        td, settings(epochs=1, shuffle=False), 1, skip_rows=torch.ones(4, dtype=torch.bool)
    )
    assert none_left.rows == [[0]] and none_left.skipped == [1, 2, 3]  # one row keeps the step


def test_skipped_rows_add_their_share_and_token_mean_entropy_to_the_metrics():
    # Two mini-batches of 2 rows (tokens 6+1 and 6+2); rows 0 and 3 are left out. Their entropies are
    # 0.5 on each of 6 tokens and 2.0 on each of 2: token-mean over each mini-batch's 7 and 8 tokens,
    # 3/7 and 4/8, averaged over the 2 steps; half of each mini-batch skipped.
    td = batch([6, 1, 6, 2], uids=[0, 1, 2, 3])
    skip = torch.tensor([True, False, False, True])
    plans = plan_updates(td, settings(rows_per_mini=2, epochs=1, shuffle=False), 1, skip_rows=skip)
    assert [p.skipped for p in plans] == [[0], [3]]
    entropies = [torch.full((1, 6), 0.5), torch.full((1, 6), 2.0)]
    metrics = skipped_rows_metrics(td, plans, "token-mean", entropies)
    assert metrics["actor/zero_adv_rows_skipped"] == 0.5
    assert abs(metrics["actor/entropy"] - (3 / 7 + 4 / 8) / 2) < 1e-6  # float32 sums of ≤ 8 terms
    # an entropy nobody can report (no sampler entropy, calculate_entropy off): no entropy metric
    assert "actor/entropy" not in skipped_rows_metrics(td, plans, "token-mean", [entropies[0], None])


def test_prompts_split_into_consecutive_near_equal_shares():
    assert [list(r) for r in contiguous_split(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in contiguous_split(2, 3)] == [[0], [1], []]


@pytest.mark.parametrize("device_frees", [False, True])
def test_an_update_frees_its_gradients_where_the_device_says_so(monkeypatch, device_frees):
    # On a GPU (free_gradients) the last step's gradients are freed once the update is done: the
    # rollout and the other role's update need the memory. On a CPU they stay to the next update's
    # first mini-batch (re-faulting fresh pages cost 2-3% of the embedded run's update).
    from types import SimpleNamespace

    from tearless.config import load_config

    assert (
        not devices.device_defaults("cpu").free_gradients and devices.device_defaults("cuda").free_gradients
    )
    if device_frees:
        monkeypatch.setattr(schedule, "device_defaults", lambda _: devices.device_defaults("cuda"))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    params = list(model.parameters())
    optimizer, scheduler = make_optimizer(
        params, load_config(None).actor_rollout_ref.actor.optim, total_steps=2
    )
    td = batch([2, 2, 2, 2])
    td["x"] = torch.randn(4, 3)
    s = UpdateSettings(
        rows_per_mini=2, epochs=1, shuffle=False, micro_size=None, token_budget=None, grad_clip=1.0,
        prefix="actor",
    )  # fmt: skip
    role = SimpleNamespace(
        model=model, params=params, optimizer=optimizer, scheduler=scheduler, skipped_steps=0, settings=s,
        micro_loss=lambda mb, norm, flags: (model(mb["x"]).sum(), {}),
    )  # fmt: skip
    ((rows, steps),) = rank_work(td, plan_updates(td, s, 1), 1)
    run_plan(role, rows, steps, UpdateFlags())
    assert role.optimizer.state[model.weight]["step"] == 2  # both mini-batches stepped
    assert all((p.grad is None) == device_frees for p in params)
