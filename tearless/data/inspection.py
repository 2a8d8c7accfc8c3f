"""Look at a dataset file before training on it (``tearless data inspect``).

The report gives the schema, the row count, the rows per ``data_source`` with the scorer each one
gets, prompt lengths in tokens when a tokenizer is given, a few rows, and every problem found:
rows that break the schema (missing columns, a prompt that is not a list of messages), empty
prompts or ground truths, a ``data_source`` with no built-in scorer, duplicate prompts, and prompts
longer than ``max_prompt_length``. A multimodal file (an ``images`` column, :mod:`tearless.data.images`)
gets a line on its images' sizes, and each bad image (undecodable, missing, too large, or a count that
differs from the prompt's ``<image>`` placeholders) is a problem of its row.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tearless.data.images import row_images
from tearless.data.prompts import render_prompt
from tearless.data.rows import DataError, normalize_row, read_raw_rows
from tearless.rewards import get_scorer

_SHOW_ROWS = 5  # row numbers listed per problem
_CELL = 300  # characters shown per row


@dataclass
class Inspection:
    """What :func:`inspect_file` found: the report's text and the problems (empty when clean)."""

    text: str
    problems: list[str] = field(default_factory=list)


def inspect_file(
    path: str | os.PathLike,
    *,
    tokenizer: Any = None,
    max_prompt_length: int | None = None,
    num_rows: int = 3,
) -> Inspection:
    """Inspect one ``.parquet`` / ``.jsonl`` / ``.json`` file (see the module docs)."""
    path = Path(path)
    raw, lines = read_raw_rows(path)
    out = [f"{path}: {len(raw)} rows"]
    out += ["schema:"] + [f"  {line}" for line in _schema(path, raw)]
    issues: dict[str, list[int]] = defaultdict(list)
    rows: list[tuple[int, dict]] = []
    for i, row in enumerate(raw):
        where = f"row {i}" + (f" (line {lines[i]})" if lines else "")
        try:
            rows.append((i, normalize_row(row, where=where)))
        except DataError as exc:
            issues[str(exc).removeprefix(where + ": ").split(";")[0]].append(i)
    if not raw:
        issues["the file has no rows"] = []
    sources = Counter(row["data_source"] for _, row in rows)
    if sources:
        out.append("data_source:")
    for source, count in sources.most_common():
        try:
            scorer = get_scorer(source)
            where = f"{scorer.__module__}.{scorer.__name__}"
        except ValueError:
            where = "no built-in scorer"
            issues[f"data_source {source!r} has no built-in scorer: set custom_reward_function.path"] += [
                i for i, row in rows if row["data_source"] == source
            ]
        out.append(f"  {source}: {count} rows ({where})")
    seen: dict[str, int] = {}
    for i, row in rows:
        if str(row["reward_model"]["ground_truth"]).strip() == "":
            issues["empty ground_truth"].append(i)
        key = json.dumps(row["prompt"], sort_keys=True) + _images_digest(row)
        if key in seen:
            issues[f"duplicate prompt (first seen in row {seen[key]})"].append(i)
        seen.setdefault(key, i)
    out += _image_sizes(rows, issues)
    if tokenizer is not None and rows:
        out += _lengths(rows, tokenizer, max_prompt_length, issues)
    for i, row in rows[:num_rows]:
        out.append(f"row {i}: {_clip(json.dumps(_shown(row), ensure_ascii=False, default=str))}")
    problems = [
        f"{kind}: {len(where)} rows ({_row_list(where)})" if where else kind for kind, where in issues.items()
    ]
    out += ["problems:"] + ([f"  - {p}" for p in problems] or ["  none"])
    return Inspection("\n".join(out), problems)


def _schema(path: Path, raw: list[Any]) -> list[str]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [f"{f.name}: {f.type}" for f in pq.read_schema(path)]
    types: dict[str, Counter] = defaultdict(Counter)
    for row in raw:
        if isinstance(row, dict):
            for key, value in row.items():
                types[key][type(value).__name__] += 1
    return [f"{key}: {' | '.join(sorted(kinds))}" for key, kinds in types.items()]


def _lengths(
    rows: list[tuple[int, dict]], tokenizer: Any, max_prompt_length: int | None, issues: dict
) -> list[str]:

    lengths = [(i, len(render_prompt(tokenizer, row["prompt"]))) for i, row in rows]
    values = sorted(n for _, n in lengths)
    line = (
        f"prompt tokens: min {values[0]}, median {values[len(values) // 2]}, max {values[-1]}, "
        f"mean {sum(values) / len(values):.1f}"
    )
    if max_prompt_length is not None:
        over = [i for i, n in lengths if n > max_prompt_length]
        line += f"; {len(over)} over {max_prompt_length}"
        if over:
            issues[f"prompt longer than {max_prompt_length} tokens"] = over
    return [line]


def _image_sizes(rows: list[tuple[int, dict]], issues: dict) -> list[str]:
    """The images line (count, rows, width × height range), each bad image an issue of its row."""
    sizes = []
    with_images = 0
    for i, row in rows:
        try:
            images = row_images(row, f"row {i}")
        except DataError as exc:
            issues[str(exc).removeprefix(f"row {i}: ").split(";")[0]].append(i)
            continue
        with_images += images is not None
        sizes += [image.size for image in images or ()]
    if not sizes:
        return []
    pixels = sorted(sizes, key=lambda wh: wh[0] * wh[1])
    low, mid, high = (f"{w}x{h}" for w, h in (pixels[0], pixels[len(pixels) // 2], pixels[-1]))
    return [f"images: {len(sizes)} in {with_images} rows; sizes smallest {low}, median {mid}, largest {high}"]


def _images_digest(row: dict) -> str:
    """A digest of the row's images (their bytes, else their paths): one text with other images is
    another prompt. Empty for a text row."""
    images = row.get("images")
    if not isinstance(images, list) or not images:
        return ""
    digest = hashlib.sha256()
    for image in images:
        data = image.get("bytes") if isinstance(image, dict) else None
        named = image.get("path") if isinstance(image, dict) else image
        digest.update(data if isinstance(data, bytes) else json.dumps(named, default=str).encode())
    return digest.hexdigest()


def _shown(row: dict) -> dict:
    """``row`` for the report, each image's bytes given as their count."""
    images = row.get("images")
    if not isinstance(images, list):
        return row
    shown = [
        {**im, "bytes": f"<{len(im['bytes'])} bytes>"} if isinstance(im, dict) and im.get("bytes") else im
        for im in images
    ]
    return {**row, "images": shown}


def _row_list(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:_SHOW_ROWS]))
    return shown + (", …" if len(rows) > _SHOW_ROWS else "")


def _clip(text: str) -> str:
    return text if len(text) <= _CELL else text[: _CELL - 1] + "…"
