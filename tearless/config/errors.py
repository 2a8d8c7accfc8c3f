"""The one error a config problem raises, and the small checks every config's validation is built from
(the RL config's ``validate_*.py``, ``tearless sft``/``dpo``/``rm``'s and Flow-GRPO's configs): each
raises :class:`ConfigError` as one line naming the key, the value and the fix."""

from __future__ import annotations

import os

from tearless.userfiles import UserFileError, check_user_file

# Choices several configs offer under the same key.
DEVICES = ("auto", "cpu", "cuda")
SCHEDULERS = ("constant", "cosine")
RESUME_MODES = ("auto", "disable", "resume_path")


class ConfigError(ValueError):
    """A configuration problem, with the key and the fix in the message."""


def fail(key: str, problem: str, fix: str) -> None:
    """Raise :class:`ConfigError` as ``"<key>: <problem>. <fix>"``."""
    raise ConfigError(f"{key}: {problem}. {fix}")


def one_of(key: str, value: object, valid: tuple | list) -> None:
    """Fail unless ``value`` is one of ``valid``."""
    if value not in valid:
        fail(key, f"{value!r} is not one of {', '.join(map(str, valid))}", "Pick one of those.")


def positive(key: str, value: float, *, allow_zero: bool = False) -> None:
    """Fail unless ``value`` is a number > 0 (>= 0 with ``allow_zero``)."""
    if not isinstance(value, (int, float)):
        fail(key, f"must be a number, got {value!r}", "Set a number.")
    if value < 0 or (value == 0 and not allow_zero):
        fail(key, f"must be {'>= 0' if allow_zero else '> 0'}, got {value}", "Set a positive value.")


def count(key: str, value: object, fix: str) -> None:
    """Fail unless ``value`` is an integer >= 0 (a bool is not one, though Python counts it as an int)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        fail(key, f"must be an integer >= 0, got {value!r}", fix)


def in_range(
    key: str,
    value: float,
    low: float,
    high: float,
    fix: str,
    *,
    low_open: bool = False,
    high_open: bool = False,
    problem: str = "must be in {interval}, got {value}",
) -> None:
    """Fail unless ``low <= value <= high`` (``<`` on an open side; NaN is outside every interval).

    ``problem`` words the failure from ``{interval}`` (``[0, 1)``, written with ``low`` and ``high`` as
    given, so ``0.0`` prints as ``0.0``) and ``{value}``."""
    inside = (low < value if low_open else low <= value) and (value < high if high_open else value <= high)
    if not inside:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        fail(key, problem.format(interval=interval, value=value), fix)


def user_file(key: str, path: str, kind: str) -> None:
    """Fail unless ``path`` is a regular file within ``kind``'s cap (:mod:`tearless.userfiles`): a FIFO
    there would block the run when the file is read, a link to a device would read without end."""
    try:
        check_user_file(path, key=key, kind=kind)
    except UserFileError as e:
        raise ConfigError(str(e)) from None


def existing_file(key: str, path: str, kind: str, fix: str) -> None:
    """Fail unless ``path`` exists (a dangling link counts, and :func:`user_file` then names it) and is a
    user file of ``kind``."""
    if not os.path.lexists(path):
        fail(key, f"{path!r} is not a file", fix)
    user_file(key, path, kind)
