import math

import pytest
import torch

from tearless.algos import KTO_LOSSES, kto_loss, kto_reference_point
from tearless.algos.preference import log1mexp


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# Three responses: log π = (−1, −2, −3), reference −1.5 for each, so ℓ = (0.5, −0.5, −1.5); the first
# and the last are desirable. Mismatched pairs give log π − log π_ref = (−2 − −3, −4 − −3.5) = (1, −0.5),
# so z = max(0, mean) = 0.25.
POLICY, REF = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5, -1.5, -1.5])
DESIRABLE = torch.tensor([True, False, True])
Z = kto_reference_point(torch.tensor([-2.0, -4.0]), torch.tensor([-3.0, -3.5]))


def test_kto_hand_worked():
    assert Z.item() == 0.25
    # β = 1, λ_D = 1, λ_U = 2: 1 − σ(0.5 − 0.25), 2·(1 − σ(0.25 − (−0.5))), 1 − σ(−1.5 − 0.25); mean of 3.
    loss, rewards = kto_loss(POLICY, REF, DESIRABLE, Z, beta=1.0, undesirable_weight=2.0)
    expected = (1 - sigmoid(0.25) + 2 * (1 - sigmoid(0.75)) + 1 - sigmoid(-1.75)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert rewards.tolist() == pytest.approx([0.5, -0.5, -1.5])


def test_apo_zero_unpaired_hand_worked():
    # No reference point: 1 − σ(0.1·0.5), σ(0.1·(−0.5)), 1 − σ(0.1·(−1.5)).
    loss, _ = kto_loss(POLICY, REF, DESIRABLE, Z, beta=0.1, kind="apo_zero_unpaired")
    expected = (1 - sigmoid(0.05) + sigmoid(-0.05) + 1 - sigmoid(-0.15)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_implicit_prm_hand_worked():
    # PRIME's cross-entropy of the outcome label against σ(βℓ), β = 0.1:
    # −log σ(0.05), −log σ(−(−0.05)), −log σ(−0.15); the reference point plays no part.
    loss, _ = kto_loss(POLICY, REF, DESIRABLE, Z, beta=0.1, kind="implicit_prm")
    expected = (math.log1p(math.exp(-0.05)) + math.log1p(math.exp(-0.05)) + math.log1p(math.exp(0.15))) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_reference_point_is_clamped_at_zero_and_detached():
    pk = torch.tensor([-5.0, -5.0], requires_grad=True)
    z = kto_reference_point(pk, torch.tensor([-4.0, -4.5]))  # mean −0.75 → 0
    assert z.item() == 0.0 and not z.requires_grad


@pytest.mark.parametrize("kind", sorted(KTO_LOSSES))
def test_gradient_raises_desirable_and_lowers_undesirable(kind):
    policy = POLICY.clone().requires_grad_()
    loss, _ = kto_loss(policy, REF, DESIRABLE, Z, beta=0.5, kind=kind)
    loss.backward()
    assert policy.grad[0] < 0 and policy.grad[2] < 0 and policy.grad[1] > 0


def test_log1mexp_is_accurate_at_both_ends():
    x = torch.tensor([-1e-8, -0.5, -30.0], dtype=torch.float64)
    want = [math.log(-math.expm1(-1e-8)), math.log(1 - math.exp(-0.5)), math.log1p(-math.exp(-30.0))]
    assert log1mexp(x).tolist() == pytest.approx(want, rel=1e-12)
    assert log1mexp(torch.tensor([-1e-30])).isfinite().all()


def test_errors():
    with pytest.raises(
        ValueError, match="unknown KTO loss kind 'bco'; known: apo_zero_unpaired, implicit_prm, kto"
    ):
        kto_loss(POLICY, REF, DESIRABLE, kind="bco")
    with pytest.raises(ValueError, match="beta must be > 0"):
        kto_loss(POLICY, REF, DESIRABLE, beta=-1.0)
