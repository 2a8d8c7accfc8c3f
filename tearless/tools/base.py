"""What a tool is: a name, a JSON schema of its arguments and a call that returns text.

A tool is any object with ``name`` (str), ``description`` (str), ``parameters`` (a JSON schema of an
object: ``{"type": "object", "properties": {...}, "required": [...]}``) and ``call(**arguments)``,
which may be a plain function or ``async``. :class:`Tool` is a convenient base class; user classes do
not have to inherit from it. The agent loop checks the arguments against the schema before calling
(:func:`argument_problem`), so a malformed call becomes an error message for the model, never an
exception in the rollout.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol, runtime_checkable

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


@runtime_checkable
class ToolLike(Protocol):
    """The structural type the agent loop accepts."""

    name: str
    description: str
    parameters: dict

    def call(self, **arguments: Any) -> str | Awaitable[str]: ...


class Tool:
    """Base class of the built-in tools; subclasses set the three attributes and ``call``."""

    name: str = ""
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}  # noqa: RUF012

    def call(self, **arguments: Any) -> str | Awaitable[str]:
        raise NotImplementedError(f"tool {self.name!r} does not define call()")


def function_schema(tool: ToolLike) -> dict:
    """The OpenAI / chat-template form: ``{"type": "function", "function": {name, description,
    parameters}}``."""
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def argument_problem(parameters: dict, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the schema ``parameters`` (a missing required key, an unknown key,
    a wrong JSON type), or None when they do. Only the top level is checked."""
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    properties = parameters.get("properties", {})
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}"
    for key, value in arguments.items():
        if key not in properties:
            if parameters.get("additionalProperties", True) is False or properties:
                return f"unknown argument {key!r}; expected {', '.join(sorted(properties)) or 'none'}"
            continue
        kind = properties[key].get("type")
        allowed = _JSON_TYPES.get(kind) if isinstance(kind, str) else None
        if allowed is None:
            continue
        if isinstance(value, bool) and kind in ("integer", "number"):
            return f"argument {key!r} must be {kind}, got boolean"
        if not isinstance(value, allowed):
            return f"argument {key!r} must be {kind}, got {type(value).__name__}"
    return None


def first_string_parameter(parameters: dict) -> str | None:
    """The argument a tag-style call (``<search>text</search>``) fills: the first required string
    property, else the first string property."""
    properties = parameters.get("properties", {})
    for key in [*parameters.get("required", []), *properties]:
        if properties.get(key, {}).get("type") == "string":
            return key
    return None
