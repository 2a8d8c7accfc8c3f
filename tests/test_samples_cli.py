"""``tearless samples RUN_DIR``: selection and printing on a synthetic run directory."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tearless.cli import main
from tearless.samples import format_plain, print_samples, select_samples
from tearless.trainers.records import ROLLOUTS_FILE, append_step

# Two steps of three samples; scores are chosen so that worst/best orders are unambiguous.
SAMPLES = [
    (1, "3+4=", "answer 7", 1.0, "arithmetic"),
    (1, "9+9=", "answer 17", 0.0, "arithmetic"),
    (1, "def f", "return 1", 0.5, "code"),
    (2, "2+2=", "answer 4", 0.9, "arithmetic"),
    (2, "5+5=", "answer 11", -1.0, "arithmetic"),
    (2, "def g", "return 2", 0.7, "code"),
]


def record(step, prompt, response, score, source):
    return {
        "step": step,
        "uid": f"{step}-1-0",
        "data_source": source,
        "prompt": prompt,
        "response": response,
        "ground_truth": "x",
        "score": score,
        "reward_extra": {"acc": float(score >= 1)},
        "advantage": score - 0.5,
        "response_length": 3,
        "truncated": score < 0,
    }


@pytest.fixture
def run_dir(tmp_path):
    for step in (1, 2):
        append_step(tmp_path / ROLLOUTS_FILE, [record(*s) for s in SAMPLES if s[0] == step])
    return tmp_path


def responses(out: str) -> list[str]:
    """The responses in the order they were printed."""
    found = [(out.index(s[2]), s[2]) for s in SAMPLES if s[2] in out]
    return [r for _, r in sorted(found)]


def run(capsys, *args) -> tuple[int, str]:
    code = main(["samples", *map(str, args)])
    return code, capsys.readouterr().out


def test_worst_and_best_order_by_score(run_dir, capsys):
    code, out = run(capsys, run_dir, "--worst", 2)
    assert code == 0 and responses(out) == ["answer 11", "answer 17"]
    code, out = run(capsys, run_dir, "--best", 2, "--step", 2)
    assert code == 0 and responses(out) == ["answer 4", "return 2"]


def test_grep_and_source_filter(run_dir, capsys):
    code, out = run(capsys, run_dir, "--grep", "ANSWER 1")  # case-insensitive: 17 and 11
    assert code == 0 and responses(out) == ["answer 17", "answer 11"]
    code, out = run(capsys, run_dir, "--source", "code", "--worst", 1)
    assert code == 0 and responses(out) == ["return 1"]


def test_nothing_to_show_is_an_error_with_the_reason(run_dir, tmp_path, capsys):
    assert main(["samples", str(run_dir), "--step", "9"]) == 1
    assert "no sample matches (steps 1–2" in capsys.readouterr().err
    assert main(["samples", str(tmp_path / "nowhere")]) == 1
    assert "no rollout records" in capsys.readouterr().err


def test_plain_and_rich_show_the_same_fields():
    chosen = select_samples([record(*s) for s in SAMPLES], step=2, worst=1)
    plain = format_plain(chosen)
    assert plain.splitlines()[0].startswith("── step 2 · uid 2-1-0 · arithmetic · score -1.000")
    assert "(truncated)" in plain and "reward components: acc=0" in plain
    stream = io.StringIO()
    print_samples(chosen, stream=stream, use_rich=True)
    for text in ("5+5=", "answer 11", "reward components", "acc=0"):
        assert text in stream.getvalue()


def test_the_installed_command_runs(run_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "tearless.cli", "samples", str(run_dir), "--best", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "answer 7" in proc.stdout and "answer 4" not in proc.stdout


@pytest.mark.parametrize("use_rich", [False, True])
def test_terminal_escapes_in_model_output_are_printed_visibly(use_rich):
    # A response that would clear the screen, recolour the text, return the cursor and set the
    # window title (OSC ... BEL), and an 8-bit CSI: none of it reaches the terminal as a control.
    hostile = record(1, "1+1=", "\x1b[2J\x1b[31mfake score 1.0\x1b[0m\rX\x9b0m", 0.0, "arith\x1b]0;t\x07")
    stream = io.StringIO()
    print_samples([hostile], stream=stream, use_rich=use_rich)
    out = stream.getvalue()
    assert not any(c in out for c in "\x1b\r\x07\x9b")
    assert "\\x1b[2J\\x1b[31mfake score 1.0\\x1b[0m\\x0dX\\x9b0m" in out
    assert "arith\\x1b]0;t\\x07" in out


@pytest.mark.parametrize("use_rich", [False, True])
def test_unicode_format_characters_in_model_output_are_printed_visibly(use_rich):
    # Issue 33: a right-to-left override renders the rest of the line reversed, zero-width characters
    # and the line separator hide or split text; all are escaped, while ordinary non-ASCII stays.
    hostile = record(
        1,
        "1+1=",
        "answer \u202e2=1+1\u202c is\u200b\u200d\u2066 ok\u2028\ufeffx\U000e0041 héllo 数学 ✓",
        0.0,
        "a\u2067b",
    )
    stream = io.StringIO()
    print_samples([hostile], stream=stream, use_rich=use_rich)
    out = stream.getvalue()
    for c in "\u202e\u202c\u200b\u200d\u2066\u2067\u2028\ufeff\U000e0041":
        assert c not in out
    # Short pieces: rich wraps a long response inside its panel.
    for piece in (
        "\\u202e2=1+1\\u202c",
        "\\u200b\\u200d\\u2066",
        "\\u2028\\ufeffx\\U000e0041",
        "héllo 数学 ✓",
    ):
        assert piece in out, piece
    assert "a\\u2067b" in out
