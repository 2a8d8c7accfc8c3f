"""One context for tensors or forwards swapped into a model's modules for a region (the compiled
layers of :mod:`tearless.models.compiled`, the compute copies of :mod:`tearless.models.copies`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Swap:
    """Something swapped into a model for a region: :meth:`swap_in` when the outermost region starts,
    :meth:`swap_out` when it ends (a pass entered from inside another keeps the swap)."""

    depth = 0

    def swap_in(self) -> None:
        raise NotImplementedError

    def swap_out(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The swap in place for the region."""
        if self.depth:
            yield
            return
        self.depth = 1
        self.swap_in()
        try:
            yield
        finally:
            self.swap_out()
            self.depth = 0
