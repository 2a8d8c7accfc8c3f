"""The user's modules every process of a run imports: ``actor_rollout_ref.model.external_lib``.

A loss mode, advantage estimator or reward function registered in a user's module is known to a
process only once that module is imported there. The trainer's process imports the modules before it
validates the config (so a registered name passes validation) and every rank imports them before it
builds its roles (Ray actors too: they are other processes). veRL's key: a module name, or a list.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from tearless.config.errors import fail

KEY = "actor_rollout_ref.model.external_lib"


def external_libs(value: Any) -> list[str]:
    """The module names of ``external_lib``: null = none, a name, or a list of names."""
    if value is None:
        return []
    names = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    if not all(isinstance(n, str) and n.strip() for n in names):
        fail(KEY, f"must be a module name or a list of module names, got {value!r}", "e.g. my_pkg.losses")
    return [n.strip() for n in names]


def import_external_libs(model: Any) -> None:
    """Import every module the model section ``model`` (``actor_rollout_ref.model``) names in
    ``external_lib`` (a module already imported is not re-run)."""
    for name in external_libs(model.external_lib):
        try:
            importlib.import_module(name)
        except Exception as e:  # any failure of the user's module: one line naming it, not a traceback
            fail(
                KEY,
                f"cannot import {name!r} ({type(e).__name__}: {e})",
                "Put the module on PYTHONPATH (every node's, with Ray) or fix its name.",
            )
