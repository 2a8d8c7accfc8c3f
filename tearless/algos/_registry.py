"""Name → function registries shared by the algos modules.

Every family of math functions (advantage estimators, policy losses, aggregation modes, KL estimators,
DPO losses) lives in a plain ``dict[str, Callable]``. Dispatchers look names up with :func:`lookup`, so
an unknown name always fails with the list of known ones, and call the function with
:func:`call_accepted`, so each function declares in its own signature exactly the inputs it uses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def registrar(registry: dict[str, Callable[..., Any]], what: str) -> Callable[..., Callable[[F], F]]:
    """Make a decorator ``@register(name, *aliases)`` that files a function under every given name."""

    def register(*names: str) -> Callable[[F], F]:
        def decorate(fn: F) -> F:
            for name in names:
                if name in registry:
                    raise ValueError(f"{what} {name!r} is already registered")
                registry[name] = fn
            return fn

        return decorate

    return register


def lookup(registry: Mapping[str, Callable[..., Any]], name: str, what: str) -> Callable[..., Any]:
    """``registry[name]``, or a ValueError that lists the known names."""
    try:
        return registry[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(registry))}") from None


def call_accepted(fn: Callable[..., Any], inputs: Mapping[str, Any], what: str) -> Any:
    """Call ``fn`` with the entries of ``inputs`` its signature names, ignoring the rest.

    A parameter without a default that is missing from ``inputs`` or given as None raises a ValueError
    naming it, so e.g. GAE without critic values fails with "needs values" rather than deep inside.
    """
    params = inspect.signature(fn).parameters
    for name, param in params.items():
        required = param.default is inspect.Parameter.empty and param.kind is not param.VAR_KEYWORD
        if required and inputs.get(name) is None:
            raise ValueError(f"{what} needs {name!r}")
    return fn(**{k: v for k, v in inputs.items() if k in params})


def accepted_names(registry: Mapping[str, Callable[..., Any]]) -> set[str]:
    """Every parameter name that some function of ``registry`` accepts."""
    return {name for fn in registry.values() for name in inspect.signature(fn).parameters}
