"""A campaign of bad inputs to ``tearless train``, each classified by what the user sees.

Each case is a command line (and the files it needs, made by :func:`make_cases`) that tearless must
refuse. :func:`classify` reads the outcome: ``one-line`` (a non-zero exit whose stderr ends in one
``tearless: …`` line and holds no traceback), ``traceback``, ``silent`` (exit 0: the input was
accepted, or the process ended without a word) or ``hang`` (still running at the time limit). Run by
``benchmarks/reliability.py --bad-inputs`` (every case, as real processes; the counts of
RELIABILITY.md) and ``tests/faults/test_one_line_errors.py`` (a few, in CI).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tearless.tasks.tokenizer import build_char_tokenizer


@dataclass
class Case:
    name: str
    overrides: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # RLIMIT_AS of the process: a case that could read without end (a link to /dev/zero) fails with
    # MemoryError inside its own limit instead of waking the kernel's OOM killer.
    memory_limit: int | None = None


HOSTILE_KINDS = ("FIFO", "/dev/zero link", "directory", "broken symlink", "too large")
HOSTILE_MEMORY = 4 << 30


def make_hostile(path: Path, how: str, cap: int) -> None:
    """Put the hostile thing ``how`` (one of :data:`HOSTILE_KINDS`) at ``path``; ``too large`` is a
    sparse file of ``cap`` + 1 bytes (no disk, no time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if how == "FIFO":
        os.mkfifo(path)
    elif how == "/dev/zero link":
        path.symlink_to("/dev/zero")
    elif how == "directory":
        path.mkdir()
    elif how == "broken symlink":
        path.symlink_to(path.parent / "nothing-here")
    else:
        path.touch()
        os.truncate(path, cap + 1)


def hostile_file_cases(task, root: Path) -> list[Case]:
    """Every user-given path key, with each hostile kind of file where tearless reads it."""
    from tearless.userfiles import CAPS

    model_key, mt = "actor_rollout_ref.model.path", "actor_rollout_ref.rollout.multi_turn"
    places = [  # (key, the file made hostile, its cap's kind, the overrides given that file)
        (model_key, "model/config.json", "config", lambda p: [f"{model_key}={p.parent}"]),
        (
            "actor_rollout_ref.model.tokenizer_path",
            "tokenizer/tokenizer.json",
            "tokenizer",
            lambda p: [f"actor_rollout_ref.model.tokenizer_path={p.parent}"],
        ),
        ("data.train_files", "train.jsonl", "jsonl", lambda p: [f"data.train_files={p}"]),
        ("data.val_files", "val.parquet", "data", lambda p: [f"data.val_files={p}"]),
        ("custom_reward_function.path", "reward.py", "code", lambda p: [f"custom_reward_function.path={p}"]),
        (
            f"{mt}.tool_config_path",
            "tools.yaml",
            "config",
            lambda p: [f"{mt}.enable=true", f"{mt}.tool_config_path={p}"],
        ),
    ]
    cases = []
    for key, rel, kind, overrides in places:
        for how in HOSTILE_KINDS:
            where = root / "hostile" / f"{key}-{how}".replace("/", "_").replace(" ", "_")
            if rel.startswith("model/"):
                shutil.copytree(task.model_dir, where / "model")
            if rel.startswith("tokenizer/"):
                shutil.copytree(task.model_dir, where / "tokenizer")
            (where / rel).unlink(missing_ok=True)
            make_hostile(where / rel, how, CAPS[kind][0])
            cases.append(Case(f"hostile {key}: {how}", overrides(where / rel), memory_limit=HOSTILE_MEMORY))
    return cases


def _model_copy(task, root: Path, name: str) -> Path:
    target = root / name
    shutil.copytree(task.model_dir, target)
    return target


def _edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))


