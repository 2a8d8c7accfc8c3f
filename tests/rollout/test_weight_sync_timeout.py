"""The bounded wait around a rollout engine's weight sync (no vLLM needed to test the bound itself)."""

from __future__ import annotations

import threading
import time

import pytest

from tearless.rollout.vllm import run_with_timeout

KEY = "actor_rollout_ref.rollout.weight_sync_timeout_s"


def test_a_stuck_sync_times_out_naming_the_key():
    release = threading.Event()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=KEY.replace(".", r"\.")):
        run_with_timeout(lambda: release.wait(30), 0.3, "vLLM weight sync", KEY)
    assert time.monotonic() - started < 5
    release.set()


def test_an_error_in_the_sync_reaches_the_caller_and_a_quick_sync_returns():
    def broken():
        raise RuntimeError("shape mismatch in lm_head")

    with pytest.raises(RuntimeError, match="lm_head"):
        run_with_timeout(broken, 5, "vLLM weight sync", KEY)
    done = []
    run_with_timeout(lambda: done.append(1), 5, "vLLM weight sync", KEY)
    assert done == [1]
