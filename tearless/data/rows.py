"""Reading and writing prompt rows in veRL's dataset schema (parquet or JSON lines).

A row is a dict with:

- ``data_source`` (str): selects the reward function, e.g. ``"openai/gsm8k"``;
- ``prompt``: a list of chat messages ``{"role": str, "content": str}``. A plain string is accepted
  and becomes one user message, so hand-written JSONL files can say ``"prompt": "1+2="``;
- ``reward_model``: a dict with ``ground_truth`` (any JSON value) and usually ``style`` (``"rule"``);
- ``ability`` (str, optional) and ``extra_info`` (dict, optional).

Other columns are kept as they are. Rows are numbered from 0 in error messages, the same number the
dataset reports as ``index``; for JSON lines the line number (from 1) is given as well.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tearless.userfiles import UserFileError, check_user_file, read_user_file

REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model.ground_truth")
PARQUET_SUFFIXES = (".parquet",)
JSON_SUFFIXES = (".jsonl", ".json")


class DataError(ValueError):
    """A dataset file or row that cannot be used, with a message saying where and how to fix it."""


class BuiltItems:
    """A dataset whose items are all built in ``__init__`` (``self._items``, one dict per row, in row
    order): the SFT, preference and reward-pair datasets."""

    _items: list[dict]

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict:
        return self._items[i]


def load_rows(path: str | os.PathLike, key: str = "data.train_files") -> list[dict]:
    """Read every row of one ``.parquet``, ``.jsonl`` or ``.json`` file and check its schema.

    JSON files hold one object per line (blank lines are skipped); a ``.json`` file whose content is a
    single JSON array of objects is read as well. Each row is checked with :func:`normalize_row`.
    """
    return [normalize_row(row, where=where) for where, row in located_rows(Path(path), key)]


def located_rows(path: str | os.PathLike, key: str = "data.train_files") -> Iterator[tuple[str, Any]]:
    """Each row of one file as stored, unchecked, after ``where``: its name in error messages
    (``"f.jsonl: row 3 (line 5)"``, the line for JSON lines only). A file with no rows raises
    :class:`DataError`; so do the files :func:`read_raw_rows` refuses."""
    raw, lines = read_raw_rows(path, key)
    if not raw:
        raise DataError(f"{path} has no rows")
    for i, row in enumerate(raw):
        yield f"{path}: row {i}" + (f" (line {lines[i]})" if lines else ""), row


def read_raw_rows(
    path: str | os.PathLike, key: str = "data.train_files"
) -> tuple[list[Any], list[int] | None]:
    """The rows of one file as stored, unchecked, and for JSON lines each row's line number.

    For tools that report every problem of a file rather than stop at the first (``tearless data
    inspect``); :func:`load_rows` is this plus the checks. ``key`` is the config key that named the
    file, for the message when it is not a regular file of sane size (:mod:`tearless.userfiles`).
    """
    path = Path(path)
    if not os.path.lexists(path):
        raise DataError(f"data file {str(path)!r} does not exist; check data.train_files / data.val_files")
    if path.is_dir():
        raise DataError(f"{key}: {path} is a directory, not a regular file; give the file inside it")
    suffix = path.suffix.lower()
    try:
        if suffix in PARQUET_SUFFIXES:
            check_user_file(path, key=key, kind="data")
            return _read_parquet(path), None
        if suffix in JSON_SUFFIXES:
            return _read_json(path, read_user_file(path, key=key, kind="jsonl"))
    except UserFileError as e:
        raise DataError(str(e)) from None
    raise DataError(
        f"{path}: unknown file type {suffix!r}; use one of {', '.join(PARQUET_SUFFIXES + JSON_SUFFIXES)}"
    )


def load_many(
    paths: str | os.PathLike | Sequence[str | os.PathLike], key: str = "data.train_files"
) -> list[dict]:
    """Concatenate the rows of one path or a list of paths, in order (veRL's ``data.train_files``)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = list(paths)
    if not paths:
        raise DataError(f"no data files given; set {key} to a path or a list of paths")
    rows: list[dict] = []
    for path in paths:
        rows.extend(load_rows(path, key))
    return rows


def normalize_row(row: Any, *, where: str) -> dict:
    """Check one row against the schema and return it with ``prompt`` as a list of messages.

    ``where`` names the row in error messages (file and row number). A string prompt becomes
    ``[{"role": "user", "content": prompt}]``, and the string is kept as ``prompt_text`` (fed to the
    model as it is, TRL's plain-text format). Message keys whose value is ``None`` are dropped:
    parquet stores messages as structs, so a key that only some messages have (``tool_calls``) comes
    back as ``None`` in the others, and chat templates test for a key's presence.
    """
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with columns, got {type(row).__name__}")
    missing = [col for col in REQUIRED_COLUMNS if _lookup(row, col) is None]
    if missing:
        nested = row.get("reward_model")
        if missing[0].startswith("reward_model.") and isinstance(nested, dict):
            present = f"reward_model has keys {sorted(nested)}"
        else:
            present = f"the row has columns {sorted(row)}"
        raise DataError(
            f"{where}: missing column {missing[0]!r}; {present}. Every row needs "
            f"{', '.join(REQUIRED_COLUMNS)} (veRL's dataset schema)"
        )
    truth = _lookup(row, "reward_model.ground_truth")
    bad = _non_finite(truth)
    if bad is not None:
        verb = "is" if isinstance(truth, float) else "holds"
        raise DataError(
            f"{where}: reward_model.ground_truth {verb} {bad}; no response can match it, so every response "
            "would score 0. Fix or drop the row"
        )
    if not isinstance(row["data_source"], str) or not row["data_source"]:
        raise DataError(f"{where}: data_source must be a non-empty string, got {row['data_source']!r}")
    for key in ("ability", "extra_info"):
        kind = str if key == "ability" else dict
        if row.get(key) is not None and not isinstance(row[key], kind):
            raise DataError(f"{where}: {key} must be a {kind.__name__}, got {type(row[key]).__name__}")
    # A plain-text prompt is also kept as ``prompt_text``: the model is fed the text as it is.
    text = {"prompt_text": row["prompt"]} if isinstance(row["prompt"], str) else {}
    return {**row, **text, "prompt": _normalize_prompt(row["prompt"], where)}


def _non_finite(value: Any) -> float | None:
    """The first NaN or infinite float in a ground truth (looked for inside lists and dicts), or None."""
    if isinstance(value, float):
        return value if not math.isfinite(value) else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((bad for bad in map(_non_finite, items) if bad is not None), None)


def write_parquet(rows: Sequence[dict], path: str | os.PathLike) -> None:
    """Write rows to a parquet file atomically (a temporary file in the same folder, then a rename).

    Column types are inferred from all rows, so a column must hold values of one type (for example
    every ``ground_truth`` a string, not some strings and some numbers). Dicts are stored as structs
    with the union of their keys, so a key that only some rows' ``extra_info`` has reads back as
    ``None`` in the others.
    """
    path = Path(path)
    _check_writable(rows, path)
    columns: dict[str, list] = {}
    for row in rows:
        for key in row:
            columns.setdefault(key, [])
    for key, values in columns.items():
        values.extend(row.get(key) for row in rows)
    try:
        table = pa.Table.from_pydict(columns)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise DataError(
            f"cannot write {path}: a column mixes value types ({exc}); give each column one type"
        ) from exc
    _atomic_write(path, lambda tmp: pq.write_table(table, tmp))


def write_jsonl(rows: Sequence[dict], path: str | os.PathLike) -> None:
    """Write rows as JSON lines (UTF-8, one object per line) atomically."""
    path = Path(path)
    _check_writable(rows, path)
    lines = []
    for i, row in enumerate(rows):
        try:
            lines.append(json.dumps(row, ensure_ascii=False))
        except (TypeError, ValueError) as exc:
            raise DataError(f"cannot write {path}: row {i} is not JSON-serialisable: {exc}") from exc

    def write(tmp: Path) -> None:
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")

    _atomic_write(path, write)


def _lookup(row: dict, dotted: str) -> Any:
    value: Any = row
    for key in dotted.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def chat_messages(value: list, *, where: str, column: str) -> list[dict]:
    """``value`` (the list in ``column``) as chat messages: each a dict with string ``role`` and
    ``content``, keys whose value is ``None`` dropped (parquet structs fill absent keys with nulls); a
    :class:`DataError` naming the row and the message otherwise."""
    messages = []
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            raise DataError(
                f'{where}: {column}[{j}] must be a message like {{"role": "user", "content": "..."}}, '
                f"got {message!r:.80}"
            )
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise DataError(
                    f"{where}: {column}[{j}] needs a string {key!r}; the message has keys {sorted(message)}"
                )
        messages.append(message)
    return messages


def _normalize_prompt(prompt: Any, where: str) -> list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: empty prompt; the prompt string is blank: give the question in it")
        return [{"role": "user", "content": prompt}]
    example = '[{"role": "user", "content": "..."}]'
    if not isinstance(prompt, list) or not prompt:
        raise DataError(
            f"{where}: prompt must be a non-empty list of chat messages like {example} (or a string), "
            f"got {prompt!r:.80}"
        )
    messages = chat_messages(prompt, where=where, column="prompt")
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: empty prompt; every message's content is blank: give the question in one")
    return messages


def _read_parquet(path: Path) -> list[dict]:
    if path.stat().st_size == 0:
        return []
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path} is not a readable parquet file: {exc}") from exc


def _read_json(path: Path, raw: bytes) -> tuple[list[Any], list[int]]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise DataError(
            f"{path}: line {line} is not UTF-8 (byte {raw[exc.start]:#04x} at offset {exc.start}); "
            "JSON lines files must be UTF-8: re-encode the file (e.g. iconv -f latin1 -t utf-8)"
        ) from exc
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        return rows, []
    rows, lines = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{path}: line {number} is not valid JSON ({exc.msg} at column {exc.colno}); "
                "the file must hold one JSON object per line"
            ) from exc
        lines.append(number)
    return rows, lines


def _check_writable(rows: Sequence[dict], path: Path) -> None:
    if not rows:
        raise DataError(f"refusing to write {path} with no rows: it could not be loaded again")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"cannot write {path}: row {i} is a {type(row).__name__}, not a dict")


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    # A crash mid-write leaves the old file (or none), never a truncated one that a reader would
    # take for a short dataset.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
