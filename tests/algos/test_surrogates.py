"""The loss modes of tearless.algos.surrogates (veRL 0.9's geo_mean, sapo, dppo_tv, dppo_kl, gpg, dro) on
hand-worked examples, and the gpg advantage estimator."""

import math

import pytest
import torch

from tearless.algos import compute_advantage, policy_loss


def run(mode, log_prob, old_log_prob, advantages, mask=None, **kwargs):
    log_prob = torch.tensor(log_prob, requires_grad=True)
    old_log_prob, advantages = torch.tensor(old_log_prob), torch.tensor(advantages)
    mask = torch.ones_like(old_log_prob) if mask is None else torch.tensor(mask)
    loss, metrics = policy_loss(
        mode,
        old_log_prob=old_log_prob,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        **kwargs,
    )
    loss.backward()
    return loss, metrics, log_prob.grad


def test_geo_mean_hand_worked():
    # ε = 0.2, old log-probs 0 so Δ = log π.
    # Row 0, A = +1: Δ = (0.5, −0.1) → min(Δ, clip Δ) = (0.2, −0.1): r = e^0.05, L0 = −e^0.05.
    # Row 1, A = −1: Δ = (0.5, −0.3) → max(Δ, clip Δ) = (0.5, −0.2): r = e^0.15, L1 = +e^0.15.
    # Loss = mean over the 2 sequences. Gradient: a token whose clipped value won has none; the others
    # −Ā·r/ℓ, halved by the mean: row 0 token 1 −e^0.05/4, row 1 token 0 +e^0.15/4.
    loss, metrics, grad = run(
        "geo_mean", [[0.5, -0.1], [0.5, -0.3]], [[0.0, 0.0]] * 2, [[1.0, 1.0], [-1.0, -1.0]]
    )
    assert loss.item() == pytest.approx((-math.exp(0.05) + math.exp(0.15)) / 2)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -math.exp(0.05) / 4], [math.exp(0.15) / 4, 0.0]]))
    # veRL's counts: Δ outside [−0.2, 0.2] with A > 0 (row 0 token 0) and with A < 0 (both of row 1).
    assert metrics["pg_clipfrac"].item() == 0.25 and metrics["pg_clipfrac_lower"].item() == 0.5


def test_geo_mean_is_a_mean_over_sequences_whatever_their_length_and_micro_batching():
    # Row 1 has 1 valid token of 3: L1 = −A·e^Δ = −2·e^0.1 counts once, like row 0's −e^0 = −1.
    args = (
        [[0.0, 0.0, 0.0], [0.1, 9.0, 9.0]],
        [[0.0] * 3] * 2,
        [[1.0] * 3, [2.0] * 3],
        [[1, 1, 1], [1, 0, 0]],
    )
    loss, _, _ = run("geo_mean", *args)
    assert loss.item() == pytest.approx((-1 - 2 * math.exp(0.1)) / 2)
    # Each row alone with the mini-batch's sequence count: the two halves add up to the whole.
    halves = [
        policy_loss(
            "geo_mean", old_log_prob=torch.zeros(1, 3), log_prob=torch.tensor([lp]),
            advantages=torch.tensor([a]), response_mask=torch.tensor([m]), global_num_seqs=2,
        )[0].item()
        for lp, a, m in zip(args[0], args[2], args[3], strict=True)
    ]  # fmt: skip
    assert sum(halves) == pytest.approx(loss.item())


def test_geo_mean_takes_rollout_weights_as_their_geometric_mean_per_sequence():
    # Weights (4, 1): geometric mean 2, so the sequence loss −1 (A = 1, ρ = 1) becomes −2.
    log_prob = torch.zeros(1, 2, requires_grad=True)
    loss, _ = policy_loss(
        "geo_mean", old_log_prob=torch.zeros(1, 2), log_prob=log_prob, advantages=torch.ones(1, 2),
        response_mask=torch.ones(1, 2), rollout_is_weights=torch.tensor([[4.0, 1.0]]),
    )  # fmt: skip
    assert loss.item() == pytest.approx(-2.0, rel=1e-6)


