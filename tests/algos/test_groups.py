import numpy as np
import pytest
import torch

from tearless.algos.groups import (
    first_groups,
    group_ids,
    group_reduce,
    group_sizes,
    groups_within,
    num_groups,
)


def test_group_ids_by_equality_for_every_id_type():
    expected = [0, 1, 0, 2]
    assert group_ids(["u1", "u2", "u1", "u3"], 4).tolist() == expected
    assert group_ids([7, 3, 7, 9], 4).tolist() == expected  # numbered in order of first appearance
    assert group_ids(torch.tensor([7, 3, 7, 9]), 4).tolist() == [1, 0, 1, 2]  # tensors: in sorted order
    assert group_ids(np.array(["a", "b", "a", "c"], dtype=object), 4).tolist() == expected
    # 0-d tensors hash by identity; they must still be grouped by value.
    assert (
        group_ids([torch.tensor(5), torch.tensor(6), torch.tensor(5), torch.tensor(8)], 4).tolist()
        == expected
    )


def test_group_ids_rejects_wrong_length_and_shape():
    with pytest.raises(ValueError, match="index has 2 entries but the batch has 3"):
        group_ids(["a", "b"], 3)
    with pytest.raises(ValueError, match="1-D"):
        group_ids(torch.zeros(2, 2), 4)


def test_group_reduce_and_sizes():
    ids = torch.tensor([0, 1, 0, 2])
    values = torch.tensor([1.0, 5.0, 3.0, -2.0])
    assert group_reduce(values, ids).tolist() == [4.0, 5.0, -2.0]  # 1 + 3, 5, −2
    assert group_reduce(values, ids, "amax").tolist() == [3.0, 5.0, -2.0]
    assert group_reduce(values, ids, "amin").tolist() == [1.0, 5.0, -2.0]
    assert group_sizes(ids).tolist() == [2.0, 1.0, 2.0, 1.0]


def test_selection_by_uid_when_a_groups_rows_are_apart():
    # Rows (uid): 0 a, 1 b, 2 a, 3 c, 4 b, 5 c. Groups in first-appearance order: a, b, c.
    uids = ["a", "b", "a", "c", "b", "c"]
    assert num_groups(uids) == 3 and num_groups([]) == 0
    # Dynamic sampling kept b and c (a flat): the first group of those is b, the first two b and c.
    spread = torch.tensor([False, True, False, True, True, True])
    assert first_groups(uids, spread, 1).tolist() == [1, 4]
    assert first_groups(uids, spread, 2).tolist() == [1, 3, 4, 5]
    assert first_groups(uids, torch.zeros(6, dtype=torch.bool), 2).tolist() == []
    # Staleness per row; bound 1: a (0, 1) and c (1, 0) kept, b (0, 2) dropped whole.
    staleness = torch.tensor([0, 0, 1, 1, 2, 0])
    assert groups_within(staleness, uids, 1).tolist() == [0, 2, 3, 5]
