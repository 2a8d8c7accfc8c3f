"""Truncated and masked importance sampling, the token veto and decoupled PPO, worked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from tearless.algos import policy_loss
from tearless.algos.offpolicy import level_log_ratio, rejection_mask, truncated_is_weights
from tests.tolerances import sum_tol

LN = math.log
# Row 0: three valid tokens with ratios 3, 1/2, 1 (Δ = ln 3, −ln 2, 0); row 1: two valid tokens with
# ratios 1/8 and 2 (Δ = −ln 8, ln 2); row 2: one valid token, ratio 1.5. Masked positions hold junk.
DELTA = torch.tensor([[LN(3), -LN(2), 0.0, 9.0], [-LN(8), LN(2), 7.0, 7.0], [LN(1.5), 5.0, 5.0, 5.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]])


def test_level_log_ratios():
    # sequence: Σ_t Δ = ln(3·½·1) = ln 1.5, ln(⅛·2) = ln ¼, ln 1.5; geometric: those over 3, 2 and 1 tokens
    seq = level_log_ratio(DELTA, MASK, "sequence")[:, 0].exp()
    torch.testing.assert_close(seq, torch.tensor([1.5, 0.25, 1.5]))
    geo = level_log_ratio(DELTA, MASK, "geometric")[:, 0].exp()
    torch.testing.assert_close(geo, torch.tensor([1.5 ** (1 / 3), 0.5, 1.5]))
    with pytest.raises(ValueError, match="batch"):
        level_log_ratio(DELTA, MASK, "batch")


def test_token_tis_with_both_bounds():
    w, m = truncated_is_weights(DELTA, MASK, level="token", upper=2.0, lower=0.25)
    # ratios 3, ½, 1 | ⅛, 2 | 1.5 → clip to [¼, 2]: 2, ½, 1 | ¼, 2 | 1.5; zero on masked positions
    expected = torch.tensor([[2.0, 0.5, 1.0, 0.0], [0.25, 2.0, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)
    assert m["is_weight_mean"] == pytest.approx((2 + 0.5 + 1 + 0.25 + 2 + 1.5) / 6)
    assert m["is_clip_frac"] == pytest.approx(1 / 6)  # only the 3 is above 2 (2 itself is not)
    assert m["is_clip_frac_low"] == pytest.approx(1 / 6)  # only the ⅛ is below ¼
    # Without a floor (veRL's TIS) the ⅛ stays.
    w, m = truncated_is_weights(DELTA, MASK, level="token", upper=2.0)
    assert w[1, 0] == pytest.approx(0.125) and m["is_clip_frac_low"] == 0.0
    assert not w.requires_grad


def test_sequence_tis_with_both_bounds():
    w, _ = truncated_is_weights(DELTA, MASK, level="sequence", upper=1.2, lower=0.5)
    # sequence ratios 1.5, ¼, 1.5 → clip to [½, 1.2]: 1.2, ½, 1.2 on every valid token of each row
    expected = torch.tensor([[1.2, 1.2, 1.2, 0.0], [0.5, 0.5, 0.0, 0.0], [1.2, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)


def test_token_rejection_band():
    keep, m = rejection_mask(DELTA, MASK, level="token", upper=2.0)
    # band [½, 2] (lower = 1/upper): 3 and ⅛ leave it; ½, 1, 2, 1.5 stay (the bounds are inside)
    expected = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.float32)
    torch.testing.assert_close(keep, expected)
    assert m["rs_masked_frac"] == pytest.approx(2 / 6)
    assert m["rs_seq_masked_frac"] == pytest.approx(2 / 3)  # rows 0 and 1 lost a token


def test_sequence_and_geometric_rejection():
    keep, m = rejection_mask(DELTA, MASK, level="sequence", upper=2.0, lower=0.3)
    # sequence ratios 1.5, ¼, 1.5 against [0.3, 2]: row 1 (¼) is rejected whole
    assert keep.sum(-1).tolist() == [3.0, 0.0, 1.0]
    assert m["rs_masked_frac"] == pytest.approx(2 / 6) and m["rs_seq_masked_frac"] == pytest.approx(1 / 3)
    keep, _ = rejection_mask(DELTA, MASK, level="geometric", upper=1.2, lower=0.0)
    # geometric means 1.5^(1/3) ≈ 1.145, ½, 1.5 against [0, 1.2]: row 2 (1.5) rejected, row 1 kept
    assert keep.sum(-1).tolist() == [3.0, 2.0, 0.0]


def test_token_veto_rejects_the_whole_response():
    # Row 1's token ratio ⅛ is under the veto 0.2: all of row 1 goes, even its ratio-2 token, though
    # the band [0, 10] would keep every token.
    keep, m = rejection_mask(DELTA, MASK, level="token", upper=10.0, lower=0.0, veto=0.2)
    assert keep.sum(-1).tolist() == [3.0, 0.0, 1.0]
    assert m["veto_frac"] == pytest.approx(1 / 3)


def test_decoupled_ppo_is_the_clipped_loss_around_the_proximal_policy_weighted_by_prox_over_behaviour():
    # One response, two tokens, advantages +1 and −1, ε = 0.2.
    # behaviour μ = (0.2, 0.5), proximal π_old = (0.3, 0.4), current π_θ = (0.45, 0.3):
    #   w = π_old/μ = (1.5, 0.8)          (under the TIS cap 2: untouched)
    #   r = π_θ/π_old = (1.5, 0.75)
    #   token 1 (A = +1): min(1.5·1, clip(1.5, 0.8, 1.2)·1) = 1.2      → −w·1.2 = −1.8
    #   token 2 (A = −1): min(0.75·−1, clip(0.75)·−1 = 0.8·−1) = −0.8   → −w·(−0.8) = +0.64
    #   token-mean: (−1.8 + 0.64)/2 = −0.58
    behaviour = torch.tensor([[LN(0.2), LN(0.5)]])
    proximal = torch.tensor([[LN(0.3), LN(0.4)]])
    current = torch.tensor([[LN(0.45), LN(0.3)]], requires_grad=True)
    mask = torch.ones(1, 2)
    w, _ = truncated_is_weights(proximal - behaviour, mask, level="token", upper=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 0.8]]))
    loss, m = policy_loss(
        "vanilla",
        old_log_prob=proximal,
        log_prob=current,
        advantages=torch.tensor([[1.0, -1.0]]),
        response_mask=mask,
        loss_agg_mode="token-mean",
        rollout_is_weights=w,
    )
    assert float(loss.detach()) == pytest.approx(-0.58, abs=sum_tol(2, 1.8, safety=4))
    # Both tokens are clipped (r outside [0.8, 1.2] on the side the advantage pushes): no gradient.
    assert float(m["pg_clipfrac"]) == 1.0
    (g,) = torch.autograd.grad(loss, current)
    assert g.abs().max() == 0
