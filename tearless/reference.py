"""Reference pages generated from the code: every config key, every CLI command, every formula.

The docs site's hook (``mkdocs_hooks.py``) replaces a marker line in ``docs/config.md``,
``docs/cli.md`` and ``docs/algorithms.md`` with :func:`config_reference`, :func:`cli_reference` and
:func:`formulas_reference` at build time, so the pages list exactly the keys the schema dataclasses
declare (with their ``doc()`` text and defaults), exactly the options the argument parser accepts and
the formulas the registered estimators and losses document: they cannot go stale.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

from tearless.algos import ADV_ESTIMATORS, POLICY_LOSSES, agg_loss, kl_penalty
from tearless.cli import _parser
from tearless.config.dpo import DPOConfig
from tearless.config.rm import RMConfig
from tearless.config.schema import Config, all_keys
from tearless.config.sft import SFTConfig
from tearless.flow.config import FlowConfig

CONFIG_MARKER = "<!-- tearless:config-reference -->"
CLI_MARKER = "<!-- tearless:cli-reference -->"
FORMULAS_MARKER = "<!-- tearless:formulas -->"


def schemas() -> list[tuple[str, str, type]]:
    """(title, commands, dataclass) of every config schema, in the order of the page."""
    return [
        ("RL trainer", "`tearless train`, `python -m tearless.main_ppo`, `tearless.RLConfig`", Config),
        ("SFT", "`tearless sft`, `tearless.SFTConfig`", SFTConfig),
        ("DPO and other preference losses", "`tearless dpo`, `tearless.DPOConfig`", DPOConfig),
        ("Reward model", "`tearless rm`", RMConfig),
        ("Flow-GRPO", "`tearless flow-train`, `tearless flow-pretrain`", FlowConfig),
    ]


def schema_keys(schema: type) -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """Every leaf key of ``schema`` as (dotted key, field, default value), in declaration order."""
    defaults = schema()
    for key, f in all_keys(schema):
        value: Any = defaults
        for part in key.split("."):
            value = getattr(value, part)
        yield key, f, value


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and (not value or value != value.strip() or not value.isprintable()):
        return json.dumps(value)  # quoted, escapes visible: "" or "\n" (a raw newline would end the row)
    return str(value)


def _cell(text: str) -> str:
    """Markdown for a table cell: outside code spans, ``|`` would end the cell, ``<…>`` would be read
    as HTML and ``*`` as emphasis, so they are escaped there (inside code spans they are literal)."""
    parts = re.split(r"(`[^`]*`)", text)
    for i in range(0, len(parts), 2):
        parts[i] = (
            parts[i]
            .replace("&", "&amp;")
            .replace("<", "&lt;")
            .replace(">", "&gt;")
            .replace("|", "\\|")
            .replace("*", "\\*")
        )
    return "".join(parts)


def config_reference() -> str:
    """Markdown: per schema and top-level section, a table of key, default and documentation."""
    out = []
    for title, commands, schema in schemas():
        out.append(f"## {title}\n\n{commands}. Every key below can be given as `key=value`.\n")
        section = None
        for key, f, value in schema_keys(schema):
            top = key.split(".")[0] if "." in key else "(top level)"
            if top != section:
                section = top
                out.append(f"\n### `{top}`\n\n| key | default | meaning |\n|---|---|---|")
            default = _yaml_value(value).replace("`", "'")
            out.append(f"| `{key}` | `{default}` | {_cell(f.metadata.get('help', ''))} |")
        out.append("")
    return "\n".join(out) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                for sub_name, sub_sub in _subcommands(sub):
                    yield f"{name} {sub_name}", sub_sub


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)  # argparse wraps help to the terminal width it reads here
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def cli_reference() -> str:
    """Markdown: ``tearless --help`` and each (sub)command's help, as the parser prints them."""
    with _columns(100):
        parser = _parser()
        out = ["## `tearless`\n", "```text", parser.format_help().rstrip(), "```\n"]
        for name, sub in _subcommands(parser):
            out += [f"## `tearless {name}`\n", "```text", sub.format_help().rstrip(), "```\n"]
    return "\n".join(out)


def rst_to_markdown(docstring: str) -> str:
    """A docstring's reST maths and literals as Markdown for pymdownx.arithmatex: ``.. math::`` blocks
    (with their indented continuation lines) become ``$$`` blocks, ``:math:`x``` becomes ``$x$``,
    cross-reference roles and double-backquoted literals single-backquoted code. The docs site runs
    every docstring through it (``mkdocs_griffe.py``)."""
    lines = inspect.cleandoc(docstring).splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        found = re.match(r"^(\s*)\.\. math::\s*(.*)$", lines[i])
        if not found:
            out.append(lines[i])
            i += 1
            continue
        indent, body = len(found.group(1)), [found.group(2)]
        i += 1
        while i < len(lines) and lines[i].strip() and len(lines[i]) - len(lines[i].lstrip()) > indent:
            body.append(lines[i].strip())
            i += 1
        out += ["", "$$", *[b for b in body if b], "$$", ""]
    text = "\n".join(out)
    text = re.sub(r":math:`([^`]+)`", r"$\1$", text)
    # Cross-reference roles (:class:`~tearless.config.Config`) become code: Config.
    # (reST's ~ shows the last component only).
    text = re.sub(
        r":(?:class|func|data|mod|meth|attr|exc|obj):`(~?)([^`]+)`",
        lambda m: f"``{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}``",
        text,
    )
    return re.sub(r"``([^`]+)``", r"`\1`", text)


def _registry_sections(title: str, registry: dict, note: str) -> list[str]:
    """One subsection per distinct function of ``registry`` (aliases share one), its docstring's
    formulas rendered."""
    names: dict[Any, list[str]] = {}
    for name, fn in registry.items():
        names.setdefault(fn, []).append(name)
    out = [f"## {title}\n", note + "\n"]
    for fn, aliases in names.items():
        out.append(f"### {', '.join(f'`{a}`' for a in aliases)}\n")
        out.append(rst_to_markdown(fn.__doc__ or "(no docstring)") + "\n")
    return out


def formulas_reference() -> str:
    """Markdown: every advantage estimator and policy-loss mode with the formula from its docstring,
    then the loss aggregation modes and the KL estimators."""
    out = _registry_sections(
        "Advantage estimators",
        ADV_ESTIMATORS,
        "`algorithm.adv_estimator`. "
        + rst_to_markdown(sys.modules[ADV_ESTIMATORS["grpo"].__module__].__doc__),
    )
    out += _registry_sections(
        "Policy losses",
        POLICY_LOSSES,
        "`actor_rollout_ref.actor.policy_loss.loss_mode`: Δ = log π − log π_old per token, ρ = exp(Δ), "
        "advantage A, mask m, sg[·] the stop-gradient.",
    )
    out += [
        "## Loss aggregation\n",
        "`actor_rollout_ref.actor.loss_agg_mode`.\n",
        rst_to_markdown(agg_loss.__doc__),
    ]
    out += ["\n## KL estimators\n", "`actor_rollout_ref.actor.kl_loss_type`, `algorithm.kl_penalty`.\n"]
    out.append(rst_to_markdown(kl_penalty.__doc__))
    return "\n".join(out) + "\n"


def render(markdown: str) -> str:
    """``markdown`` with each marker line replaced by its generated reference."""
    if FORMULAS_MARKER in markdown:
        markdown = markdown.replace(FORMULAS_MARKER, formulas_reference())
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    return markdown
