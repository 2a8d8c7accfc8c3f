"""Tool calls in a model's text, per chat-template family, as OpenAI ``tool_calls``.

Families (``detect_family`` picks one from the chat template's text):

- ``hermes`` (Hermes, Qwen 2.5 / Qwen 3 and most templates with a ``<tool_call>`` tag):
  ``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, several per turn.
- ``llama3`` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the turn is one JSON object
  ``{"name": "f", "parameters": {...}}`` (or several separated by ``;``), optionally after
  ``<|python_tag|>``.
- ``mistral``: ``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]`` (v3 tokenizers) or
  ``[TOOL_CALLS]f[ARGS]{...}`` (v11+), several calls each with its own ``[TOOL_CALLS]``.

Parsing never raises: text that announces a call but does not parse gives ``problem`` (for the
environment to answer), text without a call is plain content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "llama3", "mistral")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_MISTRAL_ARGS = re.compile(r"\[TOOL_CALLS\]\s*([A-Za-z_][\w.-]*)\s*\[ARGS\]", re.DOTALL)


@dataclass
class ParsedTurn:
    """A model turn: its text without the calls, the calls (OpenAI form), and why a call failed."""

    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    problem: str | None = None

    def message(self) -> dict[str, Any]:
        """The turn as an OpenAI assistant message."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def tag_blocks(text: str, open_tag: str, close_tag: str, limit: int | None = None) -> list[tuple[int, int]]:
    """The ``(start, end)`` content spans of the closed ``open_tag…close_tag`` blocks, left to right.

    The blocks the lazy regex ``open(.*?)close`` (DOTALL) finds, in O(len(text)): that regex tries
    every opening tag against the rest of the text, n² work for n unterminated tags (8,000 took 10.8
    s). Once an opening tag has no closing tag after it, no later one has either, so the scan stops.
    With ``limit``, it stops after ``limit`` + 1 blocks (enough to know the limit was passed).
    """
    spans: list[tuple[int, int]] = []
    pos = 0
    while limit is None or len(spans) <= limit:
        start = text.find(open_tag, pos)
        if start < 0:
            break
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            break
        spans.append((start + len(open_tag), end))
        pos = end + len(close_tag)
    return spans


def too_many_calls(max_calls: int) -> str:
    """The problem of a turn with more than ``max_calls`` calls (the budget's config key names it)."""
    return f"more than {max_calls} tool calls in one turn"


def detect_family(chat_template: str | None) -> str:
    """The family whose call syntax the template's text mentions; ``hermes`` when none does."""
    text = chat_template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3"
    return "hermes"


def openai_call(name: str, arguments: dict[str, Any], index: int) -> dict[str, Any]:
    """``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``."""
    return {
        "id": f"call_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def _loads(text: str) -> tuple[Any, str | None]:
    try:
        return json.loads(text), None
    except (ValueError, RecursionError) as e:  # model output is untrusted: never raise
        return None, f"tool call is not valid JSON ({type(e).__name__})"


def _call(obj: Any, args_key: str, index: int) -> tuple[dict | None, str | None]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None, 'a tool call needs {"name": ..., "arguments": {...}}'
    arguments = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(arguments, str):
        arguments, problem = _loads(arguments)
        if problem:
            return None, problem
    if not isinstance(arguments, dict):
        return None, "tool call arguments must be a JSON object"
    return openai_call(obj["name"], arguments, index), None


def parse_tool_calls(text: str, family: str, max_calls: int | None = None) -> ParsedTurn:
    """The calls in ``text`` (decoded without the turn's EOS) for ``family``; a turn with more than
    ``max_calls`` calls is a ``problem`` (``multi_turn.max_tool_calls_per_turn``), none of them run."""
    parsed = _parse(text, family, max_calls)
    if max_calls is not None and len(parsed.tool_calls) > max_calls:
        return ParsedTurn(text.strip(), problem=too_many_calls(max_calls))
    return parsed


def _parse(text: str, family: str, max_calls: int | None) -> ParsedTurn:
    if family == "hermes":
        spans = tag_blocks(text, _OPEN, _CLOSE, max_calls)
        if not spans:
            return ParsedTurn(text.strip())
        calls = []
        for i, (start, end) in enumerate(spans):
            obj, problem = _loads(text[start:end].strip())
            call, problem = (None, problem) if problem else _call(obj, "arguments", i)
            if problem:
                return ParsedTurn(text.strip(), problem=problem)
            calls.append(call)
        outside = zip(
            [0] + [end + len(_CLOSE) for _, end in spans],
            [s - len(_OPEN) for s, _ in spans] + [len(text)],
            strict=True,
        )
        return ParsedTurn("".join(text[a:b] for a, b in outside).strip(), calls)
    if family == "llama3":
        body = text.replace("<|python_tag|>", "").strip()
        if not body.startswith("{"):
            return ParsedTurn(text.strip())
        calls, pos, decoder = [], 0, json.JSONDecoder()
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except (ValueError, RecursionError) as e:  # model output is untrusted: never raise
                return ParsedTurn(text.strip(), problem=f"tool call is not valid JSON ({type(e).__name__})")
            call, problem = _call(obj, "parameters", len(calls))
            if problem:
                return ParsedTurn(text.strip(), problem=problem)
            calls.append(call)
            pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip())
        return ParsedTurn("", calls)
    if family == "mistral":
        if "[TOOL_CALLS]" not in text:
            return ParsedTurn(text.strip())
        content, _, rest = text.partition("[TOOL_CALLS]")
        rest = "[TOOL_CALLS]" + rest
        calls = []
        if _MISTRAL_ARGS.search(rest):
            pieces = _MISTRAL_ARGS.split(rest)  # ["", name, args, name, args, ...]
            for i, (name, args) in enumerate(zip(pieces[1::2], pieces[2::2], strict=True)):
                obj, problem = _loads(args.strip())
                call, problem = (
                    (None, problem) if problem else _call({"name": name, "arguments": obj}, "arguments", i)
                )
                if problem:
                    return ParsedTurn(text.strip(), problem=problem)
                calls.append(call)
        else:
            obj, problem = _loads(rest.replace("[TOOL_CALLS]", "", 1).strip())
            if problem is None and not isinstance(obj, list):
                problem = "[TOOL_CALLS] must be followed by a JSON list of calls"
            for i, item in enumerate(obj if problem is None else []):
                call, problem = _call(item, "arguments", i)
                if problem:
                    break
                calls.append(call)
            if problem:
                return ParsedTurn(text.strip(), problem=problem)
        return ParsedTurn(content.strip(), calls)
    raise ValueError(f"tool-call family {family!r} is not one of {', '.join(FAMILIES)}")
