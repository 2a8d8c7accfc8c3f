"""Running a batch of tool calls: concurrently, bounded, each with a timeout, never raising.

Every call of a rollout turn (all samples together) goes through :func:`run_calls`. Sync tools run in
threads, async tools on the event loop; at most ``max_parallel`` run at once. A call that raises,
hangs past ``timeout_s``, names an unknown tool or has arguments that do not fit the schema returns an
``error: …`` string for the model and is flagged, so one bad call never stops the rollout. A sync tool
that hangs cannot be interrupted (Python threads cannot be killed): its thread is a daemon thread that
is abandoned, so neither the rollout nor the interpreter's exit waits for it.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tearless.tools.base import ToolLike, argument_problem

T = TypeVar("T")


@dataclass
class ToolCall:
    """One call: the tool's name and its arguments (already parsed)."""

    name: str
    arguments: Any


@dataclass
class ToolResult:
    text: str
    error: bool


def in_daemon_thread(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> asyncio.Future:
    """``fn()`` in a daemon thread, its result (or exception) delivered to a future of ``loop``."""
    future = loop.create_future()

    def deliver(value: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled by the timeout meanwhile
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def target() -> None:
        try:
            value, error = fn(), None
        except BaseException as e:  # delivered to the caller, who turns it into an error string
            value, error = None, e
        try:
            loop.call_soon_threadsafe(deliver, value, error)
        except RuntimeError:  # the loop is closed: the call timed out long ago and nobody waits
            pass

    threading.Thread(target=target, daemon=True, name="tearless-tool").start()
    return future


def gated(
    loop: asyncio.AbstractEventLoop,
    jobs: list[Callable[[asyncio.Semaphore], Awaitable[T]]],
    max_parallel: int,
) -> list[T]:
    """The results of ``jobs``, in order: each ``job(gate)`` runs concurrently on ``loop``, and at most
    ``max_parallel`` of them hold the shared ``gate`` (a semaphore) at once."""

    async def main() -> list[T]:
        gate = asyncio.Semaphore(max_parallel)
        return list(await asyncio.gather(*(job(gate) for job in jobs)))

    return loop.run_until_complete(main())


async def _one(
    call: ToolCall, tools: dict[str, ToolLike], gate: asyncio.Semaphore, timeout_s: float
) -> ToolResult:
    tool = tools.get(call.name)
    if tool is None:
        return ToolResult(f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}", True)
    problem = argument_problem(tool.parameters, call.arguments)
    if problem:
        return ToolResult(f"error: {call.name}: {problem}", True)
    async with gate:
        try:
            if inspect.iscoroutinefunction(tool.call):
                result = await asyncio.wait_for(tool.call(**call.arguments), timeout_s)
            else:
                future = in_daemon_thread(asyncio.get_running_loop(), lambda: tool.call(**call.arguments))
                result = await asyncio.wait_for(future, timeout_s)
                if inspect.isawaitable(result):
                    result = await asyncio.wait_for(result, timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(f"error: {call.name} timed out after {timeout_s:g} s", True)
        except Exception as e:  # a tool's failure is the model's information, not the rollout's crash
            return ToolResult(f"error: {call.name} failed: {type(e).__name__}: {e}", True)
    return ToolResult(str(result), False)


def run_calls(
    calls: list[ToolCall], tools: dict[str, ToolLike], *, max_parallel: int, timeout_s: float
) -> list[ToolResult]:
    """Results of ``calls``, in order (see the module docstring)."""
    if not calls:
        return []
    loop = asyncio.new_event_loop()
    try:
        return gated(loop, [lambda gate, c=c: _one(c, tools, gate, timeout_s) for c in calls], max_parallel)
    finally:
        loop.close()
