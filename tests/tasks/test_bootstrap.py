"""prepare_task: built once, cached by its settings, and never confused by an interrupted build."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tearless.tasks.bootstrap import TaskSpec
from tearless.trainers.warmup import prepare_task

TINY = TaskSpec(num_train=40, num_val=10, warmup_steps=2, hidden_size=32, num_layers=1)


def test_the_session_task_is_reused_without_a_rebuild(task, task_spec):
    root = Path(task.model_dir).parent.parent
    logs = []
    started = time.perf_counter()
    again = prepare_task(task_spec, root, log=logs.append)
    assert time.perf_counter() - started < 2.0
    assert logs == []  # no "building ..." message
    assert again == task
    assert task.info["spec"]["warmup_steps"] == 300 and task.info["warmup_final_loss"] < 0.2


def test_a_stale_temporary_build_is_ignored_and_the_cache_is_keyed_by_settings(tmp_path):
    # An interrupted build of the same spec left a temporary directory that even has a task.json.
    stale = tmp_path / f".{TINY.key()}.tmp-99999"
    (stale / "model").mkdir(parents=True)
    (stale / "task.json").write_text(json.dumps({"stale": True}))
    logs = []
    files = prepare_task(TINY, tmp_path, log=logs.append)
    assert any("building" in line for line in logs)
    assert files.info["spec"]["num_train"] == 40 and "stale" not in files.info
    assert files.model_dir == str(tmp_path / TINY.key() / "model")
    assert (tmp_path / TINY.key() / "model" / "config.json").is_file()
    # No temporary directory of ours is left behind (the stale one of another pid is not ours).
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([TINY.key(), stale.name])

    mtime = (tmp_path / TINY.key() / "task.json").stat().st_mtime_ns
    logs.clear()
    assert prepare_task(TINY, tmp_path, log=logs.append) == files
    assert logs == [] and (tmp_path / TINY.key() / "task.json").stat().st_mtime_ns == mtime

    # Another setting is another cache entry; fresh=True rebuilds.
    other = TaskSpec(num_train=41, num_val=10, warmup_steps=2, hidden_size=32, num_layers=1)
    assert other.key() != TINY.key()
    rebuilt = prepare_task(TINY, tmp_path, fresh=True, log=logs.append)
    assert any("building" in line for line in logs)
    assert rebuilt.train_file == files.train_file


@pytest.mark.parametrize("field", ["num_train", "warmup_steps", "forget_carry", "seed", "hidden_size"])
def test_every_setting_changes_the_cache_key(field):
    value = getattr(TINY, field)
    changed = TaskSpec(**{**TINY.__dict__, field: value + 1 if not isinstance(value, float) else 0.5})
    assert changed.key() != TINY.key()
    assert TINY.key() == TaskSpec(**TINY.__dict__).key()


def test_the_cache_follows_xdg_cache_home_unless_tearless_cache_is_set(monkeypatch, tmp_path):
    from tearless.cachedir import default_cache_dir

    monkeypatch.delenv("TEARLESS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tearless"
    monkeypatch.setenv("TEARLESS_CACHE", str(tmp_path / "own"))
    assert default_cache_dir() == tmp_path / "own"
    # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
    monkeypatch.delenv("TEARLESS_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "tearless"


def test_the_warm_up_prints_its_progress(tmp_path):
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    lines: list[str] = []
    prepare_task(TaskSpec(num_train=20, num_val=5, warmup_steps=20), tmp_path, log=lines.append)
    progress = [line for line in lines if "warm-up step" in line]
    # 20 steps: a line every 2 steps, the last at 20/20.
    assert len(progress) == 10 and progress[-1].startswith("  warm-up step 20/20: loss ")
