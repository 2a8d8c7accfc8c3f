"""Hostile files at every user-given path: one line naming the key and the file, never a hang or an
unbounded read.

Every case runs in a child process under an address-space limit (``RLIMIT_AS``) and a time limit, so
a reader that follows ``/dev/zero`` dies of ``MemoryError`` in the child and a reader that waits on a
FIFO is interrupted by ``SIGALRM``; neither can take this process, or the machine, with it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from tearless.userfiles import CAPS, UserFileError, check_model_files, check_user_file, read_user_file
from tests.faults.bad_inputs import HOSTILE_KINDS, make_hostile

# 3 GiB of address space: enough for the child to import torch and transformers (about 1.5 GiB
# mapped), far too little to read /dev/zero for long.
AS_LIMIT = 3 << 30
CASE_SECONDS = 20  # each case's own alarm in the child
WALL_SECONDS = 240  # the whole child


# Each case of the child: the code that reads the user's path (the statement runs with ``target``, the
# hostile path, and ``root``, a directory of the real files it needs), and the key its one line must name.
CHILD = r"""
import json, os, signal, sys, traceback
from pathlib import Path

class Hang(Exception):
    pass

def alarm(*_):
    raise Hang()

signal.signal(signal.SIGALRM, alarm)
out = {}
for name, statement, target, root in json.loads(sys.argv[1]):
    signal.alarm(int(sys.argv[2]))
    try:
        exec(statement, {"target": target, "root": root, "Path": Path})
        out[name] = ["accepted", ""]
    except Hang:
        out[name] = ["hang", ""]
    except BaseException as e:
        out[name] = [type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else ""]
    finally:
        signal.alarm(0)
print("RESULT " + json.dumps(out))
"""


def _limit() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AS_LIMIT, AS_LIMIT))


def run_child(cases: list[tuple[str, str, str, str]]) -> dict[str, list[str]]:
    """Run the cases in one child under the memory and time limits; ``{name: [exception type, line]}``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases), str(CASE_SECONDS)],
        capture_output=True,
        text=True,
        timeout=WALL_SECONDS,
        preexec_fn=_limit,
        env=env,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert lines, f"the child died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


def tiny_model(root: Path) -> Path:
    from tearless.tasks.tokenizer import build_char_tokenizer

    model = root / "model"
    build_char_tokenizer().save_pretrained(model)
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(model)
    return model


# (name, file inside the case directory, kind of the cap, statement, key the line names)
POINTS = [
    (
        "model config at config time",
        "model/config.json",
        "config",
        "from tearless.config import load_config\n"
        "load_config(None, [f'actor_rollout_ref.model.path={Path(target).parent}'])",
        "actor_rollout_ref.model.path",
    ),
    (
        "tokenizer file",
        "model/tokenizer.json",
        "tokenizer",
        "from tearless.models.loading import load_tokenizer\nload_tokenizer(Path(target).parent)",
        "actor_rollout_ref.model.path",
    ),
    (
        "model chat template",
        "model/chat_template.jinja",
        "template",
        "from tearless.models.loading import load_tokenizer\nload_tokenizer(Path(target).parent)",
        "actor_rollout_ref.model.path",
    ),
    (
        "reward function file",
        "reward.py",
        "code",
        "from tearless.rewards.manager import load_reward_function\nload_reward_function(target)",
        "custom_reward_function.path",
    ),
    (
        "JSON lines data",
        "train.jsonl",
        "jsonl",
        "from tearless.data.rows import load_many\nload_many(target)",
        "data.train_files",
    ),
    (
        "parquet data",
        "train.parquet",
        "data",
        "from tearless.data.rows import load_many\nload_many(target)",
        "data.train_files",
    ),
    (
        "tool config",
        "tools.yaml",
        "config",
        "from tearless.tools.registry import load_tools\nload_tools(target)",
        "actor_rollout_ref.rollout.multi_turn.tool_config_path",
    ),
]


def test_every_user_path_refuses_every_hostile_file_in_one_line(tmp_path):
    cases, expected = [], {}
    for point, rel, kind, statement, key in POINTS:
        for how in HOSTILE_KINDS:
            root = tmp_path / f"{point}-{how}".replace(" ", "_").replace("/", "_")
            if rel.startswith("model/"):
                tiny_model(root)
                (root / rel).unlink(missing_ok=True)
            make_hostile(root / rel, how, CAPS[kind][0])
            name = f"{point} / {how}"
            cases.append((name, statement, str(root / rel), str(root)))
            expected[name] = (key, str(root / rel))
    results = run_child(cases)
    wrong = {}
    for name, (key, path) in expected.items():
        kind, line = results[name]
        if not (kind in ("UserFileError", "ConfigError", "DataError") and key in line and path in line):
            wrong[name] = (kind, line[:200])
    assert wrong == {}, "\n".join(f"{k}: {v}" for k, v in wrong.items())


def test_regular_files_and_symlinks_to_them_are_read(tmp_path):
    real = tmp_path / "real.json"
    real.write_text('{"a": 1}')
    link = tmp_path / "link.json"
    link.symlink_to(real)  # the Hub cache's snapshots are symlinks to blobs
    assert read_user_file(link, key="k", kind="config") == b'{"a": 1}'
    assert check_user_file(real, key="k", kind="config") == real
    model = tiny_model(tmp_path)
    check_model_files(model, key="k")  # a real model directory passes


def test_the_cap_is_inclusive_and_the_line_says_the_sizes(tmp_path):
    f = tmp_path / "t.jinja"
    f.touch()
    cap = CAPS["template"][0]
    os.truncate(f, cap)
    assert len(read_user_file(f, key="data.x", kind="template")) == cap
    os.truncate(f, cap + 1)
    with pytest.raises(UserFileError) as info:
        check_user_file(f, key="data.x", kind="template")
    assert str(info.value) == (
        f"data.x: {f} is {cap + 1:,} bytes, above the {cap:,}-byte cap for a chat template; "
        "replace it with a regular file or change data.x"
    )


def test_a_missing_file_is_not_found_naming_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^k: {tmp_path / 'nope'} does not exist$"):
        check_user_file(tmp_path / "nope", key="k", kind="config")


def test_a_fifo_among_a_model_directorys_other_files_is_refused(tmp_path):
    model = tiny_model(tmp_path)
    os.mkfifo(model / "notes")
    with pytest.raises(UserFileError, match="notes is a FIFO"):
        check_model_files(model, key="actor_rollout_ref.model.path")
