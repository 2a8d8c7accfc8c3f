import math

import pytest
import torch

from tearless.algos import DPO_LOSSES, REFERENCE_FREE, dpo_loss


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))  # −log σ(−x)


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# One pair: log π(chosen) = −1 over L_c = 2 tokens, log π(rejected) = −2 over L_r = 5 tokens, the
# reference −1.5 for both. Log-ratios ℓ_c = 0.5, ℓ_r = −0.5, margin h = 1; β = 0.1, so βh = 0.1,
# βℓ_c = 0.05, βℓ_r = −0.05. Per token: ℓ_c/L_c = 0.25, ℓ_r/L_r = −0.1, their margin 0.35.
PAIR = (torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), torch.tensor([-1.5]))
LENGTHS = {"chosen_lengths": torch.tensor([2]), "rejected_lengths": torch.tensor([5])}
# Per-token policy log-probs for the reference-free kinds: −1/2 = −0.5 and −2/5 = −0.4.
ODDS = (-0.5 - -0.4) - (math.log(1 - math.exp(-0.5)) - math.log(1 - math.exp(-0.4)))
# Reference-free rewards: β log π summed (cpo) or per token (simpo, orpo).
SUM_REWARDS, MEAN_REWARDS = (-0.1, -0.2), (-0.05, -0.04)

CASES = [
    # kind, label smoothing ε, expected loss, (chosen reward, rejected reward) if not (βℓ_c, βℓ_r)
    ("sigmoid", 0.0, softplus(-0.1), None),  # −log σ(0.1) = 0.644397
    ("cdpo", 0.1, 0.9 * softplus(-0.1) + 0.1 * softplus(0.1), None),  # 0.654397
    ("robust", 0.1, (0.9 * softplus(-0.1) - 0.1 * softplus(0.1)) / 0.8, None),  # (0.579957 − 0.074440)/0.8
    ("hinge", 0.0, 0.9, None),  # relu(1 − 0.1)
    ("ipo", 0.0, (0.35 - 5.0) ** 2, None),  # (0.25 − (−0.1) − 1/(2·0.1))² = 21.6225
    ("ipo_sum", 0.0, (1.0 - 5.0) ** 2, None),  # (h − 1/(2β))² = 16
    ("sigmoid_norm", 0.0, softplus(-0.035), None),  # −log σ(0.1 · 0.35)
    (
        "exo_pair",
        1e-3,  # σ(.1)(log σ(.1) − log .999) + σ(−.1)(log σ(−.1) − log .001) = 3.12985
        sigmoid(0.1) * (-softplus(-0.1) - math.log(0.999))
        + sigmoid(-0.1) * (-softplus(0.1) - math.log(1e-3)),
        None,
    ),
    ("nca_pair", 0.0, softplus(-0.05) + 0.5 * softplus(0.05) + 0.5 * softplus(-0.05), None),
    ("bco_pair", 0.0, 2 * softplus(-0.05), None),  # −log σ(0.05) − log σ(−(−0.05))
    ("sppo_hard", 0.0, (0.5 - 5.0) ** 2 + (-0.5 + 5.0) ** 2, None),  # 20.25 + 20.25
    ("aot", 0.0, softplus(-0.1), None),  # one pair: sorted margins 1 − 0
    ("aot_unpaired", 0.0, softplus(-0.1), None),  # one pair: ℓ_c − ℓ_r = 1
    ("apo_zero", 0.0, 1 - sigmoid(0.05) + sigmoid(-0.05), None),  # 2σ(−0.05) = 0.975006
    ("apo_down", 0.0, sigmoid(0.05) + 1 - sigmoid(0.1), None),  # 0.512497 + 0.475021
    # x = βh = 0.1, w = σ(x/τ) = σ(2): (1 − w)·softplus(−0.1) + w·e^(−0.1)
    ("discopop", 0.0, (1 - sigmoid(2.0)) * softplus(-0.1) + sigmoid(2.0) * math.exp(-0.1), None),
    ("sft", 0.0, 0.5, None),  # −log π(chosen)/L_c = 1/2
    ("cpo", 0.0, softplus(-0.1) + 0.5, SUM_REWARDS),  # −log σ(β(−1 − −2)) + 1.0 · NLL
    ("simpo", 0.0, softplus(0.51), MEAN_REWARDS),  # x = −0.5 − −0.4 − 0.5/0.1 = −5.1; −log σ(βx)
    ("orpo", 0.0, 0.5 + 0.1 * softplus(-ODDS), MEAN_REWARDS),  # NLL − λ log σ(log odds ratio)
]


