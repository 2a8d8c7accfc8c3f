"""Prompt datasets in veRL's schema: reading and writing rows, tokenising prompts, batching."""

from tearless.data.loader import PromptLoader
from tearless.data.prompts import TRUNCATION_MODES, PromptDataset, render_prompt, truncate
from tearless.data.rows import DataError, load_many, load_rows, normalize_row, write_jsonl, write_parquet

__all__ = [
    "TRUNCATION_MODES",
    "DataError",
    "PromptDataset",
    "PromptLoader",
    "load_many",
    "load_rows",
    "normalize_row",
    "render_prompt",
    "truncate",
    "write_jsonl",
    "write_parquet",
]
