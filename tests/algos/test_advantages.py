import math

import pytest
import torch

from tearless.algos import ADV_ESTIMATORS, compute_advantage

EPS = 1e-6


def outcome(rewards, width=3):
    """Rows with their outcome reward on the last of `width` valid tokens, and an all-ones mask."""
    r = torch.zeros(len(rewards), width)
    r[:, -1] = torch.tensor(rewards)
    return r, torch.ones(len(rewards), width)


def per_row(adv):
    return adv[:, 0].tolist()


def test_grpo_hand_worked():
    # Group "a" = rewards (1, 0): mean 0.5, unbiased std sqrt(0.25 + 0.25) = 0.7071 → ±0.5 / 0.7071.
    # Group "b" = (0.5) alone: mean 0, std 1 → 0.5 / (1 + eps).
    r, m = outcome([1.0, 0.0, 0.5])
    adv, ret = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=["a", "a", "b"])
    expected = [0.5 / (0.5**0.5 + EPS), -0.5 / (0.5**0.5 + EPS), 0.5 / (1 + EPS)]
    assert per_row(adv) == pytest.approx(expected)
    assert torch.equal(adv, ret)
    assert adv.shape == (3, 3)


def test_grpo_batch_std_scope_hand_worked():
    # Rewards (1, 0 | 1, 1): group means 0.5 and 1; one std over all four rewards, mean 0.75:
    # sqrt((3·0.0625 + 0.5625)/3) = sqrt(0.25) = 0.5. Group "b" stays exactly 0.
    r, m = outcome([1.0, 0.0, 1.0, 1.0])
    index = ["a", "a", "b", "b"]
    adv, _ = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=index, std_scope="batch")
    assert per_row(adv) == pytest.approx([0.5 / (0.5 + EPS), -0.5 / (0.5 + EPS), 0.0, 0.0])
    # The default (group scope) is unchanged by the new keyword.
    default, _ = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=index)
    group, _ = compute_advantage(
        "grpo", token_level_rewards=r, response_mask=m, index=index, std_scope="group"
    )
    assert torch.equal(default, group)
    assert per_row(default)[0] == pytest.approx(0.5 / (0.5**0.5 + EPS))
    with pytest.raises(ValueError, match="std_scope"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=index, std_scope="global")


def test_dr_grpo_does_not_divide_by_std():
    r, m = outcome([1.0, 0.0, 0.5])
    adv, _ = compute_advantage(
        "grpo", token_level_rewards=r, response_mask=m, index=["a", "a", "b"], norm_adv_by_std_in_grpo=False
    )
    assert per_row(adv) == pytest.approx([0.5, -0.5, 0.5])


def test_rloo_hand_worked():
    # Group (1, 0, 0.5): R_i − mean of the others = 1 − 0.25, 0 − 0.75, 0.5 − 0.5. Singleton → 0.
    r, m = outcome([1.0, 0.0, 0.5, 3.0])
    adv, ret = compute_advantage("rloo", token_level_rewards=r, response_mask=m, index=[0, 0, 0, 1])
    assert per_row(adv) == pytest.approx([0.75, -0.75, 0.0, 0.0])
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_hand_worked():
    # γ = 0.5. Row 0 rewards (0, 0, 1): G = (0.25, 0.5, 1). Row 1 (0, 2, 0): G = (1, 2, 0).
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    m = torch.ones(2, 3)
    adv, ret = compute_advantage("reinforce_plus_plus", token_level_rewards=r, response_mask=m, gamma=0.5)
    g = torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    torch.testing.assert_close(ret, g)
    torch.testing.assert_close(adv, (g - g.mean()) / (g.var() + 1e-8).sqrt())


def test_reinforce_plus_plus_skips_masked_middle_tokens():
    # Rewards (0, 5, 1) with the middle token masked (a tool's output): it is not a step, so with γ = 0.5
    # G = (0 + 0.5·1, —, 1) = (0.5, 0, 1); its garbage reward 5 is ignored.
    r = torch.tensor([[0.0, 5.0, 1.0], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 0, 1], [1, 1, 0]])
    _, ret = compute_advantage("reinforce_plus_plus", token_level_rewards=r, response_mask=m, gamma=0.5)
    assert ret.tolist() == [[0.5, 0.0, 1.0], [0.0, 0.0, 0.0]]


