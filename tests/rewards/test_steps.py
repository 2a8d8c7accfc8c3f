"""Step-level rewards: splitting, character offsets to tokens (char-level and byte-level BPE
tokenizers), the token_level_rewards they build, and what the reward pool accepts as steps."""

from __future__ import annotations

import pytest
import torch

from tearless.rewards.pool import check_value
from tearless.rewards.steps import char_ends_to_tokens, response_step_tokens, split_steps, token_level_rewards


@pytest.fixture(scope="module")
def tokenizer():
    from tearless.tasks.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.mark.parametrize(
    ("text", "separator", "regex", "ends"),
    [
        ("a+b=3\nc=4\n", "\n", False, [5, 9]),  # a trailing separator makes no empty step
        ("x=1\n\n  \n\ny=2", "\n\n", False, [3, 12]),  # a whitespace-only piece is not a step
        ("one  \ntwo", "\n", False, [3, 9]),  # a step ends at its last non-blank character
        ("Step 1: a=1. Step 2: b=2.", r"Step \d+:", True, [12, 25]),  # headers: the text before is empty
        ("no separator at all", "\n", False, [19]),
        ("", "\n", False, []),
    ],
)
def test_split_steps(text, separator, regex, ends):
    assert split_steps(text, separator, regex=regex) == ends


def test_split_steps_rejects_an_empty_separator():
    with pytest.raises(ValueError, match="the step separator is empty"):
        split_steps("a", "")


def test_char_tokenizer_maps_each_end_to_its_own_character(tokenizer):
    text = "12+7=19\n19+5=24"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = tokenizer.decode
    assert len(ids) == len(text)
    assert char_ends_to_tokens([7, 15], ids, decode, text) == [6, 14]  # the "9" and the "4"
    with pytest.raises(ValueError, match="step end 16 is outside the response's 15 characters"):
        char_ends_to_tokens([16], ids, decode, text)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer trained here on a few lines, so tokens span several characters and
    a multi-byte character ("→", 3 bytes, unseen in training) takes several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = ["first we add the tens", "then we add the units", "so the answer is", "12 + 7 = 19"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")


def test_bpe_tokens_spanning_characters_and_bytes(bpe):
    text = "first we add the tens→then we add the units\nso the answer is 19"
    ids = bpe.encode(text, add_special_tokens=False)
    assert bpe.decode(ids) == text and len(ids) < len(text)  # merges happened
    ends = [len("first we add the tens→"), len("first we add the tens→then we add the units"), len(text)]
    tokens = char_ends_to_tokens(ends, ids, bpe.decode, text)
    for end, k in zip(ends, tokens, strict=True):
        # The found token is the first whose prefix holds the whole step (a prefix that stops inside
        # "→" decodes to a replacement character, so it does not count).
        assert bpe.decode(ids[: k + 1]).startswith(text[:end])
        assert not bpe.decode(ids[:k]).startswith(text[:end])
    assert len(bpe.encode("→", add_special_tokens=False)) == 3  # one token per byte
    assert tokens[-1] == len(ids) - 1


def test_token_level_rewards_hand_worked(tokenizer):
    # Row 0: "1+1=2\n2+2=5" (11 characters, one token each, then <|end|>): steps end at characters 5
    # and 11 → tokens 4 and 10; the outcome goes on the last valid token, 11 (<|end|>).
    # Row 1: no step scores: the outcome alone, exactly the outcome-only reward.
    # Row 2: step ends given by the scorer: [3] → token 2.
    texts = ["1+1=2\n2+2=5", "7", "abc"]
    rows = [[*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((3, width), tokenizer.pad_token_id)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    steps = [((1.0, 0.0), None), None, ((0.5,), (3,))]
    kw = dict(decode=lambda x: tokenizer.decode(x, skip_special_tokens=True), separator="\n")
    rewards, step_mask = token_level_rewards(
        [0.0, 1.0, 1.0], steps, texts, ids, mask, mask, outcome_weight=2.0, step_weight=0.5, **kw
    )
    want = torch.zeros(3, width)
    want[0, 4], want[0, 11] = 0.5 * 1.0, 2.0 * 0.0
    want[1, 1] = 2.0
    want[2, 2], want[2, 3] = 0.5 * 0.5, 2.0
    assert torch.equal(rewards, want)
    assert step_mask.nonzero().tolist() == [[0, 4], [0, 10], [0, 11], [1, 1], [2, 2], [2, 3]]
    # Outcome weight 0: only the steps, and the last token is no longer a step of its own.
    rewards, step_mask = token_level_rewards(
        [0.0, 1.0, 1.0], steps, texts, ids, mask, mask, outcome_weight=0.0, **kw
    )
    assert step_mask.nonzero().tolist() == [[0, 4], [0, 10], [2, 2]]
    assert rewards[0, 4] == 1.0 and rewards.sum() == 1.5
    with pytest.raises(
        ValueError, match="sample 0: the scorer gave 3 step scores but the separator '\\\\n' cuts"
    ):
        token_level_rewards([0.0] * 3, [((1.0, 0.0, 1.0), None), None, None], texts, ids, mask, mask, **kw)


def test_outcome_only_matches_the_last_token_reward(tokenizer):
    # Without step scores and with the default weights the result is the trainer's old construction:
    # the score on each row's last valid token (holes in the mask, as in multi-turn, included).
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    ids = torch.zeros_like(mask)
    rewards, step_mask = token_level_rewards([0.5, -1.0, 3.0], [None] * 3, [""] * 3, ids, mask, mask, str)
    assert rewards.tolist() == [[0, 0, 0, 0.5, 0], [-1.0, 0, 0, 0, 0], [0] * 5]
    assert step_mask.nonzero().tolist() == [[0, 3], [1, 0]]


def test_a_step_ending_in_tool_output_is_credited_to_the_model_token_before_it(tokenizer):
    # The scorer reads "ab" + tool output "XY" + "c": a step ending after "X" lands on token 2 (tool
    # output, response_mask 0) and is credited to the model's "b" (token 1); a step inside a leading tool
    # output has no model token before it.
    ids = torch.tensor(tokenizer.encode("abXYc", add_special_tokens=False))
    attention = torch.ones(5, dtype=torch.long)
    model = torch.tensor([1, 1, 0, 0, 1])
    assert response_step_tokens([3, 5], ids, attention, model, tokenizer.decode) == [1, 4]
    assert response_step_tokens([1], ids, attention, torch.tensor([0, 1, 1, 1, 1]), tokenizer.decode) == [
        None
    ]


def test_the_reward_pool_checks_steps():
    assert check_value({"score": 1, "step_scores": [1, 0.5], "acc": 1}) == (
        "ok",
        1.0,
        {"acc": 1.0},
        ((1.0, 0.5), None),
    )
    assert check_value({"score": 0.0, "step_scores": [1.0], "step_ends": [4]})[3] == ((1.0,), (4,))
    assert check_value(2.0) == ("ok", 2.0, {}, None)
    bad = [
        ({"score": 1, "step_scores": "1,0"}, "step_scores of type str"),
        ({"score": 1, "step_scores": [1, float("nan")]}, "not a finite number"),
        (
            {"score": 1, "step_scores": [1, 0], "step_ends": [3]},
            "one positive character offset per step score (2)",
        ),
        ({"score": 1, "step_scores": [1, 0], "step_ends": [5, 5]}, "that do not increase"),
        ({"score": 1, "step_ends": [5]}, "'step_ends' without 'step_scores'"),
    ]
    for value, message in bad:
        outcome = check_value(value)
        assert outcome[0] == "err" and message in outcome[1], (value, outcome)
