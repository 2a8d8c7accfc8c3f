import math

import pytest
import torch

from tearless.algos import masked_mean, masked_sum, masked_var, masked_whiten

# The 2×3 example used throughout: valid entries are 1, 2 (row 0) and 4 (row 1).
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_sum():
    assert masked_sum(X, M).item() == 7.0  # 1 + 2 + 4
    assert masked_sum(X, M, dim=-1).tolist() == [3.0, 4.0]
    assert masked_sum(X, torch.zeros_like(M)).item() == 0.0


def test_masked_mean():
    assert masked_mean(X, M).item() == pytest.approx(7 / 3)
    assert masked_mean(X, M, dim=-1).tolist() == [1.5, 4.0]  # (1 + 2) / 2, 4 / 1
    assert masked_mean(X, M, dim=0).tolist() == [2.5, 2.0, 0.0]  # empty column → 0


def test_masked_mean_accepts_bool_int_float_masks():
    for mask in (M.bool(), M, M.float()):
        assert masked_mean(X, mask).item() == pytest.approx(7 / 3)


def test_masked_var():
    # mean 7/3; squared deviations (4/3)², (1/3)², (5/3)² sum to 42/9 = 14/3.
    assert masked_var(X, M).item() == pytest.approx(14 / 3 / 2)  # unbiased: / (3 − 1)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(14 / 3 / 3)


def test_masked_whiten():
    # (x − 7/3) / sqrt(7/3 + 1e-8) at valid entries, 0 elsewhere.
    s = math.sqrt(7 / 3 + 1e-8)
    expected = torch.tensor([[(1 - 7 / 3) / s, (2 - 7 / 3) / s, 0.0], [(4 - 7 / 3) / s, 0.0, 0.0]])
    torch.testing.assert_close(masked_whiten(X, M), expected)
    shifted_back = expected + torch.where(M.bool(), 7 / 3, 0.0)
    torch.testing.assert_close(masked_whiten(X, M, shift_mean=False), shifted_back)


def test_empty_mask_mean_and_var_raise():
    empty = torch.zeros_like(M)
    with pytest.raises(ValueError, match="masked_mean needs at least 1 valid"):
        masked_mean(X, empty)
    with pytest.raises(ValueError, match=r"masked_var.* needs at least 2 valid"):
        masked_var(X, empty)
    with pytest.raises(ValueError, match="needs at least"):
        masked_whiten(X, empty)


def test_single_element_variance():
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(X, one)
    assert masked_var(X, one, unbiased=False).item() == 0.0


def test_garbage_outside_mask_changes_nothing_not_even_the_gradient():
    for garbage in (float("nan"), float("inf"), -1e38):
        x = torch.where(M.bool(), X, garbage).requires_grad_()
        assert masked_sum(x, M).item() == 7.0
        assert masked_mean(x, M, dim=-1).tolist() == [1.5, 4.0]
        assert masked_var(x, M).item() == pytest.approx(7 / 3)
        out = masked_whiten(x, M)
        assert torch.isfinite(out).all()
        out.sum().backward()
        assert torch.isfinite(x.grad).all()
        assert (x.grad[~M.bool()] == 0).all()
