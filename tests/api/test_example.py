"""examples/python_api.py, run as a user runs it: custom rows and reward through the Python API."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python_api.py"


@pytest.mark.slow
def test_the_python_api_example_trains_and_prints_before_and_after(task, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TEARLESS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TEARLESS_EXAMPLE_MODEL", task.model_dir)
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    out = capsys.readouterr().out
    found = re.search(r"carry problems: before (\d\.\d+)  after (\d\.\d+)", out)
    assert found, out
    before, after = map(float, found.groups())
    rewards = [float(r) for r in re.search(r"training reward by step: (.*)", out).group(1).split()]
    assert len(rewards) == 12
    # The warmed-up model drops most carries under greedy decoding; GRPO on these rows fixes many.
    assert before < 0.5 and after >= before + 0.2, (before, after)
    assert (tmp_path / "runs" / "python-api-example").is_dir()
