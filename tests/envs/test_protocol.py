"""The multi-turn protocol: the three loops implement it, the rank's two ways of scoring give the same
named :class:`Scores`, and the one token bookkeeping cuts environment turns at the response budget.
"""

from __future__ import annotations

import pytest
import torch

from tearless.envs import EnvLoop, ProgramLoop
from tearless.rewards import RewardManager
from tearless.rollout.agent import AgentLoop, AgentSettings
from tearless.rollout.multiturn import MultiTurnLoop, RewardingLoop, Scores, TokenTrajectory
from tearless.tasks.tokenizer import build_char_tokenizer
from tearless.workers.scoring import score_responses
from tests.envs.scripted import ScriptedEngine
from tests.envs.test_loop import Guess, ids, item
from tests.rollout.test_agent import Lookup


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(extra_tokens=["<search>", "</search>", "<answer>", "</answer>"])


def test_the_three_loops_implement_the_protocol_and_say_who_scores(tok):
    engine = ScriptedEngine(tok, {})
    settings = AgentSettings()
    tools = AgentLoop(engine, tok, {"search": Lookup()}, settings)
    envs = EnvLoop(engine, tok, Guess, settings)
    programs = ProgramLoop(engine, tok, lambda url, row: 1.0, settings)
    assert all(isinstance(loop, MultiTurnLoop) for loop in (tools, envs, programs))
    # The tool loop leaves scoring to the reward manager, so it has no score of its own.
    assert tools.owns_reward is False and not isinstance(tools, RewardingLoop)
    assert envs.owns_reward is True and isinstance(envs, RewardingLoop)
    assert programs.owns_reward is True and isinstance(programs, RewardingLoop)


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(len(solution_str)), "acc": solution_str == ground_truth}


def test_both_ways_of_scoring_give_the_named_scores(tok):
    engine = ScriptedEngine(tok, {"guess A": [ids(tok, "3"), ids(tok, "5")], "guess B": [ids(tok, "5")]})
    loop = EnvLoop(engine, tok, Guess, AgentSettings())
    res = loop.generate([item("A"), item("B")], n=1, max_new_tokens=64)
    by_env = loop.score(tok, res.out, res.rows)
    items = [{**item(name), "ground_truth": "5"} for name in "AB"]
    by_manager = score_responses(tok, RewardManager(length_score, num_workers=0), items, res.out)
    for scored in (by_env, by_manager):
        assert set(scored) == set(Scores.__annotations__)
        assert scored["scores"].dtype == torch.float32 and scored["correct"].dtype == torch.bool
    # The decoded trajectories, observation included: "3", "higher" between the chat tags, "5".
    assert by_manager["texts"] == by_env["texts"]
    assert by_env["scores"].tolist() == [0.75, 1.0]
    assert by_manager["scores"].tolist() == [float(len(t)) for t in by_env["texts"]]
    assert by_manager["correct"].tolist() == [False, True]


def test_one_token_bookkeeping_cuts_environment_turns_at_the_budget():
    t = TokenTrajectory(prompt=[7, 7])
    # A model turn of 3 tokens under a budget of 6, then 2 environment tokens: room for the model remains.
    assert t.append_model([1, 2, 3], [-0.1, -0.2, -0.3], limit=6) == [1, 2, 3]
    t.append_env([8, 9], limit=6)
    assert (t.ids, t.mask, t.logps) == ([1, 2, 3, 8, 9], [1, 1, 1, 0, 0], [-0.1, -0.2, -0.3, 0.0, 0.0])
    assert (t.turns, t.user_turns, t.done, t.truncated) == (1, 1, False, False)
    # 3 more environment tokens fill the last slot: cut to 1, no room left to answer, so it ends truncated.
    t.append_env([4, 5, 6], limit=6)
    assert t.ids == [1, 2, 3, 8, 9, 4] and t.mask == [1, 1, 1, 0, 0, 0]
    assert (t.user_turns, t.done, t.truncated) == (2, True, True)
    # A model turn is cut to the room left too (here none).
    assert t.append_model([5], [-0.5], limit=6) == [] and t.turns == 2