def _checkpoint(run: Path, state: bytes | None, manifest: dict | None) -> None:
    """A run directory holding one complete ``global_step_1`` with the given state file bytes."""
    ckpt = run / "global_step_1"
    (ckpt / "actor").mkdir(parents=True)
    if state is not None:
        (ckpt / "trainer_state.pt").write_bytes(state)
    if manifest is not None:
        (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    (ckpt / "COMPLETE").write_text("1")


class _Payload:
    """Unpickling this would run code (torch.load with weights_only=False)."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/tearless-bad-input-pickle-ran",))


def make_cases(task, root: Path) -> list[Case]:
    """Every case, with its files under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    cases = [
        Case("seed 2**64", ["trainer.seed=18446744073709551616"]),
        Case("num_threads -1", ["trainer.num_threads=-1"]),
        Case("missing interpolation", ["trainer.seed=${nope.nope}"]),
        Case("chat template 123", ["data.chat_template=123"]),
        Case("chat template true", ["data.chat_template=true"]),
        Case("chat template path", ["data.chat_template=templates/chat.jinja"]),
        Case("chat template syntax", ["data.chat_template='{% for m in messages %}'"]),
        Case("chat template sandbox escape", ["data.chat_template='{{ messages.__class__.__mro__ }}'"]),
        Case("chat template empty render", ["data.chat_template='{% for m in messages %}{% endfor %}'"]),
        Case("chat template constant", ["data.chat_template='{{ \"hello\" }}'"]),
        Case("unknown key", ["trainer.no_such_key=1"]),
        Case("learning rate nan", ["actor_rollout_ref.actor.optim.lr=nan"]),
        Case("rollout.n 0", ["actor_rollout_ref.rollout.n=0"]),
        Case("negative steps", ["trainer.total_training_steps=-1"]),
        Case("unknown logger", ["trainer.logger=[nope]"]),
        Case("missing model", [f"actor_rollout_ref.model.path={root / 'no_model'}"]),
        Case("missing data", [f"data.train_files={root / 'no_data.parquet'}"]),
        Case("missing reward file", [f"custom_reward_function.path={root / 'no_reward.py'}"]),
        Case(
            "resume path not a checkpoint",
            ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={root}"],
        ),
    ]
    not_parquet = root / "not_parquet.parquet"
    not_parquet.write_text("this is not parquet\n")
    cases.append(Case("data file not parquet", [f"data.train_files={not_parquet}"]))
    not_json = root / "bad.jsonl"
    not_json.write_text('{"prompt": "1+1=", \n')
    cases.append(Case("data file not JSON lines", [f"data.train_files={not_json}"]))
    model = _model_copy(task, root, "remote_code")
    _edit_config(model, model_type="tearless_remote", auto_map={"AutoModelForCausalLM": "modeling_x.Model"})
    (model / "modeling_x.py").write_text("open('/tmp/tearless-bad-input-remote-code-ran', 'w').close()\n")
    cases.append(Case("trust_remote_code model", [f"actor_rollout_ref.model.path={model}"]))
    model = _model_copy(task, root, "unknown_type")
    _edit_config(model, model_type="nope_model")
    cases.append(Case("unknown model_type", [f"actor_rollout_ref.model.path={model}"]))
    model = _model_copy(task, root, "truncated")
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cases.append(Case("truncated safetensors", [f"actor_rollout_ref.model.path={model}"]))
    model = _model_copy(task, root, "hanging_template")
    (model / "chat_template.jinja").write_text(
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    )
    cases.append(Case("model template that never ends", [f"actor_rollout_ref.model.path={model}"]))
    big = root / "big_tokenizer"
    build_char_tokenizer(extra_tokens=[f"<t{i}>" for i in range(400)]).save_pretrained(big)
    cases.append(Case("vocabulary mismatch", [f"actor_rollout_ref.model.tokenizer_path={big}"]))
    run = root / "pickle_run"
    buffer = root / "payload.pt"
    torch.save({"global_step": 1, "config": {}, "x": _Payload()}, buffer)
    _checkpoint(run, buffer.read_bytes(), None)
    cases.append(Case("pickled trainer state", [f"trainer.default_local_dir={run}"]))
    run = root / "damaged_run"
    torch.save({"global_step": 1, "config": {}}, buffer)
    _checkpoint(
        run, buffer.read_bytes(), {"version": 1, "files": {"trainer_state.pt": {"size": 1, "sha256": "0"}}}
    )
    cases.append(Case("every checkpoint damaged", [f"trainer.default_local_dir={run}"]))
    raises = root / "raises_on_import.py"
    raises.write_text("RATE = 1 / 0\n")
    cases.append(Case("reward file raises on import", [f"custom_reward_function.path={raises}"]))
    exits = root / "exits.py"
    exits.write_text("import os\n\ndef compute_score(**kwargs):\n    os._exit(3)\n")
    cases.append(
        Case(
            "in-process reward os._exit",
            [f"custom_reward_function.path={exits}", "reward_model.num_workers=0"],
        )
    )
    return cases + hostile_file_cases(task, root)


def base_overrides(task, run_dir: Path) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={task.model_dir}",
        f"data.train_files={task.train_file}",
        f"data.val_files={task.val_file}",
        f"trainer.default_local_dir={run_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=8",
        "data.val_max_samples=4",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=1",
        "trainer.logger=[jsonl]",
        "trainer.num_threads=1",
    ]


def classify(returncode: int | None, stderr: str) -> str:
    """``one-line``, ``traceback``, ``silent`` or ``hang`` (``returncode`` None: killed at the limit)."""
    if returncode is None:
        return "hang"
    if "Traceback (most recent call last)" in stderr:
        return "traceback"
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if returncode != 0 and lines and lines[-1].startswith("tearless:"):
        return "one-line"
    return "silent"


def _address_space(limit: int):
    def set_limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return set_limit


def run_case(case: Case, task, run_dir: Path, limit_s: float) -> tuple[str, str, float]:
    """Run one case as a real ``tearless train`` process; ``(class, last stderr line, seconds)``."""
    args = [*base_overrides(task, run_dir), *case.overrides]
    entry = "import sys; from tearless.cli import main; sys.exit(main(sys.argv[1:]))"
    command = [sys.executable, "-c", entry, "train", *args]
    started = time.monotonic()
    err_file = run_dir.with_suffix(".stderr")
    with open(err_file, "w") as err:
        process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, **case.env},
            cwd=run_dir.parent,
            preexec_fn=None if case.memory_limit is None else _address_space(case.memory_limit),
        )
        try:
            returncode = process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            returncode = None
    stderr = err_file.read_text(errors="replace")
    last = next(iter(reversed([line for line in stderr.splitlines() if line.strip()])), "")
    return classify(returncode, stderr), last[:300], time.monotonic() - started
