"""Process reward models: step positions, the two readings against a hand forward, the manager, and
the chain_addition task's tiny PRM."""

from __future__ import annotations

import pytest
import torch

from tearless.rewards.prm import ProcessRewardScorer, encode_steps, prompt_token_ids
from tearless.tasks.tokenizer import build_char_tokenizer

PROMPT = [{"role": "user", "content": "1+2+3="}]
RESPONSE = "1+2=3\n3+3=6"


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny(tok, kind: str, path):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=tok.pad_token_id,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = (LlamaForTokenClassification if kind == "token_classification" else LlamaForCausalLM)(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval()


def test_encode_steps_finds_each_steps_last_token(tok):
    ids, positions, ends = encode_steps(tok, PROMPT, RESPONSE)
    head = prompt_token_ids(tok, PROMPT)
    # <|user|> 1 + 2 + 3 = <|end|> <|assistant|>: 9 prompt tokens; the steps end on "3" (response
    # character 4) and "6" (character 10).
    assert len(head) == 9 and ends == [5, 11]
    assert positions == [9 + 4, 9 + 10]
    assert tok.decode(ids[positions[0]]) == "3" and tok.decode(ids[positions[1]]) == "6"
    # With a step tag after each step ("1+2=3|\n3+3=6|"), the reading is at each tag.
    ids, positions, ends = encode_steps(tok, PROMPT, RESPONSE, step_tag="|")
    assert ends == [5, 11] and positions == [9 + 5, 9 + 12]
    assert [tok.decode(ids[p]) for p in positions] == ["|", "|"]


@pytest.mark.parametrize("kind", ["token_classification", "causal_lm"])
def test_step_scores_equal_a_hand_forward(tok, tmp_path, kind):
    model = tiny(tok, kind, tmp_path)
    scorer = ProcessRewardScorer(str(tmp_path), kind=kind, step_tag="|", micro_batch_size=1)
    responses = [RESPONSE, "1+2=4"]
    got = scorer.score([PROMPT, PROMPT], responses)
    for response, (scores, ends) in zip(responses, got, strict=True):
        ids, positions, want_ends = encode_steps(
            tok, PROMPT, response, step_tag="|" if kind == "causal_lm" else None
        )
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, positions]
        if kind == "causal_lm":  # P(+) against P(−) after each tag
            plus, minus = tok.convert_tokens_to_ids("+"), tok.convert_tokens_to_ids("-")
            want = torch.softmax(logits[:, [plus, minus]], -1)[:, 0]
        else:  # P(label 1)
            want = torch.softmax(logits, -1)[:, 1]
        assert ends == tuple(want_ends)
        # One row here, padded rows in a batch of two below: the same numbers to float32 rounding of
        # a 1-layer, 32-wide network's logits (differences ~1e-7, probabilities move by less).
        torch.testing.assert_close(torch.tensor(scores), want, rtol=0, atol=1e-5)
    batched = ProcessRewardScorer(str(tmp_path), kind=kind, step_tag="|").score([PROMPT, PROMPT], responses)
    for a, b in zip(got, batched, strict=True):
        torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]), rtol=0, atol=1e-5)


def test_implicit_prm_sums_token_log_ratios_over_each_step(tok, tmp_path):
    # Two different random causal LMs: the PRM π and its reference. The response "1+2=3\n3+3=6" has
    # steps ending at response tokens 4 and 10 (prompt: 9 tokens), so step 1 sums the token rewards of
    # positions 9…13 and step 2 those of 14…19: β Σ (log π(x_p | x_<p) − log π_ref(x_p | x_<p)).
    policy = tiny(tok, "causal_lm", tmp_path / "prm")
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    ref = LlamaForCausalLM(policy.config).eval()
    ref.save_pretrained(tmp_path / "ref")
    scorer = ProcessRewardScorer(
        str(tmp_path / "prm"), kind="implicit", ref_path=str(tmp_path / "ref"), beta=0.5
    )
    ((scores, ends),) = scorer.score([PROMPT], [RESPONSE])
    ids, _, _ = encode_steps(tok, PROMPT, RESPONSE)
    x = torch.tensor([ids])
    with torch.no_grad():
        lp = policy(input_ids=x).logits[0, :-1].log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
        lr = ref(input_ids=x).logits[0, :-1].log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
    token = 0.5 * (lp - lr)  # token[p − 1] is the reward of position p
    want = [token[8:13].sum().item(), token[13:19].sum().item()]
    assert ends == (5, 11)
    torch.testing.assert_close(torch.tensor(scores), torch.tensor(want), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="the implicit PRM needs its reference model"):
        ProcessRewardScorer(str(tmp_path / "prm"), kind="implicit")


def test_a_long_pair_keeps_its_end_and_drops_the_steps_cut_off(tok, tmp_path):
    tiny(tok, "token_classification", tmp_path)
    scorer = ProcessRewardScorer(str(tmp_path), max_length=6)
    ids, positions, ends, first = scorer.encode(PROMPT, RESPONSE)
    # 9 prompt + 11 response tokens → the last 6 (response characters 5…10): the first step's "3"
    # (position 13) is cut, the second step's "6" (position 19) is at 19 − 14 = 5.
    assert len(ids) == 6 and positions == [5] and ends == [11] and first == 0


def test_errors(tok, tmp_path):
    tiny(tok, "causal_lm", tmp_path)
    with pytest.raises(
        ValueError, match=r"prm\.kind='reward' is not one of token_classification, causal_lm, implicit"
    ):
        ProcessRewardScorer(str(tmp_path), kind="reward")
    with pytest.raises(
        ValueError, match=r"prm\.good_token='yes' is 3 tokens for this tokenizer; it must be one"
    ):
        ProcessRewardScorer(str(tmp_path), kind="causal_lm", good_token="yes")


def test_the_reward_manager_puts_prm_steps_on_the_rule_outcome(tok, tmp_path):
    from tearless.config import load_config
    from tearless.rewards import make_reward_manager

    tiny(tok, "token_classification", tmp_path)
    cfg = load_config(
        None,
        [
            "reward_model.reward_manager=naive",
            "reward_model.step_reward.prm.enable=true",
            f"reward_model.step_reward.prm.path={tmp_path}",
        ],
    )
    items = [
        {"data_source": "chain_addition", "solution_str": s, "ground_truth": "6", "prompt": PROMPT,
         "extra_info": {"operands": [1, 2, 3]}}
        for s in (RESPONSE, "1+2=4\n4+3=7")
    ]  # fmt: skip
    with make_reward_manager(cfg.reward_model, max_response_length=16) as manager:
        results = manager.score(items)
    direct = ProcessRewardScorer(str(tmp_path)).score([PROMPT] * 2, [it["solution_str"] for it in items])
    assert [r.score for r in results] == [1.0, 0.0]  # the rule's outcome
    assert [r.steps for r in results] == direct  # the PRM's steps, not the rule's 1/0 judgements
    assert results[1].extra["step_validity"] == 0.5
    assert results[0].extra["prm_step_mean"] == pytest.approx(sum(direct[0][0]) / 2)
    with pytest.raises(
        ValueError, match=r"reward_model\.step_reward\.prm\.path: prm\.enable=true needs a process"
    ):
        make_reward_manager(
            load_config(None, ["reward_model.step_reward.prm.enable=true"]).reward_model,
            max_response_length=16,
        )
