"""Batches of prompts whose order depends only on (seed, epoch, batch number).

The order of epoch ``e`` is a permutation drawn from a ``torch.Generator`` seeded with ``seed + e``,
so a run resumed at (epoch, batch) sees exactly the batches it would have seen, with no sampler
state in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from tearless.data.rows import DataError


class PromptLoader:
    """Fixed-size batches of dataset items (``data.train_batch_size`` prompts each).

    Args:
        dataset: any sequence of items, usually a :class:`~tearless.data.PromptDataset`; items are
            fetched with ``dataset[i]``, which for a ``PromptDataset`` returns a copy.
        batch_size: prompts per batch.
        shuffle: a new permutation every epoch; ``False`` keeps the dataset order.
        seed: the permutation of epoch ``e`` comes from seed ``seed + e``.
        drop_last: drop the last, short batch of each epoch (veRL's default: every step then has the
            same number of prompts, which the batch-size divisibility checks rely on).
    """

    def __init__(
        self,
        dataset: Sequence[dict],
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise DataError(f"data.train_batch_size must be a positive integer, got {batch_size!r}")
        if len(dataset) == 0:
            raise DataError("the dataset has no rows")
        if drop_last and batch_size > len(dataset):
            raise DataError(
                f"data.train_batch_size={batch_size} is larger than the dataset, which has {len(dataset)} "
                f"rows, so no full batch can be made; lower data.train_batch_size to at most {len(dataset)}"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._order_epoch: int | None = None
        self._order: list[int] = []

    @property
    def num_batches(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        return self.num_batches

    def _epoch_order(self, epoch: int) -> list[int]:
        # Cached for the current epoch: the trainer asks for its batches one after another.
        if self._order_epoch != epoch:
            n = len(self.dataset)
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._order = torch.randperm(n, generator=generator).tolist()
            else:
                self._order = list(range(n))
            self._order_epoch = epoch
        return self._order

    def batch(self, epoch: int, i: int) -> list[dict]:
        """Batch ``i`` (from 0) of ``epoch``: the same items every time it is asked for."""
        if not 0 <= i < self.num_batches:
            raise IndexError(f"batch {i} is out of range: an epoch has {self.num_batches} batches")
        positions = self._epoch_order(epoch)[i * self.batch_size : (i + 1) * self.batch_size]
        return [self.dataset[p] for p in positions]

    def __iter__(self) -> Iterator[list[dict]]:
        """The batches of epoch 0; the trainer calls :meth:`batch` with its own epoch counter."""
        for i in range(self.num_batches):
            yield self.batch(0, i)
