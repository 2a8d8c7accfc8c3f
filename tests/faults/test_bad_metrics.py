"""Malformed lines in ``metrics.jsonl`` (issue 33, item 6): every reader skips and counts them.

One line of each kind is planted in the middle of a healthy 20-step history. The readers are
``tearless report``, ``tearless compare`` and the trainer's resume (``truncate_jsonl`` drops the
records past the resumed step, then the checkpointed line is restored by step). On main, 7 of these
kinds made ``compare`` and all 3 resume readers die with a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tearless.cli import main
from tearless.run.tracking import read_metrics, read_metrics_counted, truncate_jsonl
from tests.report.histories import STEPS, healthy, write_run

BAD_LINES = {
    "list": b"[1, 2]",
    "number": b"3",
    "string": b'"text"',
    "null": b"null",
    "bool": b"true",
    "step_null": b'{"step": null, "critic/score/mean": 0.5}',
    "step_string": b'{"step": "3", "critic/score/mean": 0.5}',
    "step_float": b'{"step": 1.5, "critic/score/mean": 0.5}',
    "step_bool": b'{"step": true, "critic/score/mean": 0.5}',
    "step_negative": b'{"step": -4, "critic/score/mean": 0.5}',
    "step_huge": b'{"step": 1' + b"0" * 400 + b', "critic/score/mean": 0.5}',
    "no_step": b'{"critic/score/mean": 0.5}',
    "deep": b"[" * 100_000 + b"]" * 100_000,
    "long_int": b'{"step": 3, "critic/score/mean": ' + b"1" * 5000 + b"}",
    "not_utf8": b'{"step": 3, "critic/score/mean": 0.5, "x": "\xff\xfe"}',
    "value_types": b'{"step": 3, "critic/score/mean": "high", "actor/entropy": null, '
    b'"actor/pg_loss": [1], "actor/grad_norm": {"a": 1}, "reward/accuracy": true}',
}


def plant(run_dir: Path, bad: bytes) -> Path:
    write_run(run_dir, healthy())
    lines = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_bytes(b"".join(lines[:5]) + bad + b"\n" + b"".join(lines[5:]))
    return run_dir


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_report_and_compare_skip_and_count_a_line_they_cannot_use(kind, tmp_path, capsys):
    run = plant(tmp_path / "run", BAD_LINES[kind])
    other = write_run(tmp_path / "other", healthy())
    assert main(["report", str(run)]) == 0
    text = (run / "report.html").read_text()
    assert f"(last step {STEPS} of {STEPS}: finished)" in text
    assert main(["compare", str(run), str(other), "--out", str(tmp_path / "c.html")]) == 0
    err = capsys.readouterr().err
    # Every kind but two is a whole line skipped; those keep their step and lose the values that are
    # not numbers (the bad byte reads as U+FFFD in a string).
    if kind == "value_types":
        assert "ignored 5 values that are not numbers" in err, err
    elif kind == "not_utf8":
        assert "ignored 1 value that is not a number" in err, err
    else:
        assert "skipped 1 line of" in err and "metrics.jsonl (line 6)" in err, err


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_resume_readers_skip_a_line_they_cannot_use(kind, tmp_path):
    run = plant(tmp_path / "run", BAD_LINES[kind])
    records, skipped = read_metrics_counted(run / "metrics.jsonl")
    kept = kind in ("value_types", "not_utf8")  # a step record still, with values the report ignores
    assert skipped == ([] if kept else [6])
    assert sorted(r["step"] for r in records) == sorted([*range(STEPS + 1), *([3] if kept else [])])
    said: list[str] = []
    truncate_jsonl(run / "metrics.jsonl", 10, log=said.append)
    assert said == (
        []
        if kept
        else [
            f"warning: skipped 1 line of {run / 'metrics.jsonl'} (line 6) that is not "
            "a metrics record (a JSON object with an integer step); dropped"
        ]
    )
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert max(steps) == 10 and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
    # What truncate_jsonl writes is plain JSON lines again.
    for line in (run / "metrics.jsonl").read_text().splitlines():
        assert isinstance(json.loads(line), dict)
