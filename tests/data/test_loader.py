import pytest
import torch

from tearless.data import DataError, PromptDataset, PromptLoader

from .helpers import make_row


@pytest.fixture(scope="module")
def dataset(tokenizer):
    return PromptDataset([make_row(f"{i}+0=", str(i)) for i in range(10)], tokenizer)


def indices(batch):
    return [item["index"] for item in batch]


def test_order_is_randperm_of_seed_plus_epoch(dataset):
    loader = PromptLoader(dataset, 5, seed=7)
    for epoch in (0, 3):
        expected = torch.randperm(10, generator=torch.Generator().manual_seed(7 + epoch)).tolist()
        assert indices(loader.batch(epoch, 0)) + indices(loader.batch(epoch, 1)) == expected


def test_deterministic_and_resumable(dataset):
    loader = PromptLoader(dataset, 3, seed=1)
    first = [indices(loader.batch(e, i)) for e in range(3) for i in range(loader.num_batches)]
    # A fresh loader (a resumed run) asked out of order gives the same batches.
    resumed = PromptLoader(dataset, 3, seed=1)
    assert indices(resumed.batch(2, 1)) == first[2 * 3 + 1]
    assert [indices(resumed.batch(e, i)) for e in range(3) for i in range(3)] == first


def test_epochs_and_seeds_differ(dataset):
    loader = PromptLoader(dataset, 10, seed=0)
    epochs = [indices(loader.batch(e, 0)) for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]
    assert indices(PromptLoader(dataset, 10, seed=1).batch(0, 0)) == epochs[1]


def test_each_row_once_per_epoch(dataset):
    loader = PromptLoader(dataset, 5)
    for epoch in range(4):
        served = [i for b in range(loader.num_batches) for i in indices(loader.batch(epoch, b))]
        assert sorted(served) == list(range(10))


def test_drop_last(dataset):
    loader = PromptLoader(dataset, 4)
    assert loader.num_batches == len(loader) == 2
    served = indices(loader.batch(0, 0)) + indices(loader.batch(0, 1))
    assert len(set(served)) == 8
    with pytest.raises(IndexError, match="batch 2 is out of range: an epoch has 2 batches"):
        loader.batch(0, 2)
    keep = PromptLoader(dataset, 4, drop_last=False)
    assert keep.num_batches == 3
    assert [len(keep.batch(0, i)) for i in range(3)] == [4, 4, 2]


def test_no_shuffle_and_iter(dataset):
    loader = PromptLoader(dataset, 5, shuffle=False)
    assert [indices(b) for b in loader] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    shuffled = PromptLoader(dataset, 5, seed=4)
    assert [indices(b) for b in shuffled] == [indices(shuffled.batch(0, i)) for i in range(2)]


def test_items_are_copies(dataset):
    loader = PromptLoader(dataset, 10, shuffle=False)
    loader.batch(0, 0)[0]["input_ids"].clear()
    assert loader.batch(0, 0)[0]["input_ids"] == dataset[0]["input_ids"] != []


def test_batch_larger_than_dataset(dataset):
    with pytest.raises(DataError, match=r"data.train_batch_size=16 .* has 10 rows.* at most 10"):
        PromptLoader(dataset, 16)
    assert PromptLoader(dataset, 16, drop_last=False).num_batches == 1
    with pytest.raises(DataError, match="positive integer, got 0"):
        PromptLoader(dataset, 0)
