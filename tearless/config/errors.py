"""The one error a config problem raises, and the checks that raise it naming the key and the fix."""

from __future__ import annotations


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
