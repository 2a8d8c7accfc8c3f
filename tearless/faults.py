"""Deterministic fault injection for the crash tests: die with SIGKILL at a named point of a run.

``TEARLESS_FAULT=<point>:<step>[,<point>:<step>…]`` makes the process kill itself (SIGKILL: no
``finally``, no flushing, no atexit) the first time it reaches ``point`` during training step
``step``. The points, in the order one RL step reaches them:

- ``rollout``: before the responses are generated;
- ``reward``: after generation, before scoring (reward workers are alive);
- ``update``: after advantages, before the actor's optimizer steps (the offline trainers: before
  the step's forward);
- ``metrics``: before the step's metrics line is written;
- ``checkpoint_write``: inside a checkpoint save, with the weights written to the hidden
  temporary directory but not the trainer state or the completion marker;
- ``checkpoint_rename``: after the checkpoint was renamed into place, before the
  ``latest_checkpointed_iteration.txt`` pointer is rewritten.

The variable is read at each call (so a forked process may set its own) and parsed once per value;
when it is unset :func:`point` is one dictionary lookup. Nothing here acts unless the variable is
set, which only the fault tests do.
"""

from __future__ import annotations

import os
import signal

ENV = "TEARLESS_FAULT"
POINTS = ("rollout", "reward", "update", "metrics", "checkpoint_write", "checkpoint_rename")


def parse(spec: str | None) -> dict[str, set[int]]:
    """``"reward:3,checkpoint_write:2"`` → ``{"reward": {3}, "checkpoint_write": {2}}``."""
    plan: dict[str, set[int]] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        name, _, step = item.strip().partition(":")
        if name not in POINTS or not step.lstrip("-").isdigit():
            raise ValueError(
                f"{ENV}={spec!r}: {item!r} is not <point>:<step> with a point among {', '.join(POINTS)}"
            )
        plan.setdefault(name, set()).add(int(step))
    return plan


_parsed: tuple[str, dict[str, set[int]]] = ("", {})


def point(name: str, step: int) -> None:
    """SIGKILL this process if ``TEARLESS_FAULT`` names ``name`` at ``step``."""
    global _parsed
    spec = os.environ.get(ENV)
    if not spec:
        return
    if spec != _parsed[0]:
        _parsed = (spec, parse(spec))
    if step in _parsed[1].get(name, ()):
        os.kill(os.getpid(), signal.SIGKILL)
