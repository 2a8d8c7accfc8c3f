"""A real Search-R1 training run: the agent loop in the RL step and in validation, its metrics, tool
calls in the rollout records, and a resumable run. (Learning itself is measured in
benchmarks/search_r1.py: the warm-up that makes it learnable takes minutes.)"""

from __future__ import annotations

import json
import math

import pytest

from tearless import train
from tearless.run.tracking import read_metrics
from tearless.tools import load_tools
from tearless.trainers.records import read_records
from tests.conftest import search_r1_overrides

pytestmark = pytest.mark.slow


def test_search_r1_preset_trains_with_the_agent_loop(tmp_path):
    summary = train(
        None,
        search_r1_overrides(
            tmp_path / "cache",
            tmp_path / "run",
            "trainer.num_rollout_samples=16",  # every response of a step
            "actor_rollout_ref.rollout.val_kwargs.n=2",
        ),
        preset="search_r1",
        log=lambda _: None,
    )
    key = "val-core/searchR1_multihop/acc/greedy"
    assert 0.0 <= summary["before"][key] <= 1.0 and key in summary["after"]
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "critic/score/mean" in r]
    assert len(records) == 2
    for r in records:
        for name in ("num_turns/mean", "tool_calls/mean", "tool_errors", "answered", "tool_token_share"):
            assert math.isfinite(r[f"multi_turn/{name}"])
        assert 1.0 <= r["multi_turn/num_turns/mean"] <= 4.0
        assert r["response_length/max"] <= 64
    calls = [c for rec in read_records(tmp_path / "run" / "rollouts.jsonl.gz") for c in rec["tool_calls"]]
    # 30 warm-up steps already teach the protocol: samples search (their queries are mostly not yet
    # names in the corpus; that takes the full warm-up), and each gets what the search tool returns.
    assert calls and all(c["name"] == "search" and "query" in c["arguments"] for c in calls)
    (tools_yaml,) = (tmp_path / "cache").rglob("tools.yaml")
    search = load_tools(tools_yaml)["search"]
    assert all(c["result"] == search.call(**c["arguments"]) for c in calls)
    # and a query that names someone gets that person's passage back
    first = json.loads((tools_yaml.parent / "corpus.jsonl").read_text().splitlines()[0])
    passage = first.get("text") or first["contents"]
    assert passage in search.call(query=passage.split(":")[0])
    searching = [rec for rec in read_records(tmp_path / "run" / "rollouts.jsonl.gz") if rec["tool_calls"]]
    assert all(
        "<information>" in rec["response"] for rec in searching
    )  # the scorer read the whole trajectory
