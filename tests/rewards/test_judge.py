"""The LLM judge reward: its parsers, and its calls against real servers on this machine: tearless's own
OpenAI-compatible endpoint serving the embedded task's warm-up model, a socket that never answers
(timeouts, retries, back-off) and a closed port (a judge that is down stops the run in one line)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tearless.cli import main
from tearless.config.schema import JudgeConfig, OverlongBufferConfig, RewardModelConfig, RewardModelPathConfig
from tearless.rewards import RewardError
from tearless.rewards.judge import Judge, JudgeError, parse_score
from tearless.rewards.managers import JudgeRewardManager, make_reward_manager, reward_config_problems
from tearless.trainers.records import ROLLOUTS_FILE, read_records
from tests.conftest import small_overrides

# The warm-up arithmetic model answers "85+11=" with "5+1=6, 96" (units first, then the sum): its last
# number is the response's value plus 11 when no carry is needed.
SUM = "{response}+11="


def test_number_and_label_parsers():
    # A 0..10 judge answering 7 scores 0.7; the first number counts; lo = -5, hi = 5: (2 + 5) / 10.
    assert parse_score("7", parser="number") == pytest.approx(0.7)
    assert parse_score("Score: 10/10", parser="number") == 1.0
    assert parse_score(" 2.0 points", parser="number", score_range=[-5, 5]) == pytest.approx(0.7)
    assert parse_score("3 of 4 steps hold, so: 8", parser="last_number") == pytest.approx(0.8)
    for reply, why in [("no idea", "has no number"), ("11", r"outside score_range \[0, 10\]")]:
        with pytest.raises(JudgeError, match=why):
            parse_score(reply, parser="number")
    labels = {"correct": 1.0, "incorrect": 0.0, "partly correct": 0.5}
    assert parse_score("Incorrect.", parser="labels", labels=labels) == 0.0  # not read as "correct"
    assert parse_score("CORRECT, and incorrect later", parser="labels", labels=labels) == 1.0
    assert parse_score("it is partly correct", parser="labels", labels=labels) == 0.5  # the longer label
    with pytest.raises(JudgeError, match="has none of the labels"):
        parse_score("correctness unclear", parser="labels", labels=labels)


@pytest.fixture(scope="module")
def endpoint(task):
    """tearless's endpoint serving the warm-up model greedily, and one session's base URL."""
    from tearless.envs.endpoint import Endpoint
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.rollout.hf import HFRollout

    tok, model = load_tokenizer(task.model_dir), load_causal_lm(task.model_dir)
    engine = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    server = Endpoint(engine, tok)
    sid = server.open_session(1, 1_000_000, {"do_sample": False})
    yield server, sid
    server.shutdown()


def items(*responses: str) -> list[dict]:
    return [{"prompt": "ignored", "solution_str": r, "ground_truth": "85"} for r in responses]


def test_scores_come_from_the_served_model_and_are_cached(endpoint):
    server, sid = endpoint
    judge = Judge(
        base_url=server.session_url(sid),
        model="m",
        prompt_template=SUM,
        parser="last_number",
        score_range=[0, 200],
        max_tokens=32,
    )
    scores = judge.score(items("85", "12", "40"))
    calls = server.sessions[sid].calls
    assert len(calls) == 3 == judge.requests_sent
    by_prompt = {c.messages[0]["content"]: c.assistant["content"] for c in calls}
    assert by_prompt == {"85+11=": "5+1=6, 96", "12+11=": "2+1=3, 23", "40+11=": "0+1=1, 51"}
    # Each score is the served model's last number in [0, 200], over 200: 96/200, 23/200, 51/200.
    assert scores == [0.48, 0.115, 0.255]
    # The same requests again: from the cache, nothing sent; a new one is sent.
    assert judge.score(items("40", "85")) == [0.255, 0.48] and judge.requests_sent == 3
    judge.score(items("7"))
    assert judge.requests_sent == 4 and len(server.sessions[sid].calls) == 4


def test_a_batch_of_requests_at_once_is_served_without_resets(endpoint):
    # 128 connections at once: the endpoint's listen queue must hold them (socketserver's default of 5
    # reset about half of them on 2 cores, each then retried after backoff_s).
    server, _ = endpoint
    sid = server.open_session(3, 1 << 40, {"do_sample": False})
    judge = Judge(
        base_url=server.session_url(sid),
        model="m",
        prompt_template="{response}+{ground_truth}=",  # 128 distinct sums of the task's kind
        parser="last_number",
        score_range=[0, 1000],
        max_tokens=16,
        max_concurrency=128,
        max_retries=0,
    )
    sums = [
        {"prompt": "p", "solution_str": str(10 + i % 64), "ground_truth": str(20 + i // 64)}
        for i in range(128)
    ]
    scores = judge.score(sums)
    assert [s for s in scores if isinstance(s, JudgeError)] == []
    assert judge.requests_sent == 128 == len(server.sessions[sid].calls)


@contextmanager
def serving(answer: Callable[[BaseHTTPRequestHandler, dict], None]) -> Iterator[str]:
    """A real HTTP server on this machine whose POST replies are written by ``answer(handler, body)``;
    yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            answer(self, json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        def log_message(self, *args: object) -> None:  # no access log on the test's stderr
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        server.shutdown()
        server.server_close()


def half_body(status: int) -> Callable[[BaseHTTPRequestHandler, dict], None]:
    """Announces a 200-byte body, sends 19 bytes of it and hangs up (a server dropping mid-reply)."""

    def answer(handler: BaseHTTPRequestHandler, body: dict) -> None:
        handler.send_response(status)
        handler.send_header("Content-Length", "200")
        handler.end_headers()
        handler.wfile.write(b'{"choices": [{"mess')

    return answer


def not_http(handler: BaseHTTPRequestHandler, body: dict) -> None:
    handler.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")


def echo(handler: BaseHTTPRequestHandler, body: dict) -> None:
    """A chat completion whose reply is the request's user message."""
    reply = json.dumps({"choices": [{"message": {"content": body["messages"][0]["content"]}}]}).encode()
    handler.send_response(200)
    handler.send_header("Content-Length", str(len(reply)))
    handler.end_headers()
    handler.wfile.write(reply)


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (half_body(200), "IncompleteRead"),
        (half_body(503), "HTTP 503 from "),  # the error body itself is cut short
        (not_http, "BadStatusLine"),
    ],
)
def test_a_reply_cut_short_or_not_http_is_retried_and_fails_the_sample(answer, why):
    with serving(answer) as url:
        judge = sum_judge(url, max_retries=1, sleep=lambda _: None)
        (result,) = judge.score(items("85"))
    assert isinstance(result, JudgeError) and why in str(result) and str(result).endswith("(1 retries)")
    assert judge.requests_sent == 2


