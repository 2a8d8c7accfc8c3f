"""The agent loop's bookkeeping on scripted model turns: one token sequence, the loss mask 1 exactly on
model tokens, tool output wrapped and masked, corrections, the turn budget, every length cap.

The model turns come from a scripted engine (a test double of :class:`HFRollout` that returns given
text, cut at the stop tags and the token budget as the real sampler cuts it), so every expected token
is known; the tools, tokenizer and formats are the real ones. ``test_real_model_*`` runs the loop on a
real tiny Llama.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from tearless.rollout.agent import AgentLoop, AgentSettings
from tearless.rollout.hf import HFRollout, RolloutOutput, left_pad
from tearless.rollout.multiturn import cut_tokens
from tearless.rollout.seeds import prompt_keys
from tearless.tasks.multihop import TAGS
from tearless.tasks.tokenizer import build_char_tokenizer
from tearless.tools import Tool
from tests.tolerances import logprob_tol


class ScriptedEngine:
    """Returns ``script[row][k]`` as the k-th turn of a row (rows told apart by their prompt)."""

    def __init__(self, tok, script: dict[str, list[str]]) -> None:
        self.tok, self.script = tok, script
        self.eos = torch.tensor([tok.eos_token_id])
        self.pad_token_id = tok.pad_token_id
        self.turn: dict[str, int] = {}
        self.calls = 0

    def generate(self, prompts, *, n, max_new_tokens, stop_sequences, **_):
        self.calls += 1
        rows = []
        for ids in prompts:
            key = next(k for k in self.script if self.tok.decode(ids).startswith(f"<|user|>{k}"))
            k = self.turn.get(key, 0)
            self.turn[key] = k + 1
            new = self.tok.encode(self.script[key][k], add_special_tokens=False)
            for i in range(1, len(new) + 1):  # cut right after the first stop sequence, as the sampler does
                if any(new[max(0, i - len(s)) : i] == s for s in stop_sequences):
                    new = new[:i]
                    break
            rows.append(new[:max_new_tokens])
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        p_ids, p_mask = left_pad(prompts, self.pad_token_id)
        logps = -0.5 * mask.float()
        return RolloutOutput(p_ids, p_mask, ids, mask, logps, torch.zeros(len(rows), dtype=torch.bool))


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(extra_tokens=TAGS)


class Lookup(Tool):
    name = "search"
    description = "look up"
    parameters = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}  # noqa: RUF012
    facts = {"kat": "kat: born Lora, mother bim.", "bim": "bim: born Kovu, mother kat."}  # noqa: RUF012

    def call(self, query: str) -> str:
        if query == "crash":
            raise RuntimeError("index offline")
        if query == "long":
            return "abcdefghij" * 10
        if query == "hang":
            time.sleep(30)
        return self.facts.get(query, "no results")


def item(tok, question):
    messages = [{"role": "user", "content": question}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return {"input_ids": list(ids), "raw_prompt": messages}


def run(tok, script, n_items=None, limit=200, tools=None, **settings):
    engine = ScriptedEngine(tok, script)
    loop = AgentLoop(engine, tok, tools or {"search": Lookup()}, AgentSettings(**settings))
    items = [item(tok, q) for q in list(script)[:n_items]]
    return loop.generate(items, n=1, max_new_tokens=limit), engine


def pieces(tok, out, row):
    """The response as (text, loss-mask value) runs."""
    ids = out.response_ids[row][out.response_attention_mask[row].bool()].tolist()
    mask = out.response_mask[row][: len(ids)].tolist()
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            runs.append((tok.decode(ids[start:i]), mask[start]))
            start = i
    return runs


def test_two_hop_trajectory_is_one_sequence_with_tool_output_masked(tok):
    res, engine = run(
        tok,
        {
            "Where was kat's mother born?": [
                "<search>kat</search>ignored",
                "<search>bim</search>",
                "<answer>Kovu</answer>",
            ],
            "Where was bim born?": ["<answer>Kovu</answer><search>x</search>"],
        },
    )
    assert pieces(tok, res.out, 0) == [
        ("<search>kat</search>", 1),
        ("<information>kat: born Lora, mother bim.</information>", 0),
        ("<search>bim</search>", 1),
        ("<information>bim: born Kovu, mother kat.</information>", 0),
        ("<answer>Kovu</answer>", 1),
    ]
    assert pieces(tok, res.out, 1) == [("<answer>Kovu</answer>", 1)]
    assert engine.calls == 3  # the answered row is not generated again
    out = res.out
    full = "".join(text for text, _ in pieces(tok, out, 0))
    # Tags are single tokens: "<answer>Kovu</answer>" is 6 tokens.
    assert out.response_attention_mask.sum(-1).tolist() == [
        len(tok.encode(full, add_special_tokens=False)),
        6,
    ]
    assert out.response_mask.sum(-1).tolist() == [5 + 5 + 6, 6]
    # Sampler log-probs are kept on model tokens and are 0 on tool tokens (exactly: the fake engine's
    # −0.5, copied, and zeros).
    assert torch.equal(out.log_probs, -0.5 * out.response_mask.float())
    assert not out.truncated.any()
    assert res.rows[0]["tool_calls"] == [
        {
            "name": "search",
            "arguments": {"query": "kat"},
            "result": "kat: born Lora, mother bim.",
            "error": False,
        },
        {
            "name": "search",
            "arguments": {"query": "bim"},
            "result": "bim: born Kovu, mother kat.",
            "error": False,
        },
    ]
    m = res.metrics
    assert m["multi_turn/num_turns/mean"] == 2.0 and m["multi_turn/num_turns/max"] == 3.0
    assert m["multi_turn/tool_calls/mean"] == 1.0 and m["multi_turn/answered"] == 1.0
    assert m["multi_turn/tool_errors"] == 0.0 and m["multi_turn/invalid_actions"] == 0.0
    tool_tokens = 2 * (2 + len("kat: born Lora, mother bim."))
    assert m["multi_turn/tool_token_share"] == pytest.approx(
        tool_tokens / out.response_attention_mask.sum().item()
    )


def test_invalid_actions_get_the_corrective_message_masked_and_the_model_tries_again(tok):
    res, _ = run(
        tok,
        {
            "Where was kat born?": [
                "I think</search>",
                "<search></search>",
                "<search>kat</search>",
                "<answer>Lora</answer>",
            ]
        },
        invalid_action_message="Bad action.",
    )
    assert pieces(tok, res.out, 0) == [
        ("I think</search>", 1),
        ("\nBad action. (no <tool>...</tool> call and no <answer>...</answer>)\n", 0),
        ("<search></search>", 1),
        ("\nBad action. (empty <search></search>)\n", 0),
        ("<search>kat</search>", 1),
        ("<information>kat: born Lora, mother bim.</information>", 0),
        ("<answer>Lora</answer>", 1),
    ]
    assert res.metrics["multi_turn/invalid_actions"] == 2.0 and res.metrics["multi_turn/answered"] == 1.0


def test_a_tool_that_raises_or_hangs_gives_the_model_an_error_and_the_rollout_goes_on(tok):
    started = time.perf_counter()
    res, _ = run(
        tok,
        {
            "Where was kat born?": ["<search>crash</search>", "<answer>Lora</answer>"],
            "Where was bim born?": ["<search>hang</search>", "<answer>Kovu</answer>"],
        },
        tool_timeout_s=0.3,
    )
    assert time.perf_counter() - started < 10
    assert pieces(tok, res.out, 0)[1] == (
        "<information>error: search failed: RuntimeError: index offline</information>",
        0,
    )
    assert pieces(tok, res.out, 1)[1] == ("<information>error: search timed out after 0.3 s</information>", 0)
    assert res.metrics["multi_turn/tool_errors"] == 2.0 and res.metrics["multi_turn/answered"] == 1.0


def test_the_forced_final_turn_runs_no_tool_and_max_user_turns_is_a_budget(tok):
    script = {"Where was kat born?": ["<search>kat</search>", "<search>bim</search>", "<answer>x</answer>"]}
    res, _ = run(tok, script, max_assistant_turns=2)
    assert [t for t, _ in pieces(tok, res.out, 0)][-1] == "<search>bim</search>"  # not executed
    assert res.metrics["multi_turn/tool_calls/mean"] == 1.0 and res.metrics["multi_turn/answered"] == 0.0
    assert res.metrics["multi_turn/num_turns/mean"] == 2.0
    res, _ = run(tok, script, max_assistant_turns=4, max_user_turns=1)
    assert (
        res.metrics["multi_turn/tool_calls/mean"] == 1.0 and res.metrics["multi_turn/num_turns/mean"] == 2.0
    )
    res, _ = run(tok, script, max_assistant_turns=4, max_user_turns=0)
    assert (
        res.metrics["multi_turn/tool_calls/mean"] == 0.0 and res.metrics["multi_turn/num_turns/mean"] == 1.0
    )


@pytest.mark.parametrize(
    ("side", "kept"),
    [("right", "abcdefgh"), ("left", "cdefghij"), ("middle", "abcdghij")],
)
def test_a_long_tool_output_is_cut_to_max_tool_response_length_on_its_side(tok, side, kept):
    res, _ = run(
        tok,
        {"Where was kat born?": ["<search>long</search>", "<answer>x</answer>"]},
        max_tool_response_length=8,
        tool_response_truncate_side=side,
    )
    assert pieces(tok, res.out, 0)[1] == (f"<information>{kept}</information>", 0)
    assert res.metrics["multi_turn/tool_response_truncated"] == 1.0
    assert cut_tokens(list(range(10)), 3, "middle") == [0, 8, 9]


def test_a_response_that_exceeds_every_cap_stops_at_the_total_length(tok):
    script = {
        "Where was kat born?": ["<search>long</search>", "<answer>x</answer>"],  # tool output hits the cap
        "Where was bim born?": ["<search>kat</search>", "z" * 50],  # the model's own turn hits it
        "Where was dol born?": ["y" * 50],  # the first turn alone hits it
    }
    res, _ = run(tok, script, limit=40, max_tool_response_length=64, tool_response_truncate_side="right")
    out = res.out
    assert out.response_attention_mask.sum(-1).tolist() == [40, 40, 40]
    assert out.truncated.tolist() == [True, True, True]
    # 6 tokens of call, then <information> and 33 of the 64 kept tokens of output: no closing tag.
    assert pieces(tok, out, 0) == [
        ("<search>long</search>", 1),
        ("<information>" + ("abcdefghij" * 4)[:33], 0),
    ]
    # 5 + 29 tokens of call and result, 6 left for the model's turn.
    assert pieces(tok, out, 1)[-1] == ("z" * 6, 1)
    assert pieces(tok, out, 2) == [("y" * 40, 1)]
    assert res.metrics["multi_turn/answered"] == 0.0


def test_search_r1_calls_each_tool_by_its_tag(tok, tmp_path):
    class Calc(Lookup):
        name = "calc"
        parameters = {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}  # noqa: RUF012

        def call(self, expr: str) -> str:
            return str(eval(expr, {}))  # the test's own expressions

    res, _ = run(tok, {"What is 2+3?": ["<calc>2+3</calc>", "<answer>5</answer>"]}, tools={"calc": Calc()})
    assert pieces(tok, res.out, 0)[:2] == [("<calc>2+3</calc>", 1), ("<information>5</information>", 0)]

    class NoText(Lookup):
        name = "count"
        parameters = {"type": "object", "properties": {"n": {"type": "integer"}}}  # noqa: RUF012

    with pytest.raises(ValueError, match=r"no string argument.*multi_turn\.format=hermes"):
        AgentLoop(ScriptedEngine(tok, {}), tok, {"count": NoText()}, AgentSettings())


def test_hermes_calls_are_json_and_results_come_back_as_tool_messages(tok):
    call = json.dumps({"name": "search", "arguments": {"query": "kat"}})
    res, _ = run(
        tok,
        {
            "Where was kat born?": [f"<tool_call>{call}</tool_call><|end|>", "Lora<|end|>"],
            "Where was bim born?": [
                "<tool_call>{broken</tool_call><|end|>",
                '<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"bim\\"}"}</tool_call><|end|>',
                "Kovu<|end|>",
            ],
        },
        format="hermes",
        invalid_action_message="Bad call.",
        limit=400,
    )
    assert pieces(tok, res.out, 0) == [
        (f"<tool_call>{call}</tool_call><|end|>", 1),
        ("<|tool|>kat: born Lora, mother bim.<|end|><|assistant|>", 0),
        ("Lora<|end|>", 1),
    ]
    runs = pieces(tok, res.out, 1)
    assert runs[1] == (
        "<|tool|>Bad call. (tool call is not valid JSON (Expecting property name enclosed in double "
        "quotes))<|end|><|assistant|>",
        0,
    )
    assert runs[3] == ("<|tool|>bim: born Kovu, mother kat.<|end|><|assistant|>", 0)
    assert res.metrics["multi_turn/answered"] == 1.0 and res.metrics["multi_turn/invalid_actions"] == 1.0


def test_real_model_rollout_log_probs_match_the_trainers_forward_across_tool_output(tok, tmp_path):
    """On a real tiny Llama, the sampler's log-probs of model tokens equal those the actor recomputes
    from the whole sequence with the attention mask (tool output attended, positions contiguous)."""
    from tearless.models.logprobs import response_logprobs
    from tearless.tasks.bootstrap import tokenizer_llama

    model = tokenizer_llama(tok, hidden_size=32, num_layers=1, seed=0, max_position_embeddings=256)
    engine = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    loop = AgentLoop(engine, tok, {"search": Lookup()}, AgentSettings(max_assistant_turns=4))
    items = [item(tok, q) for q in ("Where was kat born?", "Where was bim's mother born?")]
    res = loop.generate(items, n=4, max_new_tokens=60, keys=prompt_keys(0, 0, 0, len(items)))
    out = res.out
    holes = (out.response_attention_mask - out.response_mask).sum()
    assert holes > 0  # corrections (a random model rarely writes a valid call) are in the sequences
    with torch.no_grad():
        lp, _ = response_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_attention_mask
        )
    m = out.response_mask.bool()
    # Incremental KV-cache decoding against one pass: the same maths, other summation orders. This
    # random-init model's logits stay below 1 (init std 0.02 over 32 hidden units; max 0.84 measured).
    atol = logprob_tol(model.config, logit_bound=1.0)
    torch.testing.assert_close(lp[m], out.log_probs[m], atol=atol, rtol=0)
    assert (out.log_probs[~m] == 0).all()


def test_the_sampler_stops_right_after_a_stop_sequence_and_keeps_it(tok):
    """HFRollout's ``stop_sequences``: a greedy tiny model's own output, cut after a sequence taken from
    the middle of it, is exactly the uncut output's prefix."""
    from tearless.tasks.bootstrap import tokenizer_llama

    model = tokenizer_llama(tok, hidden_size=32, num_layers=1, seed=3)
    engine = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    prompt = item(tok, "Where was kat born?")["input_ids"]
    full = engine.generate([prompt], max_new_tokens=12, do_sample=False)
    ids = full.response_ids[0][full.response_mask[0].bool()].tolist()
    assert len(ids) == 12
    stop = ids[5:7]
    cut = engine.generate([prompt], max_new_tokens=12, do_sample=False, stop_sequences=[[999], stop])
    first = next(i + 2 for i in range(11) if ids[i : i + 2] == stop)
    assert cut.response_ids[0][cut.response_mask[0].bool()].tolist() == ids[:first]
    assert not cut.truncated[0] and full.truncated[0]


