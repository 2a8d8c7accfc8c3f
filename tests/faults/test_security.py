"""What tearless loads and runs: no pickle of anything a user did not write, no remote code, model-
written code only inside the sandbox."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import tearless
from tearless.rewards import compute_score
from tearless.run import checkpoint as ckpt
from tearless.run.manifest import CheckpointDamaged

PACKAGE = Path(tearless.__file__).parent


def _calls(name: str):
    """(file, call) for every call of ``…name(…)`` in the package's source."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called == name:
                    yield path.relative_to(PACKAGE), node


def _keyword(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_every_torch_load_in_the_package_is_weights_only():
    loads = list(_calls("load"))
    torch_loads = [
        (p, c) for p, c in loads if isinstance(c.func, ast.Attribute) and ast.unparse(c.func) == "torch.load"
    ]
    assert torch_loads, "the checkpoint loader calls torch.load"
    for path, call in torch_loads:
        flag = _keyword(call, "weights_only")
        assert isinstance(flag, ast.Constant) and flag.value is True, f"{path}:{call.lineno}"
    # Nothing unpickles with pickle itself (the reward pool's pipes carry only samples and results,
    # between this process and its own forks).
    assert not [p for p, c in loads if ast.unparse(c.func) in ("pickle.load", "pickle.loads")]


def test_remote_code_is_never_trusted():
    for name in ("from_pretrained", "from_config"):
        for path, call in _calls(name):
            flag = _keyword(call, "trust_remote_code")
            assert flag is None or (isinstance(flag, ast.Constant) and flag.value is False), (
                f"{path}:{call.lineno}"
            )


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['TEARLESS_TEST_PWNED']}",))


def test_a_trainer_state_carrying_code_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    monkeypatch.setenv("TEARLESS_TEST_PWNED", str(marker))
    step = tmp_path / "global_step_1"
    step.mkdir()
    torch.save({"global_step": 1, "optimizer": _Payload()}, step / "trainer_state.pt")
    (step / ckpt.MARKER).write_text("1")
    # refused by torch's weights_only loader, in one line that names the file (and does not pass on
    # torch's advice to load it with weights_only=False, which would run the payload)
    with pytest.raises(CheckpointDamaged, match=r"trainer_state\.pt holds objects other than tensors") as e:
        ckpt.load_state(step)
    assert "weights_only=False" not in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the sandbox needs Linux")
def test_model_written_code_runs_only_in_the_sandbox(tmp_path):
    # A "solution" that tries to write outside its scratch directory and to reach the network: the
    # code reward runs it in the sandbox, so the file never appears, the socket fails, and the
    # program's own output shows both refusals; the trainer's process is untouched.
    target = tmp_path / "escaped.txt"
    code = "\n".join(
        [
            "import socket",
            "try:",
            f"    open({str(target)!r}, 'w').write('x')",
            "    print('wrote')",
            "except Exception:",
            "    print('no write')",
            "try:",
            "    socket.create_connection(('127.0.0.1', 9), 1)",
            "    print('net')",
            "except Exception:",
            "    print('no net')",
            "",
        ]
    )
    response = f"```python\n{code}```"
    ground_truth = json.dumps({"inputs": [""], "outputs": ["no write\nno net\n"]})
    assert compute_score("code", response, ground_truth)["score"] == 1.0
    assert not target.exists()
