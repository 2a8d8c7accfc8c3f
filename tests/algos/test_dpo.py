import math

import pytest
import torch

from tearless.algos import DPO_LOSSES, dpo_loss

# One pair: π(chosen) = −1, π(rejected) = −2, reference −1.5 for both.
# chosen log-ratio 0.5, rejected −0.5, h = 1; β = 0.1 → βh = 0.1.
PAIR = (torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]))


def softplus(x):
    return math.log1p(math.exp(x))


@pytest.mark.parametrize(
    ("kind", "smoothing", "expected"),
    [
        ("sigmoid", 0.0, softplus(-0.1)),  # −log σ(0.1) = 0.644397
        ("sigmoid", 0.1, 0.9 * softplus(-0.1) + 0.1 * softplus(0.1)),  # 0.654397
        ("ipo", 0.0, (1 - 1 / 0.2) ** 2),  # (h − 1/(2β))² = 16
        ("hinge", 0.0, 0.9),  # relu(1 − 0.1)
    ],
)
def test_hand_worked(kind, smoothing, expected):
    loss, chosen, rejected = dpo_loss(*PAIR, beta=0.1, label_smoothing=smoothing, kind=kind)
    assert loss.item() == pytest.approx(expected)
    assert chosen.item() == pytest.approx(0.05)  # β·0.5
    assert rejected.item() == pytest.approx(-0.05)


@pytest.mark.parametrize("kind", sorted(DPO_LOSSES))
def test_gradient_raises_chosen_and_lowers_rejected(kind):
    chosen = torch.tensor([-1.0, -3.0], requires_grad=True)
    rejected = torch.tensor([-1.2, -2.0], requires_grad=True)
    loss, chosen_rewards, _ = dpo_loss(
        chosen, rejected, torch.tensor([-1.1, -2.5]), torch.tensor([-1.1, -2.5]), kind=kind
    )
    loss.backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    assert not chosen_rewards.requires_grad


def test_loss_is_the_mean_over_pairs():
    pairs = [
        torch.tensor([-1.0, 0.0]),
        torch.tensor([-2.0, 0.0]),
        torch.tensor([-1.5, 0.0]),
        torch.tensor([-1.5, 0.0]),
    ]
    loss, _, _ = dpo_loss(*pairs)
    assert loss.item() == pytest.approx((softplus(-0.1) + math.log(2.0)) / 2)  # h = 0 → log 2


def test_errors():
    with pytest.raises(ValueError, match="unknown DPO loss kind 'kto'; known: hinge, ipo, sigmoid"):
        dpo_loss(*PAIR, kind="kto")
    with pytest.raises(ValueError, match="label_smoothing is not defined for DPO loss kind 'ipo'"):
        dpo_loss(*PAIR, kind="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(*PAIR, beta=0.0)
