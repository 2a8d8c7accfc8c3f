"""The environment loop on scripted model turns: one token sequence per episode, environment tokens
masked, the environment's rewards summed onto the last model token, GRPO advantages from them;
token-in-token-out on a purpose-built tokenization; failures and hangs of an environment contained.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from tearless.algos import compute_advantage
from tearless.envs import EnvLoop, Step, env_factory, register_env
from tearless.rewards.steps import token_level_rewards
from tearless.rollout.agent import AgentSettings
from tearless.tasks.tokenizer import build_char_tokenizer
from tearless.trainers.reward_errors import RewardErrors
from tests.envs.scripted import ScriptedEngine


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(extra_tokens=["ab"])


class Guess:
    """Guess a digit in two tries: a wrong try costs 0.25 and is told higher/lower; a right one
    earns 1 and ends the episode; the second try ends it either way."""

    def reset(self, row):
        self.target, self.tries = row["ground_truth"], 0
        return [{"role": "user", "content": f"guess {row['extra_info']['name']}"}]

    def step(self, turn):
        self.tries += 1
        if turn["content"] == self.target:
            return Step(reward=1.0, done=True, info={"success": True})
        hint = "higher" if turn["content"] < self.target else "lower"
        return Step(hint, reward=-0.25, done=self.tries == 2, info={"success": False})


def item(name, target="5"):
    return {
        "raw_prompt": [{"role": "user", "content": f"guess {name}"}],
        "data_source": "guess",
        "ground_truth": target,
        "extra_info": {"name": name},
        "input_ids": [1, 2],
    }


def ids(tok, text, eos=True):
    return tok.encode(text, add_special_tokens=False) + ([tok.eos_token_id] if eos else [])


def test_two_turn_environment_masks_rewards_and_advantages(tok):
    engine = ScriptedEngine(tok, {"guess A": [ids(tok, "3"), ids(tok, "5")], "guess B": [ids(tok, "5")]})
    loop = EnvLoop(engine, tok, Guess, AgentSettings())
    res = loop.generate([item("A"), item("B")], n=1, max_new_tokens=64)
    out = res.out
    observation = tok.encode("<|user|>higher<|end|><|assistant|>", add_special_tokens=False)
    expected_a = ids(tok, "3") + observation + ids(tok, "5")
    assert out.response_ids[0][: len(expected_a)].tolist() == expected_a
    assert out.response_mask[0].tolist() == [1, 1] + [0] * len(observation) + [1, 1]
    assert out.response_attention_mask[0].tolist() == [1] * len(expected_a)
    # B answered at once: two tokens, then padding.
    assert out.response_mask[1].tolist() == [1, 1] + [0] * (len(expected_a) - 2)
    assert out.log_probs[0].tolist() == [-0.5, -0.5] + [0.0] * len(observation) + [-0.5, -0.5]
    # The prompt is the environment's first observation through the chat template.
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "guess A"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.prompt_ids[0][out.prompt_mask[0].bool()].tolist() == list(prompt)

    scored = loop.score(tok, out, res.rows)
    assert scored["scores"].tolist() == [0.75, 1.0]  # -0.25 + 1 ; 1
    assert scored["correct"].tolist() == [True, True]
    assert [r["env_rewards"] for r in res.rows] == [[-0.25, 1.0], [1.0]]
    assert [r["num_turns"] for r in res.rows] == [2, 1]

    rewards, _ = token_level_rewards(
        scored["scores"].tolist(),
        [None, None],
        scored["texts"],
        out.response_ids,
        out.response_attention_mask,
        out.response_mask,
        tok.decode,
    )
    last_a = len(expected_a) - 1
    assert rewards[0].nonzero().flatten().tolist() == [last_a] and rewards[0, last_a] == 0.75
    assert rewards[1].nonzero().flatten().tolist() == [1] and rewards[1, 1] == 1.0
    # One GRPO group of the two: mean 0.875, unbiased std 0.125·√2, so ∓1/√2 on the model's tokens.
    adv, _ = compute_advantage(
        "grpo", token_level_rewards=rewards, response_mask=out.response_mask, index=["g", "g"]
    )
    tol = 4 * torch.finfo(torch.float32).eps
    assert torch.allclose(adv[0][out.response_mask[0].bool()], torch.full((4,), -(0.5**0.5)), atol=tol)
    assert torch.allclose(adv[1][out.response_mask[1].bool()], torch.full((2,), 0.5**0.5), atol=tol)
    assert adv[0][~out.response_mask[0].bool()].abs().max() == 0.0


def test_tokens_trained_are_the_tokens_sampled_not_a_re_rendering(tok):
    # The model samples "a" and "b" as two tokens; the tokenizer encodes the text "ab" as the single
    # added token "ab", so rendering the finished conversation again gives other ids.
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    turn1, turn2 = [a, b, tok.eos_token_id], [b, a, b, tok.eos_token_id]
    engine = ScriptedEngine(tok, {"guess A": [turn1, turn2]})

    class Echo(Guess):
        def step(self, turn):
            self.tries += 1
            return Step(f"again {turn['content']}", reward=0.0, done=self.tries == 2)

    res = EnvLoop(engine, tok, Echo, AgentSettings()).generate([item("A")], n=1, max_new_tokens=64)
    out = res.out
    row = out.response_ids[0][out.response_attention_mask[0].bool()].tolist()
    trained = out.response_ids[0][out.response_mask[0].bool()].tolist()
    assert trained == turn1 + turn2  # exactly the sampled ids
    prompt = out.prompt_ids[0][out.prompt_mask[0].bool()].tolist()
    messages = res.rows[0]["messages"]
    assert [m["content"] for m in messages] == ["guess A", "ab", "again ab", "bab"]
    rerendered = tok.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert list(rerendered) != prompt + row  # a re-rendering would have trained other tokens…
    assert tok.decode(rerendered) == tok.decode(prompt + row)  # …for the same text
    ab = tok.convert_tokens_to_ids("ab")  # the observation "again ab" is text: encoded, it has one
    assert ab not in trained and list(rerendered).count(ab) == row.count(ab) + 2


class Flaky(Guess):
    """Raises in step for name C, in reset for D, hangs in step for E (async) and F (sync)."""

    def reset(self, row):
        if row["extra_info"]["name"] == "D":
            raise RuntimeError("no such level")
        self.name = row["extra_info"]["name"]
        return super().reset(row)

    def step(self, turn):
        if self.name == "C":
            raise ValueError("board corrupted")
        if self.name == "F":
            time.sleep(30)
        return super().step(turn)


class AsyncHang(Guess):
    async def step(self, turn):
        await asyncio.sleep(30)


def test_environment_exceptions_and_hangs_cost_their_episode_only(tok):
    script = {f"guess {k}": [ids(tok, "5")] for k in "ABCDF"}
    engine = ScriptedEngine(tok, script)
    loop = EnvLoop(engine, tok, Flaky, AgentSettings(), env_timeout_s=0.5)
    start = time.perf_counter()
    res = loop.generate([item(k) for k in "ABCDF"], n=1, max_new_tokens=64)
    assert time.perf_counter() - start < 10  # the hang cost its timeout, not 30 s
    scored = loop.score(tok, res.out, res.rows)
    assert scored["scores"].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [e["env_failed"] for e in scored["extras"]] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert [e["env_timeout"] for e in scored["extras"]] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert scored["failures"] == 3
    assert set(scored["errors"]) == {
        "episode failed: env.step raised ValueError: board corrupted",
        "episode failed: env.reset raised RuntimeError: no such level",
        "episode failed: env.step timed out after 0.5 s",
    }
    # The run's error line says what a failed episode gets: reward 0 and no gradient, not failure_score.
    lines: list[str] = []
    RewardErrors(True, lines.append).report(scored["errors"], 5)
    assert len(lines) == 3 and all("each gets reward 0 and is not trained on" in line for line in lines)
    assert not any("failure_score" in line for line in lines)
    assert res.out.response_mask[2:].sum() == 0  # nothing of a failed episode is trained on
    assert res.out.response_mask[:2].sum() == 4
    # The failed reset has no observation: its row falls back to the data row's prompt ids.
    assert res.out.prompt_ids[3][res.out.prompt_mask[3].bool()].tolist() == [1, 2]

    engine = ScriptedEngine(tok, {"guess A": [ids(tok, "5")]})
    res = EnvLoop(engine, tok, AsyncHang, AgentSettings(), env_timeout_s=0.2).generate([item("A")], n=1)
    assert res.rows[0]["env_timeout"] and res.out.response_mask.sum() == 0


def test_budgets_end_episodes_with_their_rewards(tok):
    # Turn budget 1: the wrong first guess ends the episode with its -0.25, no observation appended.
    engine = ScriptedEngine(tok, {"guess A": [ids(tok, "3")]})
    res = EnvLoop(engine, tok, Guess, AgentSettings(max_assistant_turns=1)).generate([item("A")], n=1)
    assert res.rows[0]["env_rewards"] == [-0.25] and res.out.response_mask[0].tolist() == [1, 1]
    # Token budget 5: the observation (10 tokens) is cut at the budget and the episode ends truncated.
    engine = ScriptedEngine(tok, {"guess A": [ids(tok, "3")]})
    res = EnvLoop(engine, tok, Guess, AgentSettings()).generate([item("A")], n=1, max_new_tokens=5)
    assert res.out.response_mask[0].tolist() == [1, 1, 0, 0, 0] and bool(res.out.truncated[0])


def test_environments_by_name_and_by_file(tok, tmp_path):
    @register_env("test_guess")
    class Registered(Guess):
        pass

    assert isinstance(env_factory("test_guess")(), Registered)
    path = tmp_path / "my_env.py"
    path.write_text("class Counter:\n    def __init__(self, start=0):\n        self.n = start\n")
    assert env_factory(f"{path}:Counter", {"start": 3})().n == 3
    with pytest.raises(ValueError, match=r"multi_turn.env='nope': unknown name"):
        env_factory("nope")
    with pytest.raises(ValueError, match=r"Missing is not defined"):
        env_factory(f"{path}:Missing")