def test_reinforce_plus_plus_baseline_hand_worked():
    # Group a (1, 0) → ±0.5; singleton b keeps 2. Tiled over 2 tokens each, then whitened over 6 tokens.
    r, m = outcome([1.0, 0.0, 2.0], width=2)
    adv, ret = compute_advantage(
        "reinforce_plus_plus_baseline", token_level_rewards=r, response_mask=m, index=["a", "a", "b"]
    )
    pre = torch.tensor([[0.5, 0.5], [-0.5, -0.5], [2.0, 2.0]])
    torch.testing.assert_close(adv, (pre - pre.mean()) / (pre.var() + 1e-8).sqrt())
    assert torch.equal(adv, ret)


def test_remax_hand_worked():
    # G = reverse cumsum of masked rewards: row 0 (1, 1, 1), row 1 (1, 1, 0). A = G − b on valid tokens.
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantage(
        "remax", token_level_rewards=r, response_mask=m, reward_baselines=torch.tensor([0.5, 1.0])
    )
    assert ret.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    assert adv.tolist() == [[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="needs 'reward_baselines'"):
        compute_advantage("remax", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match=r"reward_baselines must be \(B,\)"):
        compute_advantage("remax", token_level_rewards=r, response_mask=m, reward_baselines=torch.ones(3))


def test_opo_hand_worked():
    # Group rows: R = (1, 0) with lengths (1, 3): b = (1·1 + 3·0) / 4 = 0.25 → A = (0.75, −0.25).
    # Singleton R = 2: baseline 0 → A = 2.
    r = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    m = torch.tensor([[1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv, _ = compute_advantage("opo", token_level_rewards=r, response_mask=m, index=["g", "g", "s"])
    assert adv.tolist() == [[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25], [2.0, 2.0, 0.0]]


def test_grpo_passk_hand_worked():
    # Group (0, 1, 0.5): the best row gets 1 − 0.5 = 0.5, divided by the std 0.5 (mean 0.5, squared
    # deviations 0.25 + 0.25 + 0 over n − 1 = 2); the others 0. Group (1, 1): tie → 0 for both.
    r, m = outcome([0.0, 1.0, 0.5, 1.0, 1.0])
    index = ["a", "a", "a", "b", "b"]
    adv, _ = compute_advantage("grpo_passk", token_level_rewards=r, response_mask=m, index=index)
    assert per_row(adv) == pytest.approx([0.0, 0.5 / (0.5 + EPS), 0.0, 0.0, 0.0])
    adv, _ = compute_advantage(
        "grpo_passk", token_level_rewards=r, response_mask=m, index=index, norm_adv_by_std_in_grpo=False
    )
    assert per_row(adv) == pytest.approx([0.0, 0.5, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least 2 responses"):
        compute_advantage("grpo_passk", token_level_rewards=r, response_mask=m, index=[0, 0, 0, 0, 1])


def test_gae_hand_worked():
    # γ = 0.9, λ = 0.8, V = (0.5, 0.6, 0.7), reward 1 at the end.
    # δ2 = 1 − 0.7 = 0.3                 A2 = 0.3
    # δ1 = 0.9·0.7 − 0.6 = 0.03          A1 = 0.03 + 0.72·0.3 = 0.246
    # δ0 = 0.9·0.6 − 0.5 = 0.04          A0 = 0.04 + 0.72·0.246 = 0.21712
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = compute_advantage(
        "gae", token_level_rewards=r, response_mask=torch.ones(1, 3), values=v, gamma=0.9, lam=0.8
    )
    raw = torch.tensor([[0.21712, 0.246, 0.3]])
    torch.testing.assert_close(ret, raw + v)
    torch.testing.assert_close(adv, (raw - raw.mean()) / (raw.var() + 1e-8).sqrt())


def test_gae_skips_masked_middle_tokens():
    # Middle token masked (garbage reward 9 and value 99 ignored); the scan carries V_next = 0.7 and
    # A = 0.3 across it: A0 = (0.9·0.7 − 0.5) + 0.72·0.3 = 0.13 + 0.216 = 0.346.
    r = torch.tensor([[0.0, 9.0, 1.0], [0.0, 0.0, 0.0]])
    v = torch.tensor([[0.5, 99.0, 0.7], [0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 0, 1], [1, 0, 0]])
    _, ret = compute_advantage("gae", token_level_rewards=r, response_mask=m, values=v, gamma=0.9, lam=0.8)
    torch.testing.assert_close(ret - v * m, torch.tensor([[0.346, 0.0, 0.3], [0.0, 0.0, 0.0]]))


def test_gae_with_unit_gamma_lambda_is_monte_carlo_return_minus_value():
    torch.manual_seed(0)
    r, v = torch.randn(4, 6), torch.randn(4, 6)
    m = torch.ones(4, 6)
    m[1, 4:] = 0
    m[2, 1:] = 0
    _, ret = compute_advantage("gae", token_level_rewards=r, response_mask=m, values=v)
    mc = (r * m).flip(-1).cumsum(-1).flip(-1) * m
    torch.testing.assert_close(ret - v * m, mc - v * m)


GROUPED = ["grpo", "rloo", "opo", "grpo_passk"]


@pytest.mark.parametrize("estimator", GROUPED)
@pytest.mark.parametrize("norm", [True, False])
def test_equal_reward_groups_get_exactly_zero(estimator, norm):
    # Three rewards of 0.1 average to 0.10000000000000002 in floating point; the result must still be 0.
    r, m = outcome([0.1, 0.1, 0.1, 0.7, 0.7, 0.7])
    adv, _ = compute_advantage(
        estimator,
        token_level_rewards=r,
        response_mask=m,
        index=[1, 1, 1, 2, 2, 2],
        norm_adv_by_std_in_grpo=norm,
    )
    assert (adv == 0).all()


def test_grpo_advantages_of_a_group_sum_to_zero():
    torch.manual_seed(1)
    r, m = outcome(torch.rand(12).tolist())
    index = [i % 3 for i in range(12)]
    adv, _ = compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=index)
    for g in range(3):
        assert adv[g::3, 0].sum().item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "opo", "grpo_passk", "reinforce_plus_plus_baseline"])
def test_groups_follow_ids_not_positions(estimator):
    torch.manual_seed(2)
    r = torch.rand(8, 4)
    m = (torch.rand(8, 4) > 0.3).float()
    m[:, 0] = 1
    uids = ["p0", "p1", "p2", "p3", "p0", "p1", "p2", "p3"]
    reference, _ = compute_advantage(estimator, token_level_rewards=r, response_mask=m, index=uids)
    as_ints = [int(u[1:]) for u in uids]
    for index in (as_ints, torch.tensor(as_ints), [torch.tensor(i) for i in as_ints]):
        adv, _ = compute_advantage(estimator, token_level_rewards=r, response_mask=m, index=index)
        torch.testing.assert_close(adv, reference)
    perm = torch.randperm(8)
    shuffled, _ = compute_advantage(
        estimator, token_level_rewards=r[perm], response_mask=m[perm], index=[uids[i] for i in perm]
    )
    torch.testing.assert_close(shuffled, reference[perm])


def test_errors_name_what_is_missing_or_wrong():
    r, m = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'; known: gae, gpg, grpo"):
        compute_advantage("ppo", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="'gae' needs 'values'"):
        compute_advantage("gae", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="'grpo' needs 'index'"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match=r"must both be \(B, T\)"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m[:, :2], index=[0, 0])
    with pytest.raises(ValueError, match=r"values must be \(B, T\)"):
        compute_advantage("gae", token_level_rewards=r, response_mask=m, values=torch.zeros(2))
    with pytest.raises(ValueError, match="index has 3 entries but the batch has 2"):
        compute_advantage("grpo", token_level_rewards=r, response_mask=m, index=[0, 0, 1])


def test_registry_holds_every_documented_estimator():
    assert set(ADV_ESTIMATORS) == {
        "gae",
        "gpg",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "grpo_passk",
        "grpo_process",
        "on_policy_distill",
    }


# ----------------------------------------------------------------------------- on-policy distillation

# Two responses (one prompt, group "a") of 3 tokens; row 1's last token is padding.
#   teacher log-probs  [[-0.5, -1.0, -0.1], [-2.0, -0.3, 9.0]]
#   student log-probs  [[-1.0, -0.4, -0.1], [-0.5, -0.3, 7.0]]
#   log π_T − log π_S  [[+0.5, -0.6,  0.0], [-1.5,  0.0,  --]]   (masked token → 0)
# Outcome rewards (1, 0): GRPO gives ±0.5/0.7071 = ±0.7071 (eps aside), so with α = 0.5 each token
# of row 0 gains +0.35355 and each valid token of row 1 loses 0.35355:
#   [[0.85355, -0.24645, 0.35355], [-1.85355, -0.35355, 0]]
# The batch's reverse KL (distill/reverse_kl) = −(0.5 − 0.6 + 0 − 1.5 + 0)/5 = 0.32.
TEACHER = torch.tensor([[-0.5, -1.0, -0.1], [-2.0, -0.3, 9.0]])
STUDENT = torch.tensor([[-1.0, -0.4, -0.1], [-0.5, -0.3, 7.0]])
DISTILL_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def distill(coef, rewards=(1.0, 0.0)):
    r = torch.zeros(2, 3)
    r[0, 2], r[1, 1] = rewards
    return compute_advantage(
        "on_policy_distill",
        token_level_rewards=r,
        response_mask=DISTILL_MASK,
        index=["a", "a"],
        teacher_log_prob=TEACHER,
        student_log_prob=STUDENT,
        distill_reward_coef=coef,
    )


def test_on_policy_distill_hand_worked():
    adv, ret = distill(0.0)
    # Exact: each entry is one float32 subtraction of the numbers above.
    assert torch.equal(adv, torch.tensor([[0.5, -0.6, 0.0], [-1.5, 0.0, 0.0]]))
    assert torch.equal(adv, ret)
    mixed, _ = distill(0.5)
    g = 0.5 * 0.5 / (0.5**0.5 + EPS)
    expected = torch.tensor([[0.5 + g, -0.6 + g, g], [-1.5 - g, -g, 0.0]])
    # float32 sums of three terms of size ≤ 2: a few ulps of 2.
    torch.testing.assert_close(mixed, expected, rtol=0, atol=4 * 2 * torch.finfo(torch.float32).eps)


def test_on_policy_distill_equal_rewards_add_nothing_and_needs_the_teacher():
    # A group of equal rewards has GRPO advantage 0: the mix leaves the distillation signal alone.
    assert torch.equal(distill(0.5, rewards=(1.0, 1.0))[0], distill(0.0)[0])
    r, m = outcome([1.0, 0.0])
    with pytest.raises(ValueError, match="needs 'teacher_log_prob'"):
        compute_advantage("on_policy_distill", token_level_rewards=r, response_mask=m, student_log_prob=r)
    with pytest.raises(ValueError, match=r"teacher_log_prob must be \(B, T\)"):
        compute_advantage(
            "on_policy_distill",
            token_level_rewards=r,
            response_mask=m,
            teacher_log_prob=r[:, :2],
            student_log_prob=r,
        )


def test_distill_metrics_hand_worked():
    from tearless.trainers.metrics import distill_metrics

    got = distill_metrics(TEACHER, STUDENT, DISTILL_MASK)
    # Sums of 5 float32 numbers of size ≤ 2: tolerance 5 ulps of 2 each.
    tol = 5 * 2 * torch.finfo(torch.float32).eps
    assert got["distill/reverse_kl"] == pytest.approx(0.32, abs=tol)
    assert got["distill/teacher_log_prob"] == pytest.approx(-3.9 / 5, abs=tol)
    assert got["distill/student_log_prob"] == pytest.approx(-2.3 / 5, abs=tol)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_whitened_estimators_need_two_valid_tokens(estimator):
    r, m = outcome([1.0], width=1)
    with pytest.raises(ValueError, match="at least 2 valid"):
        compute_advantage(estimator, token_level_rewards=r, response_mask=m, values=r, index=[0])


# ----------------------------------------------------------------------------- step-level rewards

# Two responses to one prompt, 5 tokens each. Row 0 has steps ending at t = 1 (reward 1) and t = 3
# (reward 0), and a trailing token t = 4 after its last step; row 1 has steps ending at t = 0, 2, 4
# (rewards 1, 1, 1). Step rewards elsewhere in the rows are 0.
STEP_R = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0, 1.0]])
STEP_M = torch.tensor([[0, 1, 0, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)


def test_grpo_process_hand_worked():
    # The group's step rewards {1, 0, 1, 1, 1}: mean 0.8, unbiased std sqrt((4·0.04 + 0.64)/4) = sqrt(0.2).
    # Normalised: 1 → 0.2/sqrt(0.2) = sqrt(0.2) = 0.447214, 0 → −0.8/sqrt(0.2) = −4·sqrt(0.2) = −1.788854.
    # A token's advantage sums the normalised rewards of the steps ending at or after it:
    # row 0: t0, t1: s − 4s = −3s; t2, t3: −4s; t4: 0.   row 1: t0: 3s, t1, t2: 2s, t3, t4: s.
    adv, ret = compute_advantage(
        "grpo_process",
        token_level_rewards=STEP_R,
        response_mask=torch.ones(2, 5),
        index=["a", "a"],
        step_mask=STEP_M,
        epsilon=0.0,
    )
    s = math.sqrt(0.2)
    want = torch.tensor([[-3 * s, -3 * s, -4 * s, -4 * s, 0.0], [3 * s, 2 * s, 2 * s, s, s]])
    torch.testing.assert_close(adv, want)
    assert torch.equal(ret, adv)
    # Without the std: centred rewards 0.2 and −0.8, summed the same way.
    adv, _ = compute_advantage(
        "grpo_process",
        token_level_rewards=STEP_R,
        response_mask=torch.ones(2, 5),
        index=["a", "a"],
        step_mask=STEP_M,
        norm_adv_by_std_in_grpo=False,
    )
    torch.testing.assert_close(adv, torch.tensor([[-0.6, -0.6, -0.8, -0.8, 0.0], [0.6, 0.4, 0.4, 0.2, 0.2]]))


def test_grpo_process_groups_by_id_and_equal_step_rewards_give_zero():
    r = torch.cat([STEP_R, torch.full((2, 5), 0.1)])
    m = torch.cat([STEP_M, STEP_M])
    mask = torch.ones(4, 5)
    mask[3, 3:] = 0  # a shorter row: its step at t = 4 is padding and does not count
    adv, _ = compute_advantage(
        "grpo_process", token_level_rewards=r, response_mask=mask, index=[0, 0, 1, 1], step_mask=m
    )
    assert (adv[2:] == 0).all()  # 0.1 everywhere: exactly 0, not 1e-17
    alone, _ = compute_advantage(
        "grpo_process",
        token_level_rewards=STEP_R,
        response_mask=torch.ones(2, 5),
        index=[0, 0],
        step_mask=STEP_M,
    )
    torch.testing.assert_close(adv[:2], alone)
    with pytest.raises(ValueError, match="'grpo_process' needs 'step_mask'"):
        compute_advantage("grpo_process", token_level_rewards=r, response_mask=mask, index=[0, 0, 1, 1])


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_gae_and_reinforce_pp_credit_every_reward_position(gamma):
    # Step rewards at several positions of one row: 1 at t = 1 and 2 at t = 3 (5 tokens, the last one
    # masked). With V ≡ 0 and λ = 1, GAE's raw advantage is the discounted return G_t = Σ_{k≥t} γ^(k−t) r_k:
    # γ = 1: (3, 3, 2, 2, 0); γ = 0.5: G_3 = 2, G_2 = 0.5·2 = 1, G_1 = 1 + 0.5·1 = 1.5, G_0 = 0.75.
    r = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0]])
    m = torch.tensor([[1, 1, 1, 1, 0]])
    want = {1.0: [3.0, 3.0, 2.0, 2.0, 0.0], 0.5: [0.75, 1.5, 1.0, 2.0, 0.0]}[gamma]
    _, gae_returns = compute_advantage(
        "gae", token_level_rewards=r, response_mask=m, values=torch.zeros(1, 5), gamma=gamma, lam=1.0
    )
    _, rpp_returns = compute_advantage(
        "reinforce_plus_plus", token_level_rewards=r, response_mask=m, gamma=gamma
    )
    assert gae_returns[0].tolist() == want
    assert rpp_returns[0].tolist() == want