HOSTILE_CALLS = [
    # json.loads raises ValueError (not JSONDecodeError) for an integer literal over 4,300 digits
    '<tool_call>{"name": "search", "arguments": {"query": ' + "1" * 5000 + "}}</tool_call>",
    # and RecursionError for deep nesting, in the call or in string-encoded arguments
    "<tool_call>" + "[" * 100_000 + "</tool_call>",
    '<tool_call>{"name": "search", "arguments": "' + "[" * 100_000 + '"}</tool_call>',
    '<tool_call>{"name": "search", "arguments": "' + "1" * 5000 + '"}</tool_call>',
    '<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"query": "\\ud800"}}</tool_call>',
]


@pytest.mark.parametrize("text", HOSTILE_CALLS, ids=range(len(HOSTILE_CALLS)))
def test_any_model_output_is_an_action_never_an_exception(tok, text):
    """Issue 33: a tool call the JSON parser chokes on (a 5,000-digit integer, 100,000 nested brackets)
    ended the training run; now any model output parses to an action, and what cannot be a call is
    an invalid one the model is told about."""
    loop = AgentLoop(ScriptedEngine(tok, {}), tok, {"search": Lookup()}, AgentSettings(format="hermes"))
    action = loop.parse(text)
    assert action.kind in ("invalid", "calls"), action
    if action.kind == "invalid":
        assert action.problem


