import math

import pytest
import torch

from tearless.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_penalty,
    make_kl_controller,
)

# x = log 0.5 (policy), y = log 0.25 (reference): x − y = log 2.
X = torch.tensor([math.log(0.5)])
Y = torch.tensor([math.log(0.25)])
LOG2 = math.log(2.0)


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("kl", LOG2),
        ("k1", LOG2),
        ("abs", LOG2),
        ("mse", 0.5 * LOG2**2),  # 0.240227
        ("k2", 0.5 * LOG2**2),
        ("low_var_kl", 0.5 + LOG2 - 1),  # u = −log 2: e^u − u − 1 = 0.5 + 0.693 − 1 = 0.193147
        ("k3", 0.5 + LOG2 - 1),
    ],
)
def test_hand_worked(kind, expected):
    assert kl_penalty(X, Y, kind).item() == pytest.approx(expected)


def test_abs_of_negative_difference():
    assert kl_penalty(Y, X, "abs").item() == pytest.approx(LOG2)
    assert kl_penalty(Y, X, "k1").item() == pytest.approx(-LOG2)


def test_full_hand_worked():
    # p = (½, ½), q = (¼, ¾): ½ log 2 + ½ log(2/3) = 0.143841.
    p = torch.tensor([[0.5, 0.5]]).log()
    q = torch.tensor([[0.25, 0.75]]).log()
    assert kl_penalty(p, q, "full").item() == pytest.approx(0.5 * LOG2 + 0.5 * math.log(2 / 3))
    assert kl_penalty(p, q, "full").shape == (1,)
    with pytest.raises(ValueError, match="one shape"):
        kl_penalty(p, q[:, :1], "full")


def test_k3_is_clamped():
    # y − x = 30 is clamped to 20, e^20 − 21 is clamped to 10.
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([30.0]), "k3").item() == 10.0


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "mse", "k2", "k3", "low_var_kl"])
def test_straight_through_forms_have_base_value_and_k2_gradient(base):
    torch.manual_seed(0)
    x = torch.randn(5, requires_grad=True)
    y = torch.randn(5)
    value = kl_penalty(x, y, base + "+")
    torch.testing.assert_close(value, kl_penalty(x, y, base))
    (grad,) = torch.autograd.grad(value.sum(), x)
    torch.testing.assert_close(grad, (x - y).detach())  # d/dx ½(x − y)²


def test_unknown_kinds():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; known: abs, full, k1"):
        kl_penalty(X, Y, "k4")
    with pytest.raises(ValueError, match="'full\\+'"):
        kl_penalty(X, Y, "full+")
    assert set(KL_ESTIMATORS) == {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"}


def test_k3_is_non_negative_and_its_sample_mean_approaches_the_exact_kl():
    # Sample N tokens from a small categorical π and compare the mean of k3 with KL(π ‖ π_ref).
    # Tolerance: k3 is unbiased, so by the CLT its sample mean is within 5 standard errors
    # sqrt(Var_π[k3] / N) of the exact value except with probability < 1e-6 (the variance is exact,
    # computed from the two distributions). The seed is fixed, so the test is deterministic anyway.
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0], dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.tensor([0.0, 0.8, -0.3, 0.2, -1.5], dtype=torch.float64), -1)
    exact = kl_penalty(logp, logq, "full").item()
    k3_all = kl_penalty(logp, logq, "k3")  # k3 of each vocabulary item
    assert (k3_all >= 0).all()
    p = logp.exp()
    assert (p * k3_all).sum().item() == pytest.approx(exact)  # unbiased, exactly
    n = 200_000
    tokens = torch.multinomial(p, n, replacement=True)
    samples = kl_penalty(logp[tokens], logq[tokens], "k3")
    assert (samples >= 0).all()
    std_err = math.sqrt(((p * k3_all.square()).sum().item() - exact**2) / n)
    assert abs(samples.mean().item() - exact) < 5 * std_err