def test_the_cache_keeps_the_most_recently_used_requests():
    with serving(echo) as url:
        judge = Judge(base_url=url, model="m", prompt_template="{response}", max_concurrency=1, cache_size=2)
        # The echo server replies with the response itself: "3" scores 3/10.
        assert judge.score(items("1", "2", "3")) == [0.1, 0.2, 0.3] and judge.requests_sent == 3
        judge.score(items("1"))  # evicted by "3" (the cache holds "2", "3"): sent again
        assert judge.requests_sent == 4
        judge.score(items("3"))  # cached, and now the most recent
        assert judge.requests_sent == 4
        judge.score(items("2"))  # evicted by "1": sent again, evicting "1"
        assert judge.requests_sent == 5 and len(judge.cache) == 2
        judge.score(items("3", "2"))
        assert judge.requests_sent == 5
        uncached = Judge(base_url=url, model="m", prompt_template="{response}", cache_size=0)
        uncached.score(items("1"))
        uncached.score(items("1"))
        assert uncached.requests_sent == 2 and len(uncached.cache) == 0


def test_an_http_error_that_retrying_cannot_fix_is_not_retried(endpoint):
    server, _ = endpoint
    url = f"http://127.0.0.1:{server.port}/closed-session/v1"
    sleeps: list[float] = []
    judge = sum_judge(url, sleep=sleeps.append)
    (result,) = judge.score(items("85"))
    assert isinstance(result, JudgeError) and "HTTP 404" in str(result)
    assert judge.requests_sent == 1 and sleeps == []