def test_a_hostile_tool_call_costs_the_model_an_invalid_turn_and_the_rollout_goes_on(tok):
    huge = '<tool_call>{"name": "search", "arguments": {"query": ' + "1" * 5000 + "}}</tool_call><|end|>"
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call><|end|>"
    res, _ = run(
        tok,
        {"Where was kat born?": [huge, "Lora<|end|>"], "Where was bim born?": [deep, "Kovu<|end|>"]},
        format="hermes",
        invalid_action_message="Bad call.",
        limit=100_400,
    )
    assert res.metrics["multi_turn/invalid_actions"] == 2.0
    assert res.metrics["multi_turn/answered"] == 1.0
    assert pieces(tok, res.out, 0)[-1] == ("Lora<|end|>", 1)
    assert "Bad call. (tool call is not valid JSON" in pieces(tok, res.out, 1)[1][0]


# 8,000 opening tags and no closing one took 10.8 s per turn with a lazy regex (each opening tag
# scanned to the end of the text: n² work); a linear scan takes milliseconds. The bound is 1 s:
# hundreds of times the linear time, a tenth of the quadratic one.
UNTERMINATED = {
    "hermes": "<tool_call>" * 8000 + '<tool_call>{"name": "search", "arguments": {"query": "x"}}',
    "search_r1": "<search>" * 8000 + "<answer>",
}