def test_fixed_controller():
    ctrl = FixedKLController(0.05)
    ctrl.update(10.0, n_steps=1000)
    assert ctrl.value == 0.05


def test_adaptive_controller_hand_worked():
    # KL 0.2 vs target 0.1: e = clip(1, ±0.2) = 0.2 → β = 0.1·(1 + 0.2·100/1000) = 0.102.
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=1000)
    ctrl.update(0.2, n_steps=100)
    assert ctrl.value == pytest.approx(0.102)
    # KL 0.05: e = −0.5 → −0.2 → β = 0.102·(1 − 0.02).
    ctrl.update(torch.tensor(0.05), n_steps=100)
    assert ctrl.value == pytest.approx(0.102 * 0.98)
    # KL 0.11: e = 0.1, not clipped.
    ctrl.update(0.11, n_steps=1000)
    assert ctrl.value == pytest.approx(0.102 * 0.98 * 1.1)


def test_adaptive_controller_moves_toward_the_target():
    ctrl = AdaptiveKLController(1.0, target_kl=0.1, horizon=100)
    for _ in range(5):
        before = ctrl.value
        ctrl.update(0.5, n_steps=10)
        assert ctrl.value > before
    for _ in range(5):
        before = ctrl.value
        ctrl.update(0.01, n_steps=10)
        assert ctrl.value < before


def test_controller_state_round_trip_and_validation():
    ctrl = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    ctrl.update(1.0, n_steps=5)
    fresh = AdaptiveKLController(0.1, target_kl=0.1, horizon=10)
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == ctrl.value
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.1, target_kl=0.1, horizon=0)
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.1, target_kl=0.0, horizon=10)


def test_make_kl_controller():
    assert isinstance(make_kl_controller("fixed", 0.2), FixedKLController)
    adaptive = make_kl_controller("adaptive", 0.2, target_kl=0.1, horizon=10)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == 0.2
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        make_kl_controller("adaptive", 0.2)
    with pytest.raises(ValueError, match="unknown KL controller 'pid'"):
        make_kl_controller("pid", 0.2)


def test_gaussian_kl_hand_worked():
    # Row 0: Δμ = (1, 0), s = 0.5: Σ Δμ²/(2s²) = 1/0.5 = 2, mean over 2 elements = 1.
    # Row 1: Δμ = (2, 2): Σ = (4 + 4)/0.5 = 16, mean 8.
    from tearless.algos import gaussian_kl

    mean = torch.tensor([[1.0, 0.0], [3.0, 1.0]])
    ref = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    assert gaussian_kl(mean, ref, 0.5, reduce="sum").tolist() == pytest.approx([2.0, 16.0])
    assert gaussian_kl(mean, ref, 0.5).tolist() == pytest.approx([1.0, 8.0])
    with pytest.raises(ValueError, match="reduce"):
        gaussian_kl(mean, ref, 0.5, reduce="max")


def test_gaussian_kl_matches_monte_carlo():
    # KL(p‖q) = E_p[log p(x) − log q(x)], estimated from 200,000 draws of p = N(μ, s²I) in 3 dims.
    from tearless.algos import gaussian_kl

    g = torch.Generator().manual_seed(0)
    mu, mu_ref, s = torch.tensor([0.3, -0.2, 0.5]), torch.tensor([0.1, 0.1, 0.0]), 0.4
    x = mu + s * torch.randn(200_000, 3, generator=g, dtype=torch.float64)

    def log_density(m):
        return (-((x - m) ** 2) / (2 * s**2) - math.log(s) - 0.5 * math.log(2 * math.pi)).sum(-1)

    mc = (log_density(mu.double()) - log_density(mu_ref.double())).mean().item()
    exact = gaussian_kl(mu[None], mu_ref[None], s, reduce="sum").item()  # (0.04 + 0.09 + 0.25)/0.32
    assert exact == pytest.approx(0.38 / 0.32)
    assert mc == pytest.approx(exact, abs=0.01)