@contextmanager
def silent_server(backlog: int) -> Iterator[str]:
    """The base URL of a socket on this machine that accepts ``backlog`` connections (the kernel's
    queue) and never answers."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(backlog)
        yield f"http://127.0.0.1:{silent.getsockname()[1]}/v1"


def sum_judge(url: str, **settings: object) -> Judge:
    """A judge at ``url`` asking for the sum prompt, with ``settings`` (Judge's keywords)."""
    return Judge(base_url=url, model="m", prompt_template=SUM, **settings)


def test_a_judge_that_never_answers_times_out_and_is_retried_with_back_off():
    with silent_server(16) as url:
        sleeps: list[float] = []
        judge = sum_judge(
            url,
            timeout_s=0.2,
            max_retries=2,
            backoff_s=0.5,
            sleep=sleeps.append,
        )
        (result,) = judge.score(items("85"))
    assert isinstance(result, JudgeError)
    assert "timed out after timeout_s=0.2 (2 retries)" in str(result)
    assert judge.requests_sent == 3 and sleeps == [0.5, 1.0]  # backoff_s × 2^(k-1) before retry k


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failures_get_the_failure_score_and_a_judge_that_is_down_stops_the_run():
    judge = sum_judge(
        f"http://127.0.0.1:{closed_port()}/v1",
        max_retries=1,
        max_failures=5,
        sleep=lambda _: None,
    )
    manager = JudgeRewardManager(judge, failure_score=-1.0)
    first = manager.score(items("1", "2", "3"))
    assert [r.score for r in first] == [-1.0] * 3 and all("Connection refused" in r.error for r in first)
    # Failures in a row carry over batches: the fifth stops the run, in one line naming the key.
    with pytest.raises(RewardError) as stop:
        manager.score(items("4", "5", "6"))
    message = str(stop.value)
    assert message.startswith("reward_model.judge: 5 samples in a row failed to be judged (last: ")
    assert "\n" not in message and "reward_model.judge.max_failures" in message


def test_a_silent_judge_stops_a_large_batch_without_judging_the_rest():
    with silent_server(64) as url:
        judge = sum_judge(
            url,
            max_concurrency=4,
            timeout_s=0.2,
            max_retries=2,
            backoff_s=0.05,
            max_failures=3,
        )
        started = time.monotonic()
        with pytest.raises(RewardError, match="3 samples in a row failed"):
            JudgeRewardManager(judge).score(items(*map(str, range(40))))
        elapsed = time.monotonic() - started
    # One sample takes 3 timeouts of 0.2 s and back-offs of 0.05 + 0.1 s: 0.75 s. Judging all 40, four
    # at a time, would send 120 requests in 7.5 s. The third failure stops the judge: only samples begun
    # before it (at most 3 - 1 failed + 4 in flight) sent anything, each at most 3 requests.
    assert judge.requests_sent <= (3 - 1 + 4) * 3
    assert elapsed < 2 * 0.75 + 2.0  # two samples' time in a row, plus 2 s for a loaded machine


def test_close_ends_the_back_off_of_requests_in_flight():
    judge = sum_judge(
        f"http://127.0.0.1:{closed_port()}/v1",
        max_retries=3,
        backoff_s=60.0,
    )
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(judge.score(items("1", "2"))))
    started = time.monotonic()
    worker.start()
    time.sleep(0.3)  # both refused once, now waiting 60 s before their retry
    judge.close()
    worker.join(timeout=10)
    assert not worker.is_alive() and time.monotonic() - started < 10
    assert judge.requests_sent == 2
    assert all(isinstance(r, JudgeError) and "not sent: the judge was closed" in str(r) for r in results)


def test_tearless_train_with_a_judge_that_refuses_stops_in_one_line(task, tmp_path, capsys):
    args = small_overrides(
        task,
        tmp_path,
        "reward_model.judge.enable=true",
        f"reward_model.judge.base_url=http://127.0.0.1:{closed_port()}/v1",
        "reward_model.judge.max_retries=0",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
    )
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        "tearless: error: reward_model.judge: 10 samples in a row"
    )


