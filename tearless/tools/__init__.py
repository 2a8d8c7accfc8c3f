"""Tools for the multi-turn agent loop (:mod:`tearless.rollout.agent`): local BM25 search, a
sandboxed Python runner, and user tools loaded from a tool YAML."""

from tearless.tools.base import Tool, ToolLike, argument_problem, function_schema
from tearless.tools.execute import ToolCall, ToolResult, run_calls
from tearless.tools.registry import load_tools, register_tool

__all__ = [
    "Tool",
    "ToolCall",
    "ToolLike",
    "ToolResult",
    "argument_problem",
    "function_schema",
    "load_tools",
    "register_tool",
    "run_calls",
]
