"""OpenEnv environments through ``multi_turn.env=openenv``: a real ``openenv.core.Environment``
subclass in process, and the same environment served by OpenEnv's own server on 127.0.0.1 and
reached through its WebSocket client; scripted model turns, real tokenizer and loop."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tearless.envs import EnvLoop, env_factory
from tearless.envs.base import load_object
from tearless.rollout.agent import AgentSettings
from tearless.tasks.tokenizer import build_char_tokenizer
from tests.envs.scripted import ScriptedEngine

core = pytest.importorskip(
    "openenv.core", reason="the adapter's tests need openenv-core (docs/environments.md)"
)
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    hint: str


class GuessEnv(core.Environment[GuessAction, GuessObservation, State]):
    """Guess the seed's digit in two tries: a wrong try costs 0.25 and is told higher/lower; a right
    one earns 1 and ends the episode; the second try ends it either way."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target, self.tries = seed, 0
        return GuessObservation(hint=f"digit{kwargs.get('suffix', '')}?")

    def step(self, action, timeout_s=None, **kwargs):
        self.tries += 1
        if action.guess == self.target:
            return GuessObservation(hint="yes", reward=1.0, done=True, metadata={"success": True})
        hint = "higher" if action.guess < self.target else "lower"
        return GuessObservation(hint=hint, reward=-0.25, done=self.tries == 2, metadata={"success": False})

    @property
    def state(self):
        return State(step_count=self.tries)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def item(name, seed):
    return {
        "raw_prompt": [{"role": "user", "content": f"game {name}"}],
        "data_source": "openenv/guess",
        "ground_truth": "",
        "extra_info": {"seed": seed, "openenv_reset": {"suffix": "!"}},
        "input_ids": [1, 2],
    }


def ids(tok, text):
    return [*tok.encode(text, add_special_tokens=False), tok.eos_token_id]


def play(tok, factory):
    # A: "3" (lower than 5: -0.25, "higher"), then "5" (+1). B: "x" (not an int: the validation error
    # is the observation, reward 0), then "7" (+1).
    engine = ScriptedEngine(
        tok, {"game A": [ids(tok, "3"), ids(tok, "5")], "game B": [ids(tok, "x"), ids(tok, "7")]}
    )
    loop = EnvLoop(engine, tok, factory, AgentSettings())
    res = loop.generate([item("A", 5), item("B", 7)], n=1, max_new_tokens=400)
    return loop, res


def test_in_process_environment_actions_observations_rewards(tok):
    factory = env_factory("openenv", {"env": GuessEnv})
    loop, res = play(tok, factory)
    out = res.out
    # The prompt: the row's user message with the reset observation's only field appended.
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "game A\n\ndigit!?"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    assert out.prompt_ids[0][out.prompt_mask[0].bool()].tolist() == list(prompt)
    observation = tok.encode("<|user|>higher<|end|><|assistant|>", add_special_tokens=False)
    expected_a = ids(tok, "3") + observation + ids(tok, "5")
    assert out.response_ids[0][: len(expected_a)].tolist() == expected_a
    assert out.response_mask[0][: len(expected_a)].tolist() == [1, 1] + [0] * len(observation) + [1, 1]
    scored = loop.score(tok, out, res.rows)
    assert scored["scores"].tolist() == [0.75, 1.0]  # -0.25 + 1 ; 0 + 1
    assert scored["correct"].tolist() == [True, True]  # metadata["success"] of the last step
    assert [r["env_rewards"] for r in res.rows] == [[-0.25, 1.0], [0.0, 1.0]]
    text_b = tok.decode(out.response_ids[1][out.response_attention_mask[1].bool()].tolist())
    assert "invalid GuessAction" in text_b and "guess" in text_b


def test_action_and_observation_mapping():
    env = load_object("tearless.envs.openenv:OpenEnvEnvironment", "test")(env=GuessEnv)
    assert env.action_cls is GuessAction  # from Environment[GuessAction, ...]
    assert env.action("4").guess == 4
    with pytest.raises(ValueError, match="invalid GuessAction"):
        env.action("four")
    assert env.text(GuessObservation(hint="h", reward=1.0)) == "h"

    class Two(Action):
        x: int
        y: int

    env2 = load_object("tearless.envs.openenv:OpenEnvEnvironment", "test")(env=GuessEnv, action=Two)
    assert env2.action('{"x": 1, "y": 2}').model_dump(exclude={"metadata"}) == {"x": 1, "y": 2}
    with pytest.raises(ValueError, match="JSON object"):
        env2.action("1 2")
    assert env2.text({"a": 1, "b": [2], "done": False}) == '{"a": 1, "b": [2]}'
    with pytest.raises(ValueError, match="exactly one of env"):
        load_object("tearless.envs.openenv:OpenEnvEnvironment", "test")()


@pytest.fixture(scope="module")
def server():
    uvicorn = pytest.importorskip("uvicorn")
    app = core.create_app(GuessEnv, GuessAction, GuessObservation, max_concurrent_envs=4)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the OpenEnv server did not start in 30 s"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_served_environment_through_the_websocket_client(tok, server):
    # The generic client with the action type given: "x" is refused before it is sent.
    factory = env_factory("openenv", {"base_url": server, "action": GuessAction})
    loop, res = play(tok, factory)
    scored = loop.score(tok, res.out, res.rows)
    assert [r["env_rewards"] for r in res.rows] == [[-0.25, 1.0], [0.0, 1.0]]
    assert scored["scores"].tolist() == [0.75, 1.0]
    # OpenEnv's wire format drops metadata: success is the return's R >= 1, so A (0.75) is not solved.
    assert scored["correct"].tolist() == [False, True]
    text_a = tok.decode(res.out.response_ids[0][res.out.response_attention_mask[0].bool()].tolist())
    assert "higher" in text_a
    assert [r["env_error"] for r in res.rows] == [None, None]


def test_served_environment_refusing_an_action_costs_only_that_episode(tok, server):
    # Untyped (dicts): "x" reaches the server, whose validation error ends episode B as a failure.
    factory = env_factory("openenv", {"base_url": server, "action_field": "guess"})
    loop, res = play(tok, factory)
    assert [r["env_rewards"] for r in res.rows] == [[-0.25, 1.0], []]
    assert res.rows[0]["env_error"] is None
    assert res.rows[1]["env_error"].startswith("env.step raised")
    assert loop.score(tok, res.out, res.rows)["scores"].tolist() == [0.75, 0.0]


def test_the_example_environment_plays_through_the_adapter(tok):
    factory = env_factory("openenv", {"env": "examples/envs/openenv_guess.py:GuessEnv"})
    env = factory()
    assert env.action_cls.__name__ == "GuessAction"
    engine = ScriptedEngine(tok, {"game A": [ids(tok, "4"), ids(tok, "5")], "game B": [ids(tok, "7")]})
    loop = EnvLoop(engine, tok, factory, AgentSettings())
    res = loop.generate([item("A", 5), item("B", 7)], n=1, max_new_tokens=400)
    assert [r["env_rewards"] for r in res.rows] == [[-0.25, 1.0], [1.0]]
    assert loop.score(tok, res.out, res.rows)["correct"].tolist() == [True, True]
