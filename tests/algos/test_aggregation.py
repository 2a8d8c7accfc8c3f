import pytest
import torch

from tearless.algos import AGG_MODES, agg_loss
from tests.tolerances import sum_tol

# 3×3 example. Row 0 has 3 valid tokens (sum 6, mean 2), row 1 has 1 (sum 4, mean 4), row 2 none.
L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
M = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 10 / 4),  # (6 + 4) / 4 tokens
        ("token-sum", 10.0),
        ("seq-mean-token-sum", 10 / 2),  # (6 + 4) / 2 non-empty rows
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum-norm", 10 / 2 / 3),  # / 2 non-empty rows / padded width T = 3
    ],
)
def test_hand_worked(mode, expected):
    assert agg_loss(L, M, mode).item() == pytest.approx(expected)


def test_none_is_token_mean():
    assert agg_loss(L, M, None).item() == agg_loss(L, M, "token-mean").item()


def test_dr_grpo_norm_is_a_mean_over_responses_of_sums_over_a_constant():
    # The example: 4 responses × 5 tokens of loss 1. Σ = 20, over 4 responses and S = 5: 1.0
    # (veRL 0.9 and TRL's dr_grpo give 1.0; dividing by S alone gave 4.0).
    ones = torch.ones(4, 5)
    assert agg_loss(ones, ones, "seq-mean-token-sum-norm").item() == 1.0
    # With S = max_response_length = 8 the value no longer depends on how wide the batch was padded:
    # the same 4 responses of 5 tokens padded to width 5 or 8 give 20 / (4 · 8) = 0.625 both times.
    padded = torch.cat([ones, torch.zeros(4, 3)], dim=1)
    assert agg_loss(ones, ones, "seq-mean-token-sum-norm", loss_scale_factor=8).item() == 0.625
    assert agg_loss(padded, padded, "seq-mean-token-sum-norm", loss_scale_factor=8).item() == 0.625


def test_global_normalisers_and_scale_factor():
    assert agg_loss(L, M, "token-mean", global_num_tokens=8).item() == pytest.approx(10 / 8)
    assert agg_loss(L, M, "seq-mean-token-sum", global_num_seqs=5).item() == pytest.approx(10 / 5)
    assert agg_loss(L, M, "seq-mean-token-mean", global_num_seqs=torch.tensor(4)).item() == pytest.approx(
        6 / 4
    )
    assert agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=5).item() == pytest.approx(10 / 2 / 5)
    # Global sequence count too: 10 / (4 sequences · S = 5).
    norms = {"global_num_seqs": 4, "loss_scale_factor": 5}
    assert agg_loss(L, M, "seq-mean-token-sum-norm", **norms).item() == pytest.approx(10 / 4 / 5)
    with pytest.raises(ValueError, match="loss_scale_factor must be > 0"):
        agg_loss(L, M, "seq-mean-token-sum-norm", loss_scale_factor=0)


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_empty_mask_gives_connected_zero(mode):
    loss_mat = torch.full((2, 3), float("nan"), requires_grad=True)
    loss = agg_loss(loss_mat, torch.zeros(2, 3), mode)
    assert loss.item() == 0.0
    loss.backward()
    assert (loss_mat.grad == 0).all()


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
def test_micro_batches_with_global_counts_match_the_mini_batch(mode):
    torch.manual_seed(0)
    loss_mat = torch.randn(5, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    norms = {
        "global_num_tokens": int(mask.sum()),
        "global_num_seqs": int(mask.any(-1).sum()),
        "loss_scale_factor": 4.0,
    }
    full = agg_loss(loss_mat, mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss_mat)
    parts = sum(agg_loss(loss_mat[rows], mask[rows], mode, **norms) for rows in (slice(0, 2), slice(2, 5)))
    (parts_grad,) = torch.autograd.grad(parts, loss_mat)
    # The same 20 terms (weighted by at most 1) summed in two parts: float32 rounding of the sum,
    # relative to the terms' absolute sum. Per-entry gradients are a normaliser each: the default.
    atol = sum_tol(loss_mat.numel(), float((loss_mat.detach() * mask).abs().sum()))
    torch.testing.assert_close(parts, full, atol=atol, rtol=0)
    torch.testing.assert_close(parts_grad, full_grad)


def test_unknown_mode_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'; known: seq-mean-token-mean"):
        agg_loss(L, M, "mean")
