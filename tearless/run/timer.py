"""Timing of a step's phases, shared by the trainer's loop and the ranks it calls."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager


class Timer:
    """Collects ``timing_s/<name>`` for each phase of a step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}
