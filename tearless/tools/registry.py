"""Tool classes by name, and loading the tools of a veRL-style tool YAML.

The YAML (``actor_rollout_ref.rollout.multi_turn.tool_config_path``) lists tools::

    tools:
      - class_name: search                 # a registered name, "pkg.module.Class" or "file.py:Class"
        config: {corpus_path: corpus.jsonl, topk: 3}
      - class_name: my_tools.py:Weather     # a user class: name, description, parameters, call()
        config: {}
        tool_schema:                        # optional: overrides the class's name/description/parameters
          type: function
          function: {name: weather, description: ..., parameters: {...}}

Relative paths (``class_name`` files and ``config`` values ending in ``_path``) are resolved against
the YAML's directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tearless.tools.base import ToolLike
from tearless.userfiles import check_user_file, read_user_file

_REGISTRY: dict[str, Callable[..., ToolLike]] = {}


def register_tool(name: str) -> Callable[[type], type]:
    """Class decorator: make ``class_name: <name>`` in a tool YAML build this class."""

    def decorate(cls: type) -> type:
        _REGISTRY[name] = cls
        return cls

    return decorate


def _builtin(name: str) -> Callable[..., ToolLike] | None:
    if name == "search":
        # a built-in tool's module loads only when a config names the tool
        from tearless.tools.search import SearchTool

        return SearchTool
    if name == "python":
        # a built-in tool's module loads only when a config names the tool
        from tearless.tools.python import PythonTool

        return PythonTool
    return _REGISTRY.get(name)


def tool_class(class_name: str, *, base_dir: Path, where: str) -> Callable[..., ToolLike]:
    """The class named by ``class_name`` (see the module docstring)."""
    found = _builtin(class_name)
    if found is not None:
        return found
    if ":" in class_name:
        file, _, attr = class_name.rpartition(":")
        path = Path(file) if Path(file).is_absolute() else base_dir / file
        if not os.path.lexists(path):
            raise ValueError(f"{where}: class_name {class_name!r}: {path} is not a file")
        check_user_file(path, key=f"{where}: class_name", kind="code")
        spec = importlib.util.spec_from_file_location(f"tearless_user_tool_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    elif "." in class_name:
        module_name, _, attr = class_name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"{where}: class_name {class_name!r}: cannot import {module_name} ({e})"
            ) from None
    else:
        known = ", ".join(sorted({"search", "python", *_REGISTRY}))
        raise ValueError(
            f"{where}: unknown tool class_name {class_name!r}; use one of {known}, 'pkg.module.Class' or "
            "'file.py:Class'"
        )
    if not hasattr(module, attr):
        raise ValueError(f"{where}: class_name {class_name!r}: {attr} is not defined there")
    return getattr(module, attr)


def check_tool(tool: Any, where: str) -> ToolLike:
    """``tool`` if it has a name, a description, an object schema and a callable ``call``."""
    for attr, kind in (("name", str), ("description", str), ("parameters", dict)):
        if not isinstance(getattr(tool, attr, None), kind):
            raise ValueError(f"{where}: a tool needs a {kind.__name__} attribute {attr!r}")
    if not tool.name.isidentifier():
        raise ValueError(f"{where}: tool name {tool.name!r} must be an identifier (letters, digits, _)")
    if tool.parameters.get("type") != "object":
        raise ValueError(f"{where}: tool {tool.name!r}: parameters must be a JSON schema with type 'object'")
    if not callable(getattr(tool, "call", None)):
        raise ValueError(f"{where}: tool {tool.name!r} needs a call(**arguments) method")
    return tool


def load_tools(path: str | Path) -> dict[str, ToolLike]:
    """The tools of a tool YAML, by name."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path: {path} does not exist; point it at a "
            "tool YAML (see tearless/tools/registry.py)"
        )
    text = read_user_file(path, key="actor_rollout_ref.rollout.multi_turn.tool_config_path", kind="config")
    raw = OmegaConf.to_container(OmegaConf.create(text.decode("utf-8", "replace")), resolve=True)
    entries = raw.get("tools") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a top-level 'tools' list")
    tools: dict[str, ToolLike] = {}
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{where}: each tool needs a 'class_name'")
        config = dict(entry.get("config") or {})
        for key, value in config.items():
            if key.endswith("_path") and isinstance(value, str) and not Path(value).is_absolute():
                config[key] = str(path.parent / value)
        cls = tool_class(entry["class_name"], base_dir=path.parent, where=where)
        try:
            tool = cls(**config)
        except (TypeError, ValueError, OSError) as e:
            raise ValueError(f"{where}: cannot create {entry['class_name']} with config {config}: {e}") from e
        schema = entry.get("tool_schema")
        if schema:
            function = schema.get("function", schema)
            for attr in ("name", "description", "parameters"):
                if attr in function:
                    setattr(tool, attr, function[attr])
        check_tool(tool, where)
        if tool.name in tools:
            raise ValueError(f"{where}: a second tool named {tool.name!r}; tool names must be unique")
        tools[tool.name] = tool
    return tools
