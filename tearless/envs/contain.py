"""Running untrusted episode code (an environment's reset/step, an agent program) so that one
episode's exception or hang costs that episode, never the run.

Each call runs concurrently with the others of its batch (at most ``max_parallel`` at once) and with
a timeout: a plain function in a daemon thread (Python cannot kill a thread; a hung one is abandoned
and does not block the interpreter's exit), a coroutine on the batch's event loop. The result is an
:class:`Outcome`: the value, or the error as one line plus its traceback.
"""

from __future__ import annotations

import asyncio
import inspect
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tearless.tools.execute import gated, in_daemon_thread


@dataclass
class Outcome:
    value: Any = None
    error: str | None = None
    timed_out: bool = False
    traceback: str | None = None


async def _contained(fn: Callable[[], Any], gate: asyncio.Semaphore, timeout_s: float, what: str) -> Outcome:
    async with gate:
        try:
            if inspect.iscoroutinefunction(fn):
                value = await asyncio.wait_for(fn(), timeout_s)
            else:
                value = await asyncio.wait_for(in_daemon_thread(asyncio.get_running_loop(), fn), timeout_s)
                if inspect.isawaitable(value):  # a plain function that returned a coroutine
                    value = await asyncio.wait_for(value, timeout_s)
        except asyncio.TimeoutError:
            return Outcome(error=f"{what} timed out after {timeout_s:g} s", timed_out=True)
        except Exception as e:  # the episode's failure, reported, never the run's
            return Outcome(error=f"{what} raised {type(e).__name__}: {e}", traceback=traceback.format_exc())
    return Outcome(value=value)


def run_contained(
    loop: asyncio.AbstractEventLoop,
    calls: list[Callable[[], Any]],
    *,
    max_parallel: int,
    timeout_s: float,
    what: str,
) -> list[Outcome]:
    """The outcomes of ``calls`` in order, run on ``loop`` (see the module docstring)."""
    if not calls:
        return []
    return gated(loop, [lambda gate, c=c: _contained(c, gate, timeout_s, what) for c in calls], max_parallel)
