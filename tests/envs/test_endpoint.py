"""The OpenAI-compatible endpoint with the real ``openai`` client: a multi-call agent's calls record
exactly the token ids (and log-probs) the engine generated, chained calls merge token-in-token-out,
and agents that crash, hang or make no call cost their episode only."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tearless.envs import Endpoint, ProgramLoop
from tearless.rollout.agent import AgentSettings
from tearless.rollout.hf import HFRollout
from tearless.tasks.bootstrap import tokenizer_llama
from tearless.tasks.tokenizer import build_char_tokenizer
from tests.envs.scripted import Recording, ScriptedEngine

openai = pytest.importorskip("openai", reason="the endpoint tests use the openai client (pip install openai)")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(extra_tokens=["<tool_call>", "</tool_call>"])


def client(url):
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30)


def two_call_agent(url, row):
    """Call 1 may call the tool; the agent runs it, sends the result back (call 2) and scores."""
    c = client(url)
    messages = [{"role": "user", "content": row["extra_info"]["question"]}]
    first = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    msg = first.choices[0].message
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls or []:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    if not msg.tool_calls:
        messages.append({"role": "user", "content": "use the tool"})
    second = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    return {"score": float(second.choices[0].message.content == "5"), "success": True}


def test_scripted_calls_chain_token_in_token_out(tok):
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tok.eos_token_id
    call_text = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
    turn1 = [
        tok.convert_tokens_to_ids("<tool_call>"),
        *ids(call_text),
        tok.convert_tokens_to_ids("</tool_call>"),
        eos,
    ]
    turn2 = [*ids("5"), eos]
    engine = ScriptedEngine(tok, {"2+3": [turn1, turn2]})
    loop = ProgramLoop(engine, tok, two_call_agent, AgentSettings())
    res = loop.generate([{"extra_info": {"question": "2+3"}, "input_ids": [1]}], n=1, max_new_tokens=200)
    assert engine.generated == [turn1, turn2]
    row = res.rows[0]
    assert row["env_error"] is None and row["calls"] == 2 and row["merged_calls"] == 2
    assert row["env_reward"] == 1.0
    out = res.out
    prompt = out.prompt_ids[0][out.prompt_mask[0].bool()].tolist()
    response = out.response_ids[0][out.response_attention_mask[0].bool()].tolist()
    mask = out.response_mask[0][: len(response)].tolist()
    first_prompt = tok.apply_chat_template(
        [{"role": "user", "content": "2+3"}],
        tools=TOOLS,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert prompt == list(first_prompt)
    between = ids("<|tool|>5<|end|><|assistant|>")
    assert response == turn1 + between + turn2
    assert mask == [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    assert [t for t, m in zip(response, mask, strict=True) if m] == engine.generated[0] + engine.generated[1]


def test_endpoint_records_exactly_what_the_engine_generated(tok):
    torch.manual_seed(0)
    model = tokenizer_llama(tok, hidden_size=32, num_layers=1, seed=0, max_position_embeddings=512).eval()
    engine = Recording(HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id))
    loop = ProgramLoop(engine, tok, two_call_agent, AgentSettings(max_parallel_calls=3))
    items = [{"extra_info": {"question": q}, "input_ids": [1]} for q in ("2+3", "1+1")]
    res = loop.generate(items, n=2, max_new_tokens=12, keys=[7, 8], temperature=1.0)
    assert all(r["env_error"] is None and r["calls"] == 2 for r in res.rows), [
        r["env_error"] for r in res.rows
    ]
    # Random weights rarely write a valid call: a second call chains on the first only when its turn
    # ended with EOS; either way every recorded completion is one the engine generated, unchanged.
    generated = {tuple(ids): lps for ids, lps in engine.generated}
    assert len(engine.generated) == 8
    sessions_calls = 0
    for r, row in enumerate(res.rows):
        response = res.out.response_ids[r][res.out.response_attention_mask[r].bool()].tolist()
        mask = res.out.response_mask[r][: len(response)].tolist()
        logps = res.out.log_probs[r][: len(response)].tolist()
        trained = [t for t, m in zip(response, mask, strict=True) if m]
        trained_lp = [lp for lp, m in zip(logps, mask, strict=True) if m]
        sessions_calls += row["calls"]
        # The trained tokens are whole recorded completions, one after another, with their log-probs.
        assert trained
        start = 0
        while start < len(trained):
            g = next(g for g in generated if tuple(trained[start : start + len(g)]) == g and g)
            assert trained_lp[start : start + len(g)] == generated[g]
            start += len(g)
    assert sessions_calls == 8


def test_failing_agents_cost_their_episode(tok):
    eos = tok.eos_token_id
    script = {
        q: [[*tok.encode("5", add_special_tokens=False), eos]] * 2 for q in ("ok", "boom", "hang", "none")
    }
    engine = ScriptedEngine(tok, script)

    def agent(url, row):
        q = row["extra_info"]["question"]
        if q == "none":
            return 1.0
        reply = client(url).chat.completions.create(model="p", messages=[{"role": "user", "content": q}])
        if q == "boom":
            raise RuntimeError("agent bug")
        if q == "hang":
            time.sleep(30)
        return float(reply.choices[0].message.content == "5")

    loop = ProgramLoop(engine, tok, agent, AgentSettings(), timeout_s=1.0)
    start = time.perf_counter()
    items = [{"extra_info": {"question": q}, "input_ids": [1]} for q in script]
    res = loop.generate(items, n=1, max_new_tokens=8)
    assert time.perf_counter() - start < 15
    scored = loop.score(tok, res.out, res.rows)
    assert scored["scores"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert [e["env_failed"] for e in scored["extras"]] == [0.0, 1.0, 1.0, 1.0]
    assert set(scored["errors"]) == {
        "episode failed: the agent raised RuntimeError: agent bug",
        "episode failed: the agent timed out after 1 s",
        "episode failed: the agent made no call to the endpoint",
    }
    assert res.out.response_mask[1:].sum() == 0
    # After its episode, a session refuses calls.
    with pytest.raises(openai.NotFoundError):
        client(loop.endpoint.session_url("s0")).chat.completions.create(
            model="p", messages=[{"role": "user", "content": "ok"}]
        )


def test_budget_stream_and_bad_requests(tok):
    engine = ScriptedEngine(tok, {"q": [[tok.eos_token_id]] * 3})
    endpoint = Endpoint(engine, tok)
    try:
        sid = endpoint.open_session(1, 4, {})
        assert endpoint.complete(sid, {"messages": []})[0] == 400
        assert (
            endpoint.complete(sid, {"messages": [{"role": "user", "content": "q"}], "stream": True})[0] == 400
        )
        status, body = endpoint.complete(
            sid, {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2}
        )
        assert (
            status == 200
            and body["choices"][0]["finish_reason"] == "stop"
            and body["usage"]["completion_tokens"] == 1
        )
        assert endpoint.complete("nope", {"messages": [{"role": "user", "content": "q"}]})[0] == 404
    finally:
        endpoint.shutdown()