def test_a_run_whose_only_reward_is_the_judge_served_by_the_endpoint(endpoint, task, tmp_path):
    server, _ = endpoint
    sid = server.open_session(2, 1 << 40, {"do_sample": False})  # a session of its own: its calls alone
    args = small_overrides(
        task,
        tmp_path,
        "reward_model.judge.enable=true",
        f"reward_model.judge.base_url={server.session_url(sid)}",
        f"reward_model.judge.prompt_template='{SUM}'",
        "reward_model.judge.parser=last_number",
        "reward_model.judge.score_range=[0,200]",
        "reward_model.judge.max_tokens=32",
        "reward_model.failure_score=-1",
        "reward_model.judge.max_failures=1000",  # the warm-up model answers some sums with nothing
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "data.val_max_samples=8",
    )
    assert main(["train", *args]) == 0
    samples = read_records(tmp_path / ROLLOUTS_FILE)
    assert len(samples) == 2 * 8 * 4
    replies = {c.messages[0]["content"]: c.assistant["content"] for c in server.sessions[sid].calls}
    for sample in samples:
        # The judge alone: its reply's last number / 200 (or failure_score when it has none in
        # [0, 200]), and the task's scorer never called (rule_weight=0): no extra of its own.
        reply = replies[sample["response"] + "+11="]
        try:
            expected = parse_score(reply, parser="last_number", score_range=[0, 200])
        except JudgeError:
            expected = -1.0
        # The rollout holds scores in float32: the judge's score rounded to it, exactly.
        assert sample["score"] == torch.tensor(expected, dtype=torch.float32).item(), (sample, reply)
        assert set(sample["reward_extra"]) <= {"judge_score"}
    assert any(0 < s["score"] < 1 for s in samples)  # scores in between: not a 0/1 rule in disguise


def test_validation_of_a_judged_run_is_the_tasks_own_accuracy(endpoint, task, tmp_path):
    # The judge trains; held-out accuracy is the task's scorer's (veRL validates with rule-based rewards
    # only): the judged run's validation equals the same model's validation with the rule reward, and
    # the judge is not asked about a held-out answer. Before, acc/greedy was "judge score >= 1".
    from tearless import train

    server, _ = endpoint
    sid = server.open_session(3, 1 << 40, {"do_sample": False})
    judged = [
        "reward_model.judge.enable=true",
        f"reward_model.judge.base_url={server.session_url(sid)}",
        f"reward_model.judge.prompt_template='{SUM}'",
        "reward_model.judge.parser=last_number",
        "reward_model.judge.score_range=[0,200]",
        "reward_model.judge.max_failures=1000",
    ]
    common = ("trainer.val_only=true", "trainer.val_before_train=true", "data.val_max_samples=16")
    truth = train(None, small_overrides(task, tmp_path / "rule", *common), log=lambda _: None)["before"]
    seen = train(None, small_overrides(task, tmp_path / "judged", *common, *judged), log=lambda _: None)
    seen = seen["before"]
    key = "val-core/arithmetic/acc/greedy"
    assert 0 < truth[key] < 1 and seen[key] == truth[key], (seen, truth)
    assert server.sessions[sid].calls == []


def judge_config(**judge) -> RewardModelConfig:
    return RewardModelConfig(
        model=RewardModelPathConfig(), overlong_buffer=OverlongBufferConfig(), judge=JudgeConfig(**judge)
    )


@pytest.mark.parametrize(
    ("judge", "key", "problem"),
    [
        ({}, "base_url", "None is not an http(s) URL"),
        ({"prompt_template": "rate {answer}"}, "prompt_template", "unknown field(s) ['answer']"),
        ({"prompt_template": "rate {prompt}"}, "prompt_template", "has no {response}"),
        ({"parser": "regex"}, "parser", "'regex' is not a parser"),
        ({"score_range": [10, 0]}, "score_range", "is not [lo, hi] with lo < hi"),
        ({"parser": "labels"}, "labels", "is empty but parser=labels"),
        ({"max_concurrency": 0}, "max_concurrency", "must be >= 1"),
        ({"prompt_template": "rate {response} }"}, "prompt_template", "Single '}' encountered"),
        ({"prompt_template": "rate {response:d}"}, "prompt_template", "{response:d} has a format spec"),
        ({"prompt_template": "rate {response!r}"}, "prompt_template", "{response!r} has a conversion"),
        ({"parser": "labels", "labels": {"good": "yes"}}, "labels", "'good': 'yes' is not a number"),
        ({"timeout_s": 0}, "timeout_s", "must be > 0"),
        ({"cache_size": -1}, "cache_size", "must be >= 0"),
    ],
)
def test_config_problems_name_the_key(judge, key, problem):
    base = {"enable": True, "base_url": "http://127.0.0.1:8000/v1"}
    cfg = judge_config(**{**base, **judge}) if judge else judge_config(enable=True)
    (found,) = [p for p in reward_config_problems(cfg, max_response_length=16) if p[0].endswith(key)]
    assert found[0] == f"reward_model.judge.{key}" and problem in found[1]
    with pytest.raises(ValueError, match=f"reward_model.judge.{key}"):
        make_reward_manager(cfg, max_response_length=16)
    assert reward_config_problems(judge_config(**base), max_response_length=16) == []