@pytest.mark.parametrize("fmt", sorted(UNTERMINATED))
def test_unterminated_tags_parse_in_linear_time(tok, fmt):
    loop = AgentLoop(ScriptedEngine(tok, {}), tok, {"search": Lookup()}, AgentSettings(format=fmt))
    started = time.perf_counter()
    action = loop.parse(UNTERMINATED[fmt])
    assert time.perf_counter() - started < 1.0
    # Nothing is closed: hermes reads it as an answer (no call), search_r1 as an invalid turn.
    assert action.kind == ("answer" if fmt == "hermes" else "invalid")


def test_the_last_closed_tag_after_many_open_ones_is_still_found(tok):
    loop = AgentLoop(ScriptedEngine(tok, {}), tok, {"search": Lookup()}, AgentSettings())
    action = loop.parse("<search>" * 5000 + "<search>where</search>")
    # As the regex did: the first opening tag that has a closing one after it, up to that closing tag.
    assert action.kind == "calls" and action.calls[0].arguments == {"query": "<search>" * 5000 + "where"}


def test_max_tool_calls_per_turn_is_a_budget(tok):
    call = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    loop = AgentLoop(
        ScriptedEngine(tok, {}),
        tok,
        {"search": Lookup()},
        AgentSettings(format="hermes", max_tool_calls_per_turn=3),
    )
    assert [c.name for c in loop.parse(call * 3).calls] == ["search"] * 3
    action = loop.parse(call * 4000)
    assert action.kind == "invalid"
    assert action.problem == "more than 3 tool calls in one turn (multi_turn.max_tool_calls_per_turn=3)"
