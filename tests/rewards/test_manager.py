import gc
import math
import os
import random
import signal
import threading
import time

import pytest

from tearless.rewards import RewardManager, ScoreResult, register_scorer, registry


def item(solution, truth=None, source="test", extra_info=None):
    return {
        "data_source": source,
        "solution_str": solution,
        "ground_truth": truth,
        "extra_info": extra_info or {},
    }


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(condition, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dict_results_keep_numeric_extras(num_workers):
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": len(solution_str) / 2, "acc": solution_str == ground_truth, "pred": solution_str}

    with RewardManager(fn, num_workers=num_workers) as manager:
        results = manager.score([item("ab", "ab"), item("abc", "x")])
    assert results == [ScoreResult(1.0, {"acc": 1.0}), ScoreResult(1.5, {"acc": 0.0})]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_raising_scorer_fails_only_its_sample(num_workers):
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "bad":
            raise ValueError("cannot parse 'bad'")
        return float(solution_str)

    with RewardManager(fn, num_workers=num_workers, failure_score=-1.0) as manager:
        results = manager.score([item("1"), item("bad"), item("2.5")])
    assert results == [
        ScoreResult(1.0),
        ScoreResult(-1.0, {}, "raised: ValueError: cannot parse 'bad'"),
        ScoreResult(2.5),
    ]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_return_values_are_failures(num_workers):
    values = {"nan": math.nan, "inf": {"score": math.inf}, "str": "1.0", "none": None, "nokey": {"acc": 1}}
    with RewardManager(
        lambda data_source, solution_str, **_: values[solution_str], num_workers=num_workers
    ) as m:
        results = m.score([item(k) for k in values])
    assert [r.score for r in results] == [0.0] * 5
    assert [r.error for r in results] == [
        "returned a non-finite score (nan)",
        "returned a non-finite score (inf)",
        "returned a score of type str ('1.0'); a reward function must return a float or a dict with a "
        "numeric 'score'",
        "returned a score of type NoneType (None); a reward function must return a float or a dict with a "
        "numeric 'score'",
        "returned a dict without a 'score' key (keys: ['acc'])",
    ]


def test_a_hanging_scorer_times_out_and_its_worker_is_replaced():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "hang":
            time.sleep(60)
        return 1.0

    with RewardManager(fn, num_workers=2, timeout_s=1.0) as manager:
        manager.score([item("warm-up")])
        before = manager.worker_pids
        start = time.monotonic()
        results = manager.score([item("a"), item("hang"), item("b"), item("c"), item("d")])
        elapsed = time.monotonic() - start
        assert 1.0 <= elapsed < 3.0
        assert results[1] == ScoreResult(0.0, {}, "timeout after 1s")
        assert [r.score for i, r in enumerate(results) if i != 1] == [1.0] * 4
        after = manager.worker_pids
        assert len(after) == 2
        (killed,) = set(before) - set(after)
        assert not alive(killed)
        # The pool still works, at full size.
        assert [r.score for r in manager.score([item(str(i)) for i in range(10)])] == [1.0] * 10
        assert manager.worker_pids == after


def test_lambda_and_closure():
    weight = 3.0
    offsets = {"a": 1.0}

    def closure(data_source, solution_str, ground_truth, extra_info=None):
        return weight * len(solution_str) + offsets.get(solution_str, 0.0)

    with RewardManager(closure, num_workers=2) as manager:
        assert [r.score for r in manager.score([item("a"), item("bb")])] == [4.0, 6.0]
    with RewardManager(
        lambda data_source, solution_str, **_: float(solution_str[::-1]), num_workers=2
    ) as manager:
        assert [r.score for r in manager.score([item("12"), item("30")])] == [21.0, 3.0]


def test_a_worker_killed_from_outside_is_replaced_and_its_sample_rescored(tmp_path):
    log = tmp_path / "calls.log"

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {solution_str}\n")
        time.sleep(0.25)
        return float(solution_str)

    def kill_when_busy(pid):
        # Kill it while it sleeps inside a sample it has started, never between two samples.
        assert wait_until(lambda: log.exists() and f"{pid} " in log.read_text())
        os.kill(pid, signal.SIGKILL)

    with RewardManager(slow, num_workers=2, timeout_s=10.0) as manager:
        manager.score([item("0")])
        log.unlink()
        victim = manager.worker_pids[0]
        killer = threading.Thread(target=kill_when_busy, args=(victim,))
        killer.start()
        results = manager.score([item(str(i)) for i in range(1, 7)])
        killer.join()
        assert [(r.score, r.error) for r in results] == [(float(i), None) for i in range(1, 7)]
        calls = [line.split()[1] for line in log.read_text().splitlines()]
        # Exactly one sample was started twice: the one the killed worker was scoring.
        assert sorted(set(calls)) == [str(i) for i in range(1, 7)]
        assert len(calls) == 7
        assert len(manager.worker_pids) == 2
        assert victim not in manager.worker_pids


def test_a_sample_that_kills_its_worker_twice_fails(tmp_path):
    marker = tmp_path / "died-once"

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "crash-once" and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        if solution_str == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        return 1.0

    with RewardManager(fn, num_workers=2) as manager:
        results = manager.score([item("a"), item("crash"), item("crash-once"), item("b")])
        assert results[1] == ScoreResult(
            0.0, {}, "worker process died while scoring this sample, twice (exit code -9)"
        )
        assert [results[i] for i in (0, 2, 3)] == [ScoreResult(1.0)] * 3
        assert len(manager.worker_pids) == 2


def test_exit_in_a_scorer_is_a_failed_sample():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        raise SystemExit(3)

    with RewardManager(fn, num_workers=1) as manager:
        assert manager.score([item("x")]) == [ScoreResult(0.0, {}, "raised: SystemExit: 3")]


def test_order_is_kept_for_200_items():
    def fn(data_source, solution_str, ground_truth, extra_info=None):
        # Uneven durations, so the two workers finish their chunks out of step.
        time.sleep(random.random() * 0.002)
        return {"score": float(solution_str), "id": extra_info["id"]}

    with RewardManager(fn, num_workers=2) as manager:
        results = manager.score([item(str(i), extra_info={"id": i}) for i in range(200)])
    assert [r.score for r in results] == [float(i) for i in range(200)]
    assert [r.extra["id"] for r in results] == [float(i) for i in range(200)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_builtin_dispatcher(num_workers):
    items = [
        item("85", "85", source="arithmetic"),
        item("#### 18", "18", source="openai/gsm8k"),
        item("18", "18", source="gsm8k"),
        item("18", "18", source="gsm8k", extra_info={"method": "flexible"}),
        item("<answer>Paris</answer>", {"target": ["paris"]}, source="searchR1_nq"),
    ]
    with RewardManager(num_workers=num_workers) as manager:
        assert [r.score for r in manager.score(items)] == [1.0, 1.0, 0.0, 1.0, 1.0]
        assert len(manager.worker_pids) == num_workers
        with pytest.raises(ValueError, match="no built-in reward function for data_source 'nope'; known: "):
            manager.score([item("1", "1", source="arithmetic"), item("1", "1", source="nope")])


def test_scorer_registered_after_the_pool_started(monkeypatch):
    monkeypatch.setattr(registry, "_registered", {})
    with RewardManager(num_workers=2) as manager:
        manager.score([item("1", "1", source="arithmetic")])
        first = manager.worker_pids
        register_scorer("late_task")(lambda solution_str, ground_truth, extra_info=None: 0.5)
        assert manager.score([item("x", source="late_task")]) == [ScoreResult(0.5)]
        assert set(manager.worker_pids).isdisjoint(first)


def test_unpicklable_item_is_a_clear_error_and_the_pool_survives():
    with RewardManager(lambda **_: 1.0, num_workers=2) as manager:
        with pytest.raises(ValueError, match=r"reward items 0\.\.0 cannot be sent to a worker process"):
            manager.score([item("a", extra_info={"fn": lambda: 0})])
        assert manager.score([item("a"), item("b")]) == [ScoreResult(1.0)] * 2
        assert len(manager.worker_pids) == 2


def test_reward_kwargs_are_merged():
    def fn(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
        return scale * float(solution_str)

    with RewardManager(fn, num_workers=2, reward_kwargs={"scale": 2.0}) as manager:
        assert [r.score for r in manager.score([item("1.5")])] == [3.0]
    with pytest.raises(ValueError, match=r"reward_kwargs cannot set \['extra_info'\]"):
        RewardManager(fn, reward_kwargs={"extra_info": {}})


def test_a_function_with_the_wrong_signature_is_refused_up_front():
    with pytest.raises(TypeError, match=r"cannot be called as .*missing a required argument: 'ds'"):
        RewardManager(lambda ds, s, gt, ei=None: 1.0)

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        return 1.0

    with pytest.raises(
        TypeError, match=r"fn\(data_source=.*, scale=\.\.\.: got an unexpected keyword argument"
    ):
        RewardManager(fn, reward_kwargs={"scale": 2.0})


def test_bad_arguments_and_items():
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0, got -1"):
        RewardManager(num_workers=-1)
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        RewardManager(timeout_s=0)
    with pytest.raises(TypeError, match="score_fn must be callable, got str"):
        RewardManager("compute_score")
    with RewardManager(num_workers=0) as manager:
        assert manager.score([]) == []
        with pytest.raises(ValueError, match=r"reward item 0 lacks \['ground_truth'\]"):
            manager.score([{"data_source": "arithmetic", "solution_str": "1", "extra_info": None}])


def test_close_context_and_del_stop_the_workers():
    manager = RewardManager(lambda **_: 1.0, num_workers=2)
    manager.score([item("a")])
    pids = manager.worker_pids
    manager.close()
    assert manager.worker_pids == []
    assert not any(alive(p) for p in pids)
    # A closed manager starts new workers when used again.
    assert manager.score([item("a")]) == [ScoreResult(1.0)]
    pids = manager.worker_pids
    del manager
    gc.collect()
    assert wait_until(lambda: not any(alive(p) for p in pids))
