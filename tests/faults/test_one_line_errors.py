"""Every refusal of ``tearless train`` is one line (issue 33, item 10), the traceback only with
``TEARLESS_DEBUG=1``. On main about 20 of 138 bad inputs printed a traceback (transformers' refusals
of a model directory, a damaged or pickled checkpoint, Jinja errors, ``trainer.seed=2**64``) and
``trainer.num_threads=-1`` was accepted silently. The cases are :mod:`tests.faults.bad_inputs`' (the
whole campaign, as real processes: ``benchmarks/reliability.py --bad-inputs``); here they run
in-process, before any training step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tearless.cli import main, one_line
from tests.faults.bad_inputs import base_overrides, make_cases

pytestmark = pytest.mark.slow
IN_CI = (
    "seed 2**64", "num_threads -1", "chat template 123", "chat template path", "chat template syntax",
    "chat template sandbox escape", "unknown model_type", "truncated safetensors", "trust_remote_code model",
    "pickled trainer state", "every checkpoint damaged",
)  # fmt: skip


@pytest.fixture(scope="module")
def cases(task, tmp_path_factory):
    return {c.name: c for c in make_cases(task, tmp_path_factory.mktemp("bad-inputs"))}


@pytest.mark.parametrize("name", IN_CI)
def test_a_bad_input_is_one_line(name, cases, task, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TEARLESS_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    code = main(["train", *base_overrides(task, tmp_path / "run"), *cases[name].overrides])
    err = capsys.readouterr().err
    assert code in (1, 2), err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("tearless: "), err
    assert not Path("/tmp/tearless-bad-input-pickle-ran").exists()
    assert not Path("/tmp/tearless-bad-input-remote-code-ran").exists()


def test_the_traceback_is_there_with_the_debug_flag(cases, task, tmp_path, monkeypatch):
    monkeypatch.setenv("TEARLESS_DEBUG", "1")
    with pytest.raises(Exception, match=r"nope_model|model type"):
        main(["train", *base_overrides(task, tmp_path / "run"), *cases["unknown model_type"].overrides])


def test_a_worker_failure_names_the_worker_and_the_remote_exception():
    message = (
        "actor+ref worker rank 1 (pid 42 on host) failed during setup (process group and models):\n"
        'ray::Rank.setup() (pid=42)\nTraceback (most recent call last):\n  File "x.py", line 1\n'
        "ZeroDivisionError: division by zero"
    )
    assert one_line(RuntimeError(message)) == (
        "RuntimeError: actor+ref worker rank 1 (pid 42 on host) failed during setup (process group and "
        "models): … ZeroDivisionError: division by zero"
    )
