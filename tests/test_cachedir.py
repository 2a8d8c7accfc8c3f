"""cached_build: built once under a temporary name, renamed when complete, reused after."""

from __future__ import annotations

import json
import os

from tearless.cachedir import cached_build, settings_key


def test_a_build_runs_once_and_its_description_is_read_back(tmp_path):
    calls = []

    def build(tmp):
        calls.append(tmp)
        (tmp / "weights.bin").write_bytes(b"\x01\x02")
        return {"loss": 0.25}

    final = tmp_path / "task-abc"
    assert cached_build(final, "info.json", build) == {"loss": 0.25}
    assert calls == [tmp_path / f".task-abc.tmp-{os.getpid()}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task-abc"]  # the temporary name is gone
    assert sorted(p.name for p in final.iterdir()) == ["info.json", "weights.bin"]
    assert cached_build(final, "info.json", build) == {"loss": 0.25} and len(calls) == 1
    assert cached_build(final, "info.json", build, fresh=True) == {"loss": 0.25} and len(calls) == 2


def test_an_interrupted_build_is_neither_used_nor_left_behind(tmp_path):
    final = tmp_path / "task-abc"
    ours = tmp_path / f".task-abc.tmp-{os.getpid()}"
    (ours / "half").mkdir(parents=True)  # a build of this process that died half-way, marker included
    (ours / "info.json").write_text(json.dumps({"stale": True}))

    def build(tmp):
        assert list(tmp.iterdir()) == []  # the build starts from an empty directory
        return {"n": 1}

    assert cached_build(final, "info.json", build) == {"n": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task-abc"]


def test_the_build_another_process_renamed_into_place_first_is_kept(tmp_path):
    final = tmp_path / "k"

    def build(tmp):
        final.mkdir()  # the other process finishes while ours runs
        (final / "info.json").write_text(json.dumps({"who": "them"}))
        return {"who": "us"}

    assert cached_build(final, "info.json", build) == {"who": "them"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k"]


def test_the_key_is_the_hash_of_the_settings_whatever_their_order():
    assert settings_key({"a": 1, "b": [2, 3]}) == settings_key({"b": [2, 3], "a": 1})
    assert settings_key({"a": 1}) != settings_key({"a": 2})
    assert len(settings_key({})) == 12 and int(settings_key({}), 16) >= 0