def test_sapo_hand_worked():
    # ρ = (1, 2), A = (+1, −1), τ = (τ_pos, τ_neg) = (1, 1.05). f_τ(ρ) = (4/τ)·σ(τ(ρ − 1)):
    # token 0: f = 4σ(0) = 2, L = −2, ∂L/∂logπ = −A·f'(ρ)·ρ = −4σ(0)(1 − σ(0)) = −1 (the plain PG);
    # token 1: f = (4/1.05)σ(1.05), L = +f, ∂L/∂logπ = 4σ(1.05)(1 − σ(1.05))·ρ with ρ = 2.
    # seq-mean-token-mean over the one row halves both.
    s = 1 / (1 + math.exp(-1.05))
    loss, metrics, grad = run("sapo", [[0.0, math.log(2.0)]], [[0.0, 0.0]], [[1.0, -1.0]])
    assert loss.item() == pytest.approx((-2 + 4 / 1.05 * s) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 4 * s * (1 - s) * 2 / 2]]))
    assert metrics["pg_clipfrac"].item() == 0.0
    # τ_pos = 2 halves the on-policy value of a positive token: f = (4/2)·σ(0) = 1.
    loss, _, _ = run("sapo", [[0.0]], [[0.0]], [[1.0]], tau_pos=2.0)
    assert loss.item() == -1.0
    with pytest.raises(ValueError, match="tau_pos and tau_neg must be > 0"):
        run("sapo", [[0.0]], [[0.0]], [[1.0]], tau_neg=0.0)


# DPPO example: p_old = 0.5 for every token, p = (0.8, 0.6, 0.3, 0.45), A = (+1, +1, −1, −1),
# so ρ = p / p_old = (1.6, 1.2, 0.6, 0.9) and p − p_old = (0.3, 0.1, −0.2, −0.05).
DPPO_P = [0.8, 0.6, 0.3, 0.45]
DPPO = ([[math.log(p) for p in DPPO_P]], [[math.log(0.5)] * 4], [[1.0, 1.0, -1.0, -1.0]])


def test_dppo_tv_hand_worked():
    # δ = 0.15: A > 0 needs p − p_old ≤ 0.15 (token 0 out), A < 0 needs ≥ −0.15 (token 2 out).
    # L = −A·sg[ρ]·logπ on the valid tokens: (0, −1.2·log 0.6, 0, +0.9·log 0.45), token-mean;
    # the gradient is −A·ρ/4 there, 0 outside the region.
    loss, metrics, grad = run("dppo_tv", *DPPO, clip_ratio_low=0.15, clip_ratio_high=0.15)
    assert loss.item() == pytest.approx((-1.2 * math.log(0.6) + 0.9 * math.log(0.45)) / 4)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -1.2 / 4, 0.0, 0.9 / 4]]))
    assert metrics["pg_clipfrac"].item() == 0.5 and metrics["pg_clipfrac_lower"].item() == 0.0
    # c = 1.1 truncates token 1's weight 1.2 to 1.1 (a valid token: counted in pg_clipfrac_lower).
    loss, metrics, _ = run("dppo_tv", *DPPO, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=1.1)
    assert loss.item() == pytest.approx((-1.1 * math.log(0.6) + 0.9 * math.log(0.45)) / 4)
    assert metrics["pg_clipfrac_lower"].item() == 0.25


def test_dppo_kl_bounds_only_the_move_the_advantage_pushes():
    # Binary KL from p_old = 0.5: D(p) = 0.5·log(0.5/p) + 0.5·log(0.5/(1 − p)):
    # D(0.8) = 0.2231, D(0.6) = 0.0204, D(0.3) = 0.0872, D(0.45) = 0.0050, D(0.1) = 0.5108.
    # δ = 0.05: token 0 (A > 0, up) and token 2 (A < 0, down) are out; token 4 (A > 0, p down to 0.1)
    # has the largest divergence but moved against its advantage, so it stays valid.
    p = [*DPPO_P, 0.1]
    log_prob, old, adv = [[math.log(x) for x in p]], [[math.log(0.5)] * 5], [[1.0, 1.0, -1.0, -1.0, 1.0]]
    loss, metrics, _ = run("dppo_kl", log_prob, old, adv, clip_ratio_low=0.05, clip_ratio_high=0.05)
    kept = -1.2 * math.log(0.6) + 0.9 * math.log(0.45) - 0.2 * math.log(0.1)
    assert loss.item() == pytest.approx(kept / 5)
    assert metrics["pg_clipfrac"].item() == pytest.approx(2 / 5)


