"""Rollout records: each step's samples as gzip-compressed JSONL, ``rollouts.jsonl.gz`` in the run directory.

Every step is appended as its own gzip member (concatenated members are a valid gzip file), written
in one call and flushed, so a crash loses at most the step being written; :func:`read_records`
keeps every complete member and skips a torn last one. Members carry no timestamp, so the same run
writes the same bytes.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tearless.run.tracking import parse_jsonl

if TYPE_CHECKING:  # the viewer and the report read records without loading torch
    import torch

    from tearless.rollout.batch import Rollout

ROLLOUTS_FILE = "rollouts.jsonl.gz"


def encode_step(records: list[dict]) -> bytes:
    """One gzip member holding ``records`` as JSON lines."""
    text = "".join(json.dumps(r) + "\n" for r in records)
    return gzip.compress(text.encode(), mtime=0)


def append_step(path: str | os.PathLike, records: list[dict], max_bytes: int = 0) -> bool:
    """Append one step's records as a gzip member; return False (writing nothing) when the file would
    pass ``max_bytes`` (0 = no cap)."""
    if not records:
        return True
    data = encode_step(records)
    p = Path(path)
    if max_bytes > 0 and (p.stat().st_size if p.exists() else 0) + len(data) > max_bytes:
        return False
    with open(p, "ab") as f:
        f.write(data)
        f.flush()
    return True


def _members(raw: bytes) -> Iterator[bytes]:
    """The decompressed payload of each complete gzip member of ``raw``; stops at a torn one."""
    while raw:
        d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            payload = d.decompress(raw) + d.flush()
        except zlib.error:
            return
        if not d.eof:
            return
        yield payload
        raw = d.unused_data


def read_records(path: str | os.PathLike) -> list[dict]:
    """Every record of the complete members of a rollouts file (none when it does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    return [r for payload in _members(p.read_bytes()) for r in parse_jsonl(payload.decode(errors="replace"))]


def truncate_records(path: str | os.PathLike, last_step: int) -> None:
    """Keep the records of steps ≤ ``last_step`` (-1 empties the file), rewriting it atomically."""
    p = Path(path)
    if not p.exists():
        return
    by_step: dict[int, list[dict]] = {}
    for r in read_records(p):
        if r.get("step", 0) <= last_step:
            by_step.setdefault(r.get("step", 0), []).append(r)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    tmp.write_bytes(b"".join(encode_step(by_step[s]) for s in sorted(by_step)))
    os.replace(tmp, p)


def step_records(
    step: int, rollout: Rollout, advantages: torch.Tensor, tokenizer: Any, count: int
) -> list[dict]:
    """The records of the first ``count`` samples of step ``step`` (all of them when ``count < 0``):
    prompt (decoded with its special tokens), response, score and extras, the advantage of the first
    response token, the response's length and whether it was cut, and its tool calls if any."""
    items, mask = rollout.items, rollout.out.response_mask
    records = []
    for i in range(len(items) if count < 0 else min(count, len(items))):
        valid = mask[i].bool()
        record = {
            "step": step,
            "uid": items[i]["uid"],
            "data_source": items[i]["data_source"],
            "prompt": tokenizer.decode(items[i]["input_ids"], skip_special_tokens=False),
            "response": rollout.texts[i],
            "ground_truth": str(items[i]["ground_truth"]),
            "score": float(rollout.scores[i]),
            "reward_extra": rollout.extras[i],
            "advantage": float(advantages[i][valid][0]) if valid.any() else 0.0,
            "response_length": int(valid.sum()),
            "truncated": bool(rollout.out.truncated[i]),
        }
        if "tool_calls" in items[i]:
            record["tool_calls"] = items[i]["tool_calls"]
        records.append(record)
    return records
