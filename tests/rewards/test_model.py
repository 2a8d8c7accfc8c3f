"""Reward-model scoring with a tiny sequence-classification model built here (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

from tearless.rewards.model import RewardModelScorer
from tearless.tasks.tokenizer import build_char_tokenizer
from tests.tolerances import logit_tol


def save_tiny_reward_model(directory, num_labels: int = 1) -> str:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_labels=num_labels,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(directory)
    tok.save_pretrained(directory)
    return str(directory)


def score_tol(directory) -> float:
    """Scores of one text from two differently batched (micro-batches, padding) forwards of the tiny
    reward model: its score is a logit of a random-init head, below 1 in size (init std 0.02 over
    32 hidden units), with the forward's rounding in float32."""
    from transformers import AutoConfig

    return logit_tol(AutoConfig.from_pretrained(directory), logit_bound=1.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm"))


PROMPTS = [
    [{"role": "user", "content": "1+2="}],
    "a much longer question, 47+38=",
    [{"role": "user", "content": "9+9="}],
]
RESPONSES = ["3", "85", "a long and wrong answer: 17"]


def test_micro_batches_and_padding_do_not_change_scores(model_dir):
    full = RewardModelScorer(model_dir).score(PROMPTS, RESPONSES)
    one = RewardModelScorer(model_dir, micro_batch_size=1).score(PROMPTS, RESPONSES)
    two = RewardModelScorer(model_dir, micro_batch_size=2).score(PROMPTS, RESPONSES)
    assert len(full) == 3 and len(set(full)) == 3
    tol = score_tol(model_dir)
    assert one == pytest.approx(full, abs=tol) and two == pytest.approx(full, abs=tol)


def test_pairs_render_with_the_chat_template_and_keep_their_end(model_dir):
    scorer = RewardModelScorer(model_dir, max_length=12)
    tok = scorer.tokenizer
    full = RewardModelScorer(model_dir).encode(PROMPTS[0], "3")
    assert tok.decode(full) == "<|user|>1+2=<|end|><|assistant|>3<|end|>"
    cut = scorer.encode("x" * 50, "the answer")
    assert len(cut) == 12 and tok.decode(cut).endswith("the answer<|end|>")


def test_a_classifier_with_two_labels_is_refused(tmp_path):
    path = save_tiny_reward_model(tmp_path, num_labels=2)
    with pytest.raises(ValueError, match="has 2 outputs; a reward model has one"):
        RewardModelScorer(path)
