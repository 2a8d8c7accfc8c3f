"""``tearless samples RUN_DIR``: pick rollout records of a run and print them for a person to read.

Uses rich when it is installed (a panel per sample), plain text otherwise; the content is the same.
Model output is untrusted text: control characters (terminal escape sequences, carriage returns,
backspaces, the C1 controls) are printed as visible ``\\x1b``-style escapes, never sent to the
terminal, so a response cannot recolour, rewrite or hide what is printed around it; Unicode format
characters (bidi overrides and isolates, zero-width characters, the byte-order mark, tag characters),
line and paragraph separators, surrogates, private-use and unassigned code points likewise become
``\\u202e``-style escapes, so a response cannot render reversed or hide text.
"""

from __future__ import annotations

import json
import os
import re
import sys
import unicodedata
from pathlib import Path
from typing import TextIO

from tearless.trainers.records import ROLLOUTS_FILE, read_records

# C0 controls but tab and newline, DEL, and the C1 controls (U+0080–U+009F: 8-bit CSI and friends).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Unicode categories that change how text around them renders, or render as nothing.
_HIDDEN = frozenset(("Cf", "Cs", "Co", "Cn", "Zl", "Zp"))


def visible(text: str) -> str:
    r"""``text`` with every control character but tab and newline written as ``\xNN``, and every
    character of :data:`_HIDDEN`'s categories as ``\uNNNN`` (``\UNNNNNNNN`` beyond the BMP)."""
    text = _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    if text.isascii():
        return text
    return "".join(_escape(c) if ord(c) > 0x9F and unicodedata.category(c) in _HIDDEN else c for c in text)


def _escape(c: str) -> str:
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"


def select_samples(
    records: list[dict],
    *,
    step: int | None = None,
    worst: int | None = None,
    best: int | None = None,
    grep: str | None = None,
    source: str | None = None,
) -> list[dict]:
    """Filter by step, data source and text (case-insensitive, in prompt, response or ground truth),
    then keep the ``worst`` lowest-scored (lowest first) or ``best`` highest-scored (highest first).

    Without ``worst``/``best`` the records keep their order (by step). Ties keep that order too.
    """
    out = [
        r
        for r in records
        if (step is None or r.get("step") == step)
        and (source is None or r.get("data_source") == source)
        and (grep is None or _matches(r, grep.lower()))
    ]
    if worst is not None:
        out = sorted(out, key=lambda r: r.get("score", 0.0))[:worst]
    elif best is not None:
        out = sorted(out, key=lambda r: -r.get("score", 0.0))[:best]
    return out


def _matches(record: dict, needle: str) -> bool:
    return any(needle in str(record.get(k, "")).lower() for k in ("prompt", "response", "ground_truth"))


def _header(r: dict) -> str:
    parts = [
        f"step {r.get('step')}",
        f"uid {r.get('uid')}",
        str(r.get("data_source")),
        f"score {r.get('score', 0.0):.3f}",
        f"advantage {r.get('advantage', 0.0):+.3f}",
        f"{r.get('response_length')} tokens" + (" (truncated)" if r.get("truncated") else ""),
    ]
    return visible(" · ".join(parts))


def _fields(r: dict) -> list[tuple[str, str]]:
    """The labelled text blocks of one sample, in the order they are printed."""
    fields = [
        ("prompt", str(r.get("prompt", ""))),
        ("response", str(r.get("response", ""))),
        ("ground truth", str(r.get("ground_truth", ""))),
    ]
    if r.get("reward_extra"):
        parts = [
            f"{k}={v:g}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in r["reward_extra"].items()
        ]
        fields.append(("reward components", ", ".join(parts)))
    if r.get("tool_calls"):
        fields.append(("tool calls", json.dumps(r["tool_calls"], indent=1)))
    return [(label, visible(text)) for label, text in fields]


def format_plain(samples: list[dict]) -> str:
    """Plain-text rendering: a header line per sample, then its labelled fields indented."""
    blocks = []
    for r in samples:
        lines = [f"── {_header(r)}"]
        for label, text in _fields(r):
            body = text.splitlines() or [""]
            lines.append(f"  {label}: {body[0]}")
            lines += [f"    {line}" for line in body[1:]]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def print_samples(samples: list[dict], *, stream: TextIO | None = None, use_rich: bool | None = None) -> None:
    """Print ``samples`` with rich panels when available (``use_rich=None``: if importable), else plain."""
    stream = stream or sys.stdout
    if use_rich is None:
        try:
            import rich  # noqa: F401

            use_rich = True
        except ImportError:
            use_rich = False
    if not use_rich:
        print(format_plain(samples), file=stream)
        return
    from rich.console import Console, Group
    from rich.panel import Panel
    from rich.text import Text

    console = Console(file=stream)
    styles = {"prompt": "dim", "response": "bold", "ground truth": "green"}
    for r in samples:
        body = Group(
            *(
                Text.assemble((f"{label}: ", "cyan"), (text, styles.get(label, "")))
                for label, text in _fields(r)
            )
        )
        bad = r.get("score", 0.0) <= 0 or r.get("truncated")
        border = "red" if bad else "blue"
        console.print(Panel(body, title=Text(_header(r)), title_align="left", border_style=border))


def samples_command(
    run_dir: str | os.PathLike,
    *,
    step: int | None = None,
    worst: int | None = None,
    best: int | None = None,
    grep: str | None = None,
    source: str | None = None,
) -> int:
    """The ``tearless samples`` command: 0 when something was printed, 1 otherwise (with the reason)."""
    path = Path(run_dir) / ROLLOUTS_FILE
    records = read_records(path)
    if not records:
        print(f"tearless samples: no rollout records in {path}", file=sys.stderr)
        return 1
    chosen = select_samples(records, step=step, worst=worst, best=best, grep=grep, source=source)
    if not chosen:
        steps = sorted({r.get("step") for r in records})
        print(
            f"tearless samples: no sample matches (steps {steps[0]}–{steps[-1]}, "
            f"sources {sorted({str(r.get('data_source')) for r in records})})",
            file=sys.stderr,
        )
        return 1
    print_samples(chosen)
    return 0
