"""The one turn loop (:class:`~tearless.rollout.multiturn.TurnLoop`): the facts it gives each turn, how it
applies the replies, and that the tool loop and the environment loop both run on it.
"""

from __future__ import annotations

import pytest

from tearless.envs import EnvLoop
from tearless.rollout.agent import AgentLoop, AgentSettings
from tearless.rollout.multiturn import Reply, TokenTrajectory, Turn, TurnLoop
from tearless.tasks.tokenizer import build_char_tokenizer
from tests.envs.scripted import ScriptedEngine


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


class Observer(TurnLoop):
    """Answers every turn with the two environment tokens "!!" until the turn is final, then ends the
    trajectory (truncated when the budget is spent); keeps the turns it was told."""

    def __init__(self, engine, settings, env_tokens):
        self.engine, self.settings, self.env_tokens = engine, settings, env_tokens
        self.seen: list[tuple[int, Turn]] = []

    def respond(self, active, turns):
        self.seen += [(r.prompt[0], t) for r, t in zip(active, turns, strict=True)]
        return [Reply(done=True, truncated=t.full) if t.final else Reply(self.env_tokens) for t in turns]


def test_the_turn_loop_tells_each_turn_its_budget_and_applies_the_replies(tok):
    def enc(text):
        return tok.encode(text, add_special_tokens=False)

    engine = ScriptedEngine(tok, {"A": [enc("abc"), enc("defgh")], "B": [enc("a"), enc("de"), enc("f")]})
    loop = Observer(engine, AgentSettings(max_assistant_turns=4, max_user_turns=2), enc("!!"))
    a, b = TokenTrajectory(prompt=enc("A")), TokenTrajectory(prompt=enc("B"))
    loop.run_turns([a, b], 9, {})
    # Budget 9. Turn 1: A 3 tokens, B 1, each + "!!": A 5, B 3. Turn 2: the call's room is the most
    # any has (9 - 3 = 6): A samples 5 but keeps 4 (its room), the budget is spent, so the turn is final
    # and A ends truncated; B keeps "de" (5) + "!!" (7). Turn 3: B has had its 2 environment turns
    # (max_user_turns), so "f" is final though the budget (8 of 9) and the turns (3 of 4) are not spent.
    names = {enc("A")[0]: "A", enc("B")[0]: "B"}
    told = [(names[p], t.number, t.ids, t.sampled, t.full, t.final) for p, t in loop.seen]
    assert told == [
        ("A", 1, enc("abc"), enc("abc"), False, False),
        ("B", 1, enc("a"), enc("a"), False, False),
        ("A", 2, enc("defg"), enc("defgh"), True, True),
        ("B", 2, enc("de"), enc("de"), False, False),
        ("B", 3, enc("f"), enc("f"), False, True),
    ]
    assert a.ids == enc("abc!!defg") and a.mask == [1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert b.ids == enc("a!!de!!f") and b.mask == [1, 0, 0, 1, 1, 0, 0, 1]
    assert (a.done, a.truncated, a.turns, a.user_turns) == (True, True, 2, 1)
    assert (b.done, b.truncated, b.turns, b.user_turns) == (True, False, 3, 2)


def test_the_tool_loop_and_the_environment_loop_share_the_one_turn_loop():
    for loop in (AgentLoop, EnvLoop):
        assert issubclass(loop, TurnLoop)
        assert loop.run_turns is TurnLoop.run_turns  # neither drives its turns itself