def test_gpg_and_dro_hand_worked():
    # GPG: L = −A·logπ with logπ = (log ½, log ¼), A = (2, −1): (2 ln 2 − 2 ln 2)/2 = 0; ∂ = −A/2.
    loss, metrics, grad = run("gpg", [[math.log(0.5), math.log(0.25)]], [[0.0, 0.0]], [[2.0, -1.0]])
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, 0.5]]))
    assert metrics["pg_clipfrac"].item() == 0.0
    # DRO: logπ = log ½, logπ_old = log ¼ (Δ = ln 2), A = 1, β = 2:
    # L = −(ln ½ − ½·2·(ln 2)²) = ln 2 + (ln 2)², ∂L/∂logπ = −(A − βΔ) = 2 ln 2 − 1.
    loss, _, grad = run("dro", [[math.log(0.5)]], [[math.log(0.25)]], [[1.0]], dro_beta=2.0)
    assert loss.item() == pytest.approx(math.log(2) + math.log(2) ** 2)
    assert grad.item() == pytest.approx(2 * math.log(2) - 1)
    with pytest.raises(ValueError, match="policy loss 'dro' needs 'dro_beta'"):
        run("dro", [[0.0]], [[0.0]], [[1.0]])
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        run("dro", [[0.0]], [[0.0]], [[1.0]], dro_beta=0.0)


@pytest.mark.parametrize("mode", ["geo_mean", "sapo"])
def test_modes_with_their_own_aggregation_refuse_another(mode):
    with pytest.raises(ValueError, match=f"{mode!r} aggregates with 'seq-mean-token-mean'"):
        run(mode, [[0.0]], [[0.0]], [[1.0]], loss_agg_mode="token-mean")


@pytest.mark.parametrize("mode", ["gpg", "dro", "dppo_tv", "dppo_kl"])
def test_the_other_new_modes_honour_loss_agg_mode(mode):
    # Rows of 3 and 1 valid tokens, ρ = 1 and logπ = −1 with A = 1: every token's loss is 1.
    # token-mean 4/4 = 1, token-sum 4, seq-mean-token-sum (3 + 1)/2 = 2.
    args = ([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]], [[-1.0] * 3] * 2, [[1.0] * 3] * 2, [[1, 1, 1], [1, 0, 0]])
    extra = {"dro_beta": 0.5}
    mean = run(mode, *args, loss_agg_mode="token-mean", **extra)[0].item()
    total = run(mode, *args, loss_agg_mode="token-sum", **extra)[0].item()
    per_seq = run(mode, *args, loss_agg_mode="seq-mean-token-sum", **extra)[0].item()
    assert (mean, total, per_seq) == pytest.approx((1.0, 4.0, 2.0))


def test_gpg_advantage_hand_worked():
    # Groups a = (1, 0, 0), b = (0, 0), c = (2) (a singleton keeps its reward). B = 6 rows, 2 with a
    # non-zero reward: α = 6/2 = 3. a: 3·(1 − ⅓, −⅓, −⅓) = (2, −1, −1); b: 0; c: 3·2 = 6.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    mask = torch.ones(6, 2, dtype=torch.bool)
    token_rewards = torch.stack([torch.zeros(6), rewards], dim=1)
    adv, returns = compute_advantage(
        "gpg", token_level_rewards=token_rewards, response_mask=mask, index=["a", "a", "a", "b", "b", "c"]
    )
    torch.testing.assert_close(adv[:, 0], torch.tensor([2.0, -1.0, -1.0, 0.0, 0.0, 6.0]))
    assert torch.equal(adv[:, 0], adv[:, 1]) and torch.equal(adv, returns)


def test_grpo_population_std_for_flow_grpo():
    # Group (1, 0): mean ½, population std ½, unbiased std √2/2. With ε = 0: ±1 and ±√2/2.
    args = {
        "token_level_rewards": torch.tensor([[1.0], [0.0]]),
        "response_mask": torch.ones(2, 1),
        "epsilon": 0.0,
    }
    for scope in ("group", "batch"):
        pop, _ = compute_advantage("grpo", index=[0, 0], std_scope=scope, unbiased_std=False, **args)
        unbiased, _ = compute_advantage("grpo", index=[0, 0], std_scope=scope, **args)
        torch.testing.assert_close(pop[:, 0], torch.tensor([1.0, -1.0]))
        torch.testing.assert_close(unbiased[:, 0], torch.tensor([1.0, -1.0]) / math.sqrt(2))
