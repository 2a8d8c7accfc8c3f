"""Turn local copies of common datasets into tearless / veRL parquet (``tearless data prepare``).

Supported layouts (a file, or a directory searched recursively for ``.parquet``, ``.jsonl`` and
``.json`` files):

- ``gsm8k``: rows with ``question`` and ``answer`` (the worked solution ending in ``#### 42``), as in
  the Hugging Face ``openai/gsm8k`` parquet (``main/train-….parquet``) or OpenAI's
  ``grade_school_math/data/train.jsonl``. ``ground_truth`` is the number after ``####``, commas
  removed; ``data_source`` is ``openai/gsm8k``.
- ``math``: rows with ``problem`` and ``solution`` and optionally ``answer``, ``level`` and
  ``type``/``subject``, as in ``DigitalLearningGmbH/MATH-lighteval`` (parquet),
  ``HuggingFaceH4/MATH-500`` (``test.jsonl``) or Hendrycks' original release (one JSON object per
  file, ``MATH/train/algebra/1.json``). ``ground_truth`` is ``answer`` when present, else the last
  ``\\boxed{…}`` of the solution (problems with neither are skipped and counted);
  ``data_source`` is ``DigitalLearningGmbH/MATH-lighteval``.

Without a local copy (``--input`` left out, or given a Hub dataset ID), the dataset is read through
the ``datasets`` package from the Hub (``openai/gsm8k``, ``DigitalLearningGmbH/MATH-lighteval``) and
cached as ``datasets`` does. Each file's split is read from its path (see :func:`split_of`) unless
``split`` is given. The prompt is one user message: the question followed by veRL's instruction for
the dataset, so prompts match veRL-prepared files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from tearless.data.rows import DataError, write_parquet
from tearless.rewards.math_answer import last_boxed

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
SUFFIXES = (".parquet", ".jsonl", ".json")


def split_of(path: Path) -> str | None:
    """``train`` or ``test`` from the words of the file's path, deepest first (``val``/``validation``
    count as test; ``constrained`` is not ``train``), else ``None``."""
    for part in reversed(path.with_suffix("").parts):
        words = set(re.split(r"[^a-z]+", part.lower()))
        if "train" in words:
            return "train"
        if words & {"test", "val", "valid", "validation"}:
            return "test"
    return None


def find_files(source: Path, split: str | None = None) -> dict[str, list[Path]]:
    """The data files under ``source`` grouped by split, in sorted order."""
    if not source.exists():
        raise DataError(f"--input {str(source)!r} does not exist")
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.suffix in SUFFIXES)
    if not files:
        raise DataError(f"no {', '.join(SUFFIXES)} files under {source}")
    groups: dict[str, list[Path]] = {}
    for file in files:
        name = split or split_of(file.relative_to(source) if source.is_dir() else Path(file.name))
        if name is None:
            raise DataError(
                f"cannot tell the split of {file}: its path says neither train nor test; "
                "pass --split train|test"
            )
        groups.setdefault(name, []).append(file)
    return groups


def read_records(path: Path) -> list[dict]:
    """The records of one file: parquet rows, JSON lines, a JSON array, or a single JSON object."""
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        value = json.loads(text)
        return value if isinstance(value, list) else [value]
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def gsm8k_row(record: dict, split: str, index: int) -> dict | None:
    """A row from a GSM8K record; ``DataError`` if it lacks the ``#### answer``."""
    question, answer = record.get("question"), record.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
        raise DataError(
            f"GSM8K record {index} ({split}) needs 'question' and an 'answer' ending in '#### <number>'; "
            f"it has keys {sorted(record)}"
        )
    truth = answer.split("####")[-1].strip().replace(",", "")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {GSM8K_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def math_row(record: dict, split: str, index: int) -> dict | None:
    """A row from a MATH record, or ``None`` when it has no answer to check against."""
    problem = record.get("problem")
    if not isinstance(problem, str):
        raise DataError(f"MATH record {index} ({split}) needs a 'problem'; it has keys {sorted(record)}")
    truth = record.get("answer") or last_boxed(str(record.get("solution") or ""))
    if not truth:
        return None
    return {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(truth)},
        "extra_info": {
            "split": split,
            "index": index,
            "level": str(record.get("level") or ""),
            "type": str(record.get("type") or record.get("subject") or ""),
        },
    }


PREPARERS: dict[str, Callable[[dict, str, int], dict | None]] = {"gsm8k": gsm8k_row, "math": math_row}
# The Hub dataset (and configuration) each name is read from when no local copy is given.
HUB_DATASETS = {"gsm8k": ("openai/gsm8k", "main"), "math": ("DigitalLearningGmbH/MATH-lighteval", "default")}


def hub_records(name: str, hub_id: str | None = None) -> dict[str, list[dict]]:
    """``{split: records}`` of dataset ``name`` read through the ``datasets`` package (downloaded and
    cached under ``HF_HOME``, or read from that cache with ``HF_HUB_OFFLINE=1``) from ``hub_id``
    (default: :data:`HUB_DATASETS`); ``validation`` counts as ``test``."""
    repo, config = HUB_DATASETS[name]
    if hub_id is not None and hub_id != repo:
        repo, config = hub_id, None
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"reading {repo} from the Hugging Face Hub needs the datasets package: pip install datasets "
            "(or 'tearless[hub-data]'), or pass --input a local copy of its files"
        ) from None
    try:
        loaded = datasets.load_dataset(repo, config) if config else datasets.load_dataset(repo)
    except Exception as err:  # datasets raises many types (connection, offline cache miss, bad config)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(
            f"cannot read the Hub dataset {repo}: {first}. Download it once online, or pass --input a "
            "local copy of its files"
        ) from None
    out: dict[str, list[dict]] = {}
    for part, table in loaded.items():
        split = split_of(Path(part))
        if split is not None:
            out.setdefault(split, []).extend(table.to_list())
    return out


def prepare(
    name: str, source: str | os.PathLike | None, output: str | os.PathLike, *, split: str | None = None
) -> dict[str, Any]:
    """Convert dataset ``name`` from ``source`` into ``<output>/<split>.parquet``.

    ``source`` is a local file or directory; ``None``, or a Hub dataset ID (``org/name``) that is not
    a local path, reads the dataset through ``datasets`` (:func:`hub_records`).
    Returns ``{"files": {split: path}, "rows": {split: n}, "skipped": {split: n}}``.
    """
    if name not in PREPARERS:
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(PREPARERS)}")
    to_row = PREPARERS[name]
    summary: dict[str, Any] = {"files": {}, "rows": {}, "skipped": {}}
    if source is None or (not Path(source).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(source))):
        parts = {
            part: [(f"{source or HUB_DATASETS[name][0]} ({part})", records)]
            for part, records in hub_records(name, None if source is None else str(source)).items()
            if split is None or part == split
        }
    else:
        parts = {
            part: [(str(file.parent), read_records(file)) for file in files]
            for part, files in find_files(Path(source), split).items()
        }
    for part, groups in parts.items():
        rows, skipped = [], 0
        for _, records in groups:
            for record in records:
                row = to_row(record, part, len(rows) + skipped)
                if row is None:
                    skipped += 1
                else:
                    rows.append(row)
        if not rows:
            raise DataError(f"no usable {name} records for the {part} split in {groups[0][0]}")
        path = Path(output) / f"{part}.parquet"
        write_parquet(rows, path)
        summary["files"][part], summary["rows"][part], summary["skipped"][part] = (
            str(path),
            len(rows),
            skipped,
        )
    return summary
