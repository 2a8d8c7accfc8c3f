"""The reward manager: score a batch of responses with a reward function, safely and in parallel.

A reward function has veRL's signature, ``compute_score(data_source, solution_str, ground_truth,
extra_info=None, **reward_kwargs)``, and returns a float or a dict with a ``score`` key (its other
numeric values are extras to log). It is the built-in dispatcher by default
(:func:`tearless.rewards.compute_score`) or a function loaded with :func:`load_reward_function`
(``custom_reward_function.path`` / ``.name``).

This module does not import torch: forked workers stay light.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import itertools
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tearless.rewards.pool import WorkerPool, evaluate
from tearless.rewards.registry import compute_score, get_scorer, registry_version
from tearless.userfiles import check_user_file

_ITEM_KEYS = ("data_source", "solution_str", "ground_truth", "extra_info")
_module_ids = itertools.count()


class RewardError(RuntimeError):
    """Scoring cannot run at all (the code sandbox cannot start here): stop rather than score 0."""


class RewardFunctionError(ImportError, ValueError):
    """``custom_reward_function.path`` / ``.name`` cannot be loaded; the message names the key and
    the fix. (An ImportError and a ValueError, as the two failures were before it existed.)"""


@dataclass
class ScoreResult:
    """The reward of one sample.

    ``score`` is the reward (``failure_score`` when ``error`` is set); ``extra`` holds the other
    numeric values of a dict result; ``error`` says why the sample failed (the function raised, timed
    out, killed its worker, or returned something that is not a finite number). ``steps`` is None, or
    ``(step_scores, step_ends)`` when the scorer judged each reasoning step (``step_ends`` None: cut
    by the configured separator; see :mod:`tearless.rewards.steps`).
    """

    score: float
    extra: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    steps: tuple[tuple[float, ...], tuple[int, ...] | None] | None = None
    # The reward function's traceback when it raised (printed once per distinct error by the trainer).
    traceback: str | None = field(default=None, compare=False)

    @classmethod
    def from_outcome(cls, outcome: tuple, failure_score: float) -> ScoreResult:
        """The result of a pool outcome, ``("ok", score, extras, steps)`` or ``("err", why[, traceback])``."""
        if outcome[0] == "ok":
            return cls(outcome[1], outcome[2], None, outcome[3])
        return cls(failure_score, {}, outcome[1], traceback=outcome[2] if len(outcome) > 2 else None)


def load_reward_function(path: str | Path, name: str = "compute_score") -> Callable[..., Any]:
    """Import the Python file at ``path`` and return its function ``name``.

    The file is imported as a fresh module each call (so edits are picked up), under a unique name
    registered in ``sys.modules`` (so dataclasses and pickling inside it work).
    """
    file = Path(path).expanduser()
    if not os.path.lexists(file):
        raise FileNotFoundError(
            f"custom_reward_function.path={str(path)!r} does not exist (resolved to {file.resolve()}); "
            "point it at the .py file that defines your reward function"
        )
    check_user_file(file, key="custom_reward_function.path", kind="code")
    module_name = f"_tearless_reward_{file.stem}_{next(_module_ids)}"
    loader = importlib.machinery.SourceFileLoader(module_name, str(file))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(module_name, loader))
    sys.modules[module_name] = module
    try:
        loader.exec_module(module)
    except BaseException as exc:  # SystemExit at import time too
        del sys.modules[module_name]
        raise RewardFunctionError(
            f"custom_reward_function.path={str(path)!r}: importing the file raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(
            key
            for key, value in vars(module).items()
            if callable(value)
            and not key.startswith("_")
            and getattr(value, "__module__", None) == module_name
        )
        what = "is not defined" if fn is None else f"is a {type(fn).__name__}, not a function"
        raise RewardFunctionError(
            f"custom_reward_function.name={name!r} {what} in {file}; the callables it defines are "
            f"{', '.join(defined) or '(none)'}: set custom_reward_function.name to one of them"
        )
    return fn


class RewardManager:
    """Scores batches of responses in a pool of worker processes with a per-sample timeout.

    Args:
        score_fn: the reward function; ``None`` means the built-in dispatcher by ``data_source``.
            Workers are forked, so any callable works (lambdas, closures, notebook functions), but
            they see it as it was when they were forked: the first :meth:`score` call, or when a
            worker is replaced. State the function changes in a worker does not come back.
        num_workers: worker processes. ``0`` scores in this process, which is fastest for trivial
            functions but cannot enforce ``timeout_s`` or survive a function that crashes the
            interpreter.
        timeout_s: wall-clock limit per sample, from when a worker starts it. A sample past it gets
            ``failure_score`` and its worker is killed (SIGKILL) and replaced.
        failure_score: the score of a sample whose function raised, exited, timed out, killed its
            worker twice or returned something that is not a finite number within ±1e6
            (:data:`~tearless.rewards.pool.MAX_ABS_SCORE`).
        reward_kwargs: keyword arguments added to every call (veRL's ``reward_kwargs``).

    Workers are forked, so this needs a platform with ``fork`` (Linux, macOS) when ``num_workers > 0``.
    Use it as a context manager, or call :meth:`close`; it is not thread-safe.
    """

    def __init__(
        self,
        score_fn: Callable[..., Any] | None = None,
        *,
        num_workers: int = 2,
        timeout_s: float = 30.0,
        failure_score: float = 0.0,
        reward_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._pool: WorkerPool | None = None
        self._pool_version: int | None = None
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"reward num_workers must be an integer >= 0, got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"reward timeout_s must be > 0 seconds, got {timeout_s!r}")
        if not math.isfinite(failure_score):
            raise ValueError(f"reward failure_score must be a finite number, got {failure_score!r}")
        if score_fn is not None and not callable(score_fn):
            raise TypeError(f"score_fn must be callable, got {type(score_fn).__name__}")
        reward_kwargs = dict(reward_kwargs or {})
        clash = sorted(set(reward_kwargs) & set(_ITEM_KEYS))
        if clash:
            raise ValueError(f"reward_kwargs cannot set {clash}: those come from each sample")
        if num_workers > 0 and "fork" not in multiprocessing.get_all_start_methods():
            raise ValueError(
                "reward workers need the 'fork' start method, which this platform lacks; use num_workers=0"
            )
        if score_fn is not None:
            _check_signature(score_fn, reward_kwargs)
        self.score_fn = compute_score if score_fn is None else score_fn
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.failure_score = float(failure_score)
        self.reward_kwargs = reward_kwargs
        self._lost_closed = 0  # lost workers of pools already closed

    @property
    def lost_workers(self) -> int:
        """Worker processes that died while scoring (each of their samples rescored once), so far."""
        return self._lost_closed + (self._pool.lost if self._pool is not None else 0)

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (empty before the first :meth:`score` call)."""
        return self._pool.pids if self._pool is not None else []

    def score(self, items: Sequence[dict]) -> list[ScoreResult]:
        """Score ``items``; the i-th result belongs to the i-th item.

        Each item has ``data_source``, ``solution_str``, ``ground_truth`` and ``extra_info``. With the
        built-in dispatcher, an unknown ``data_source`` raises here, before anything is scored.
        """
        requests = []
        for i, item in enumerate(items):
            missing = [key for key in _ITEM_KEYS if key not in item]
            if missing:
                raise ValueError(f"reward item {i} lacks {missing}; it has keys {sorted(item)}")
            requests.append(tuple(item[key] for key in _ITEM_KEYS))
        if self.score_fn is compute_score:
            for source in dict.fromkeys(r[0] for r in requests):
                get_scorer(source)
        if not requests:
            return []
        if self.num_workers == 0:
            # SystemExit too: a scorer calling sys.exit() is a failed sample, not the trainer's end.
            catch = (Exception, SystemExit)
            outcomes = [evaluate(self.score_fn, self.reward_kwargs, r, catch) for r in requests]
        else:
            outcomes = self._get_pool().run(requests)
        fatal = next((o[1] for o in outcomes if o[0] == "fatal"), None)
        if fatal is not None:
            raise RewardError(f"reward scoring cannot run: {fatal}")
        return [ScoreResult.from_outcome(o, self.failure_score) for o in outcomes]

    def close(self) -> None:
        """Stop the worker processes; a later :meth:`score` call starts new ones."""
        if self._pool is not None:
            pool, self._pool = self._pool, None
            self._lost_closed += pool.lost
            pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Also runs on a half-built object and at interpreter exit, when modules may be gone; the
        # workers are daemonic, so multiprocessing reaps them even if this cannot.
        try:
            self.close()
        except Exception:
            pass

    def _get_pool(self) -> WorkerPool:
        # Workers forked before a scorer was registered would not know it.
        version = registry_version() if self.score_fn is compute_score else None
        if self._pool is not None and self._pool_version != version:
            self.close()
        if self._pool is None:
            self._pool = WorkerPool(self.score_fn, self.reward_kwargs, self.num_workers, self.timeout_s)
            self._pool_version = version
        return self._pool


def _check_signature(score_fn: Callable[..., Any], reward_kwargs: dict[str, Any]) -> None:
    # A function that cannot take veRL's keyword arguments would fail every sample, one "raised:
    # TypeError" at a time; say so once, now.
    try:
        signature = inspect.signature(score_fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature to check
        return
    try:
        signature.bind(**dict.fromkeys(_ITEM_KEYS), **reward_kwargs)
    except TypeError as exc:
        name = getattr(score_fn, "__qualname__", repr(score_fn))
        raise TypeError(
            f"reward function {name}{signature} cannot be called as "
            f"{name}(data_source=..., solution_str=..., ground_truth=..., extra_info=...)"
            f"{''.join(f', {k}=...' for k in reward_kwargs)}: {exc}. Name its parameters data_source, "
            "solution_str, ground_truth, extra_info (veRL's contract) and accept every reward_kwargs key"
        ) from exc
