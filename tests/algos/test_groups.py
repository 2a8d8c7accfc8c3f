import numpy as np
import pytest
import torch

from tearless.algos.groups import group_ids, group_reduce, group_sizes


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
