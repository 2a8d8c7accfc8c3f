import pytest
import torch

from tearless.algos import filter_groups, overlong_penalty


def test_overlong_penalty_hand_worked():
    # L_max = 20, buffer 4 → expected length 16; penalty −(L − 16)/4 · 1, capped at 0 from above.
    lengths = torch.tensor([10, 16, 18, 20])
    assert overlong_penalty(lengths, 20, 4, 1.0).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, -0.25, -0.5]


def test_overlong_penalty_validates_the_buffer():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(torch.tensor([3]), 20, 0, 1.0)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(torch.tensor([3]), 20, 21, 1.0)


def test_filter_groups_keeps_groups_with_spread():
    # a: (1, 1) all equal → drop; b: (0, 1) → keep; c: (2, 2) → drop; d: singleton → drop.
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 5.0])
    index = ["a", "a", "b", "b", "c", "c", "d"]
    assert filter_groups(scores, index).tolist() == [False, False, True, True, False, False, False]
    # Alignment by id: interleaved rows give the same decision per row.
    interleaved = [0, 2, 4, 6, 1, 3, 5]
    kept = filter_groups(scores[interleaved], [index[i] for i in interleaved])
    assert kept.tolist() == [False, True, False, False, False, True, False]
