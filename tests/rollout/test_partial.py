"""Partial rollouts in the built-in engine: a response interrupted by new weights goes on under them.

``HFRollout.generate(between_tokens=...)`` asks before every decode forward whether new weights were
loaded; when they were, the live responses are prefilled again (prompt + tokens so far) and sampling
continues at the same position with the same draws. Checked here: with the same weights loaded the
samples do not change; with other weights every token's recorded log-prob is the one of the policy
that drew it (the old one before the swap, the new one after), and each token carries its version.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tearless.data import render_prompt
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.rollout.hf import HFRollout, concat_rollouts
from tearless.rollout.seeds import prompt_keys
from tests.rollout.test_hf import QUESTIONS, as_batch
from tests.tolerances import LOGIT_BOUND, logprob_tol

# Temperature 1.5 on the warmed model: samples of a prompt diverge after a few tokens and many
# responses run to the cap, so the swap lands in the middle of most of them.
TEMPERATURE = 1.5
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def setup(task):
    tok = load_tokenizer(task.model_dir)
    model = load_causal_lm(task.model_dir)
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    other = copy.deepcopy(model)
    with torch.no_grad():  # a clearly different policy: every weight moved by 30% of its scale
        gen = torch.Generator().manual_seed(0)
        for p in other.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    return tok, model, other, prompts


class SwapAt:
    """``between_tokens`` that loads ``weights`` into ``model`` at its ``at``-th call (0-based: after
    the tokens of position ``at`` were drawn) and reports ``version``; None at every other call."""

    def __init__(self, model, weights, at: int, version: int) -> None:
        self.model, self.weights, self.at, self.version = model, weights, at, version
        self.calls = 0

    def __call__(self) -> int | None:
        self.calls += 1
        if self.calls - 1 != self.at:
            return None
        self.model.load_state_dict(self.weights)
        return self.version


def sample(tok, model, prompts, **kw):
    rollout = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    return rollout.generate(
        prompts,
        n=4,
        max_new_tokens=NEW_TOKENS,
        temperature=TEMPERATURE,
        keys=prompt_keys(7, 0, 0, len(prompts)),
        **kw,
    )


def test_loading_the_same_weights_mid_response_changes_no_sample(setup):
    # The re-prefill recomputes the cache in another order (one pass instead of token by token) and
    # gives each sample its own row: the distributions agree to float32 rounding, the draws are the
    # same, so the tokens are the same (a draw within ~1e-6 of a CDF boundary would be needed to flip
    # one) and the log-probs agree within the forward's rounding.
    tok, model, _, prompts = setup
    plain = sample(tok, copy.deepcopy(model), prompts)
    swapped_model = copy.deepcopy(model)
    hook = SwapAt(swapped_model, model.state_dict(), at=3, version=8)
    resumed = sample(tok, swapped_model, prompts, version=7, between_tokens=hook)
    assert resumed.response_ids.tolist() == plain.response_ids.tolist()
    assert resumed.response_mask.tolist() == plain.response_mask.tolist()
    atol = logprob_tol(model.config, torch.float32, logit_bound=LOGIT_BOUND / TEMPERATURE)
    torch.testing.assert_close(resumed.log_probs, plain.log_probs, atol=atol, rtol=0)
    # Tokens 0..3 were drawn before the swap (version 7), the rest after it (8); 0 outside the mask.
    mask = resumed.response_mask.bool()
    assert mask[:, 4:].any(), "no response outlived the swap: the test would not test anything"
    expected = torch.where(torch.arange(mask.shape[1]) < 4, 7, 8).expand_as(mask)
    assert resumed.token_versions.tolist() == torch.where(mask, expected, 0).tolist()
    assert (plain.token_versions[mask] == 0).all()
    assert hook.calls >= 4


def test_each_token_keeps_the_log_prob_of_the_policy_that_drew_it(setup, local_workers):
    tok, model, other, prompts = setup
    swap = 2  # tokens 0..2 under the old weights, 3.. under the new ones
    sampler = copy.deepcopy(model)
    out = sample(tok, sampler, prompts, between_tokens=SwapAt(sampler, other.state_dict(), swap, 1))
    hot = (
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}"  # the trainer's actor log-probs of each policy
    )
    old, _ = local_workers(hot, models={"actor": model}).compute_log_prob("actor", as_batch(out))
    new, _ = local_workers(hot, models={"actor": other}).compute_log_prob("actor", as_batch(out))
    mask = out.response_mask.bool()
    before = mask & (torch.arange(mask.shape[1]) <= swap)
    after = mask & (torch.arange(mask.shape[1]) > swap)
    assert after.sum() >= 50, "too few tokens after the swap to tell the policies apart"
    atol = logprob_tol(model.config, torch.float32, logit_bound=LOGIT_BOUND / TEMPERATURE)
    torch.testing.assert_close(out.log_probs[before], old[before], atol=atol, rtol=0)
    torch.testing.assert_close(out.log_probs[after], new[after], atol=atol, rtol=0)
    # The policies differ where it matters: the old one's log-probs of the resumed tokens are not the
    # recorded ones (measured: a mean gap of 0.16 nats, 70x the tolerance; asserting 20x).
    assert (out.log_probs[after] - old[after]).abs().mean() > 20 * atol
    assert out.token_versions[before].unique().tolist() == [0]
    assert out.token_versions[after].unique().tolist() == [1]
    # Before the swap the samples are the uninterrupted old policy's own.
    plain = sample(tok, copy.deepcopy(model), prompts)
    assert out.response_ids[:, : swap + 1].tolist() == plain.response_ids[:, : swap + 1].tolist()


def test_two_swaps_in_one_response_and_concatenation_keep_the_versions(setup):
    tok, model, other, prompts = setup
    sampler = copy.deepcopy(model)
    first, second = SwapAt(sampler, other.state_dict(), 1, 4), SwapAt(sampler, model.state_dict(), 3, 5)

    def both() -> int | None:
        a, b = first(), second()
        return b if b is not None else a

    out = sample(tok, sampler, prompts[:4], version=3, between_tokens=both)
    mask = out.response_mask.bool()
    by_position = [3, 3, 4, 4] + [5] * (mask.shape[1] - 4)
    expected = torch.tensor(by_position).expand_as(mask)
    assert out.token_versions.tolist() == torch.where(mask, expected, 0).tolist()
    greedy = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    short = greedy.generate(prompts[4:], max_new_tokens=3, do_sample=False, version=9)
    joined = concat_rollouts([out, short], tok.pad_token_id)
    assert joined.token_versions[: len(mask)].tolist() == out.token_versions.tolist()
    tail = joined.token_versions[len(mask) :]
    assert tail[:, :3][short.response_mask.bool()].unique().tolist() == [9]
    assert (tail[:, 3:] == 0).all()