def test_every_kind_has_a_hand_worked_case():
    assert {c[0] for c in CASES} == set(DPO_LOSSES)


@pytest.mark.parametrize(("kind", "smoothing", "expected", "rewards"), CASES, ids=[c[0] for c in CASES])
def test_hand_worked(kind, smoothing, expected, rewards):
    loss, chosen, rejected = dpo_loss(*PAIR, beta=0.1, label_smoothing=smoothing, kind=kind, **LENGTHS)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    want = rewards or (0.05, -0.05)
    assert (chosen.item(), rejected.item()) == pytest.approx(want, rel=1e-6)


def test_aot_sorts_the_margins_over_the_batch():
    # Policy margins (3, 1) and reference margins (0, 2): paired they differ by (3, −1); sorted
    # (1, 3) − (0, 2) = (1, 1). β = 0.1: both pairs lose −log σ(0.1).
    policy_c, policy_r = torch.tensor([0.0, -1.0]), torch.tensor([-3.0, -2.0])
    ref_c, ref_r = torch.tensor([-1.0, 0.0]), torch.tensor([-1.0, -2.0])
    loss, _, _ = dpo_loss(policy_c, policy_r, ref_c, ref_r, beta=0.1, kind="aot")
    assert loss.item() == pytest.approx(softplus(-0.1), rel=1e-6)
    # aot_unpaired sorts ℓ_c = (1, −1) and ℓ_r = (−2, 0) separately: (−1, 1) − (−2, 0) = (1, 1).
    loss, _, _ = dpo_loss(policy_c, policy_r, ref_c, ref_r, beta=0.1, kind="aot_unpaired")
    assert loss.item() == pytest.approx(softplus(-0.1), rel=1e-6)


@pytest.mark.parametrize(
    ("divergence", "h"),
    [
        ("reverse_kl", 1.0),
        ("forward_kl", math.exp(0.5) - math.exp(-0.5)),  # −e^(−ℓ): −e^(−0.5) − (−e^(0.5)) = 1.042190
        ("js_divergence", 0.5),  # log σ(0.5) − log σ(−0.5) = 0.5
        # α = 0.5: e^(−ℓ/2)/(−1/2), so h = −2e^(−0.25) + 2e^(0.25)
        ("alpha_divergence", 2 * (math.exp(0.25) - math.exp(-0.25))),
    ],
)
def test_f_divergences_transform_the_log_ratios(divergence, h):
    loss, chosen, _ = dpo_loss(*PAIR, beta=0.1, f_divergence=divergence)
    assert loss.item() == pytest.approx(softplus(-0.1 * h), rel=1e-6)
    assert chosen.item() == pytest.approx(0.05)  # rewards stay β·ℓ, as TRL logs them


def test_ipo_averages_per_token_like_trl():
    # Issue 20, item 2. Two pairs with the same summed margin h = 1 but responses of 1 and 10 tokens:
    # TRL's IPO (the IPO authors' normalised form) compares ℓ/L, so the long pair is much further from
    # its target 1/(2β) = 5 than the short one: (1 − 5)² = 16 against (0.1 − 5)² = 24.01.
    ones = torch.ones(2)
    loss, _, _ = dpo_loss(
        torch.tensor([1.0, 1.0]),
        torch.zeros(2),
        torch.zeros(2),
        torch.zeros(2),
        beta=0.1,
        kind="ipo",
        chosen_lengths=torch.tensor([1, 10]),
        rejected_lengths=torch.tensor([1, 10]),
    )
    assert loss.item() == pytest.approx((16 + 24.01) / 2)
    loss, _, _ = dpo_loss(ones, torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=0.1, kind="ipo_sum")
    assert loss.item() == pytest.approx(16.0)  # the summed form ignores length


