"""Rollout records (gzip members per step, cap, torn tail, resume truncation) and the MLflow logger."""

from __future__ import annotations

import gzip
import sys
import types

import pytest

from tearless.run.tracking import Tracker, mlflow_name, read_metrics
from tearless.trainers.records import append_step, encode_step, read_records, truncate_records


def step_records(step: int, n: int = 3) -> list[dict]:
    return [
        {"step": step, "uid": f"{step}-1-0", "response": f"r{step}.{i}", "score": float(i)} for i in range(n)
    ]


def write_steps(path, steps) -> None:
    for s in steps:
        assert append_step(path, step_records(s))


def test_each_step_is_an_independent_gzip_member_readable_as_one_file(tmp_path):
    path = tmp_path / "rollouts.jsonl.gz"
    write_steps(path, [1, 2, 3])
    assert [r["step"] for r in read_records(path)] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    # Concatenated members are one valid gzip stream for any reader (zcat, gzip.open).
    assert gzip.decompress(path.read_bytes()).decode().count("\n") == 9
    # No timestamp in the header: the same records give the same bytes.
    assert encode_step(step_records(1)) == encode_step(step_records(1))


def test_a_torn_last_member_loses_only_that_step(tmp_path):
    path = tmp_path / "rollouts.jsonl.gz"
    write_steps(path, [1, 2])
    whole = path.read_bytes()
    last = encode_step(step_records(3))
    for cut in (1, 10, len(last) // 2, len(last) - 1):  # a crash anywhere inside step 3's write
        path.write_bytes(whole + last[:cut])
        assert [r["step"] for r in read_records(path)] == [1, 1, 1, 2, 2, 2], cut
    path.write_bytes(whole + b"not gzip at all")
    assert len(read_records(path)) == 6
    assert read_records(tmp_path / "missing.gz") == []


def test_the_size_cap_refuses_a_step_that_would_pass_it(tmp_path):
    path = tmp_path / "rollouts.jsonl.gz"
    member = len(encode_step(step_records(1)))
    cap = 2 * member + member // 2  # room for two members of this size, not three
    written = [s for s in range(1, 6) if append_step(path, step_records(s), max_bytes=cap)]
    assert written == [1, 2] and path.stat().st_size <= cap
    assert append_step(path, step_records(9), max_bytes=0)  # 0 = no cap


@pytest.mark.parametrize("last_step, kept", [(2, [1, 2]), (0, []), (-1, []), (5, [1, 2, 3])])
def test_resume_truncation_keeps_exactly_the_steps_up_to_the_checkpoint(tmp_path, last_step, kept):
    path = tmp_path / "rollouts.jsonl.gz"
    write_steps(path, [1, 2, 3])
    path.write_bytes(path.read_bytes() + encode_step(step_records(4))[:7])  # and a torn step 4
    truncate_records(path, last_step)
    assert sorted({r["step"] for r in read_records(path)}) == kept
    assert len(read_records(path)) == 3 * len(kept)
    assert [p.name for p in tmp_path.iterdir()] == ["rollouts.jsonl.gz"]  # no temporary left over
    append_step(path, step_records(7))  # the rewritten file still takes appends
    assert read_records(path)[-1]["step"] == 7


def test_mlflow_names_replace_only_forbidden_characters():
    assert mlflow_name("val-core/arithmetic/acc/mean@4") == "val-core/arithmetic/acc/mean_4"
    assert mlflow_name("timing_s/update_actor") == "timing_s/update_actor"
    assert mlflow_name("a b.c-d/e") == "a b.c-d/e"


def tracker(tmp_path, loggers):
    return Tracker(tmp_path, loggers, total_steps=2, config={"a": 1}, project="p", experiment="e")


def test_mlflow_missing_names_the_config_key_and_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # importing it raises ImportError
    with pytest.raises(ImportError, match=r"trainer\.logger has mlflow.*pip install mlflow"):
        tracker(tmp_path, ["jsonl", "mlflow"])


def test_mlflow_gets_the_same_metrics_as_the_jsonl(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("mlflow")
    for name in ("set_tracking_uri", "set_experiment", "start_run", "log_dict", "log_metrics", "end_run"):
        setattr(fake, name, lambda *a, _name=name, **k: calls.append((_name, a, k)))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    t = tracker(tmp_path, ["jsonl", "mlflow"])
    t.log({"val-core/x/acc/pass@2": 0.5, "timing_s/gen": 1, "note": "text", "bad": float("nan")}, 1)
    t.close()
    names = [c[0] for c in calls]
    assert names == ["set_tracking_uri", "set_experiment", "start_run", "log_dict", "log_metrics", "end_run"]
    assert calls[0][1][0].endswith("/mlruns") and calls[2][2] == {"run_name": "e"}
    assert calls[4][1][0] == {"val-core/x/acc/pass_2": 0.5, "timing_s/gen": 1.0}
    assert calls[4][2] == {"step": 1}


def test_metrics_jsonl_is_written_whatever_the_logger_list(tmp_path):
    import io

    t = Tracker(
        tmp_path, ["console"], total_steps=1, config={}, project="p", experiment="e", stream=io.StringIO()
    )
    t.log({"critic/score/mean": 0.5}, 1)
    t.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "critic/score/mean": 0.5}]


def test_a_run_with_no_step_left_says_so_and_how_to_train_again():
    from tearless.trainers.progress import say_if_complete

    class Lines:
        def __init__(self):
            self.lines = []

        def write(self, text):
            self.lines.append(text)

    tracker = Lines()
    say_if_complete(tracker, "runs/x", 3, 4, "use another name")  # a step is left: silent
    assert tracker.lines == []
    say_if_complete(tracker, "runs/x", 4, 4, "use another name")
    (line,) = tracker.lines
    assert line == "the run in runs/x is already complete (4 steps); use another name to train again"