def test_nll_terms_stay_token_means_under_micro_batching():
    # sft: the NLL of 3 chosen responses of 1, 2 and 5 tokens (log-probs −1, −2, −9) is 12/8 = 1.5 per
    # token; split 2 + 1 with the step's mean chosen length 8/3 and weighted by pairs, it is the same.
    pc, lengths = torch.tensor([-1.0, -2.0, -9.0]), torch.tensor([1, 2, 5])
    zeros = torch.zeros(3)
    ones = torch.ones(3)
    whole, _, _ = dpo_loss(pc, zeros, zeros, zeros, kind="sft", chosen_lengths=lengths, rejected_lengths=ones)
    assert whole.item() == pytest.approx(1.5)
    total = 0.0
    for s in (slice(0, 2), slice(2, 3)):
        kw = {"chosen_lengths": lengths[s], "rejected_lengths": ones[s], "mean_chosen_length": 8 / 3}
        part, _, _ = dpo_loss(pc[s], zeros[s], zeros[s], zeros[s], kind="sft", **kw)
        total += part.item() * (s.stop - s.start) / 3
    assert total == pytest.approx(1.5)


@pytest.mark.parametrize("kind", sorted(set(DPO_LOSSES) - {"discopop"}))
def test_gradient_prefers_the_chosen_response(kind):
    chosen = torch.tensor([-1.0, -3.0], requires_grad=True)
    rejected = torch.tensor([-1.2, -2.0], requires_grad=True)
    loss, chosen_rewards, _ = dpo_loss(
        chosen,
        rejected,
        torch.tensor([-1.1, -2.5]),
        torch.tensor([-1.1, -2.5]),
        kind=kind,
        label_smoothing=1e-3 if kind == "exo_pair" else 0.0,
        chosen_lengths=torch.tensor([2, 3]),
        rejected_lengths=torch.tensor([2, 4]),
    )
    loss.backward()
    assert not chosen_rewards.requires_grad
    if kind == "sft":
        assert (chosen.grad < 0).all() and rejected.grad is None  # only the chosen side is trained
        return
    assert (chosen.grad - rejected.grad < 0).all()  # descent widens the margin
    if kind != "apo_down":  # apo_down lowers both likelihoods by design (the chosen one less)
        assert (chosen.grad < 0).all() and (rejected.grad > 0).all()


def test_discopop_is_not_monotonic_near_zero_margin():
    # Its blend weight w = σ(x/τ) moves faster than the losses it blends: at x = βh = 0, with τ = 0.05,
    # dL/dx = −w'·log 2 − (1 − w)·σ(0) + w'·1 − w·1 = −5·0.693147 − 0.25 + 5 − 0.5 = 0.784264 > 0, so
    # descent first shrinks a zero margin (the paper's non-convex log-ratio modulated loss).
    h = torch.zeros(1, requires_grad=True)
    loss, _, _ = dpo_loss(h, torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=1.0, kind="discopop")
    loss.backward()
    assert h.grad.item() == pytest.approx(5 - 5 * math.log(2) - 0.75, rel=1e-6)


def test_reference_free_kinds_ignore_the_reference():
    for kind in sorted(REFERENCE_FREE):
        a = dpo_loss(*PAIR[:2], torch.tensor([0.0]), torch.tensor([0.0]), kind=kind, **LENGTHS)[0]
        b = dpo_loss(*PAIR[:2], torch.tensor([-7.0]), torch.tensor([3.0]), kind=kind, **LENGTHS)[0]
        assert torch.equal(a, b), kind


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
    with pytest.raises(ValueError, match="unknown DPO loss kind 'kto'; known: aot, aot_unpaired, apo_down"):
        dpo_loss(*PAIR, kind="kto")
    with pytest.raises(ValueError, match="not defined for DPO loss kind 'ipo'; kinds that take it: aot,"):
        dpo_loss(*PAIR, kind="ipo", label_smoothing=0.1, **LENGTHS)
    # Issue 20, item 5: TRL >= 0.29 silently ignores label smoothing for sigmoid; here it is an error.
    with pytest.raises(ValueError, match="use kind 'robust' for robust DPO or 'cdpo' for conservative DPO"):
        dpo_loss(*PAIR, kind="sigmoid", label_smoothing=0.1)
    with pytest.raises(ValueError, match="'ipo' averages log-probs per response token: pass chosen_lengths"):
        dpo_loss(*PAIR, kind="ipo")
    with pytest.raises(ValueError, match=r"exo_pair needs label_smoothing in \(0, 1\)"):
        dpo_loss(*PAIR, kind="exo_pair")
    with pytest.raises(ValueError, match="unknown f-divergence 'tv'"):
        dpo_loss(*PAIR, f_divergence="tv")
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_loss(*PAIR, beta=0.0)
