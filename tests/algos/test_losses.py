import math

import pytest
import torch

from tearless.algos import POLICY_LOSSES, entropy_from_logits, logprobs_from_logits, policy_loss, value_loss

# Vanilla PPO example, one row of 4 tokens, old log-probs 0 so ρ = exp(logπ); ε = 0.2, c = 3.
#   token  ρ    A    L1 = −Aρ   L2 = −A·clip(ρ)   max      dual (A<0): min(·, 3)
#   0      1.5  +1   −1.5       −1.2              −1.2     –          (clipped)
#   1      0.5  −1   +0.5       +0.8              +0.8     0.8        (clipped)
#   2      1.1  +1   −1.1       −1.1              −1.1     –
#   3      5.0  −1   +5.0       +1.2              +5.0     3.0        (dual clip)
# token-mean = (−1.2 + 0.8 − 1.1 + 3) / 4 = 0.375
RATIOS = torch.tensor([[1.5, 0.5, 1.1, 5.0]])
ADV = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
MASK = torch.ones(1, 4)


def vanilla(**kwargs):
    log_prob = RATIOS.log().requires_grad_()
    loss, metrics = policy_loss(
        "vanilla",
        old_log_prob=torch.zeros(1, 4),
        log_prob=log_prob,
        advantages=ADV,
        response_mask=MASK,
        **kwargs,
    )
    loss.backward()
    return loss, metrics, log_prob.grad


def test_vanilla_hand_worked():
    loss, metrics, grad = vanilla()
    assert loss.item() == pytest.approx(0.375)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.5)  # tokens 0 and 1
    assert metrics["pg_clipfrac_lower"].item() == pytest.approx(0.25)  # token 3
    assert metrics["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in (1.5, 0.5, 1.1, 5.0)) / 4)
    # Only token 2 is unclipped: d(−Aρ)/dlogπ = −Aρ = −1.1, over 4 tokens.
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1.1 / 4, 0.0]]))
    assert all(not v.requires_grad and v.dim() == 0 for v in metrics.values())


def test_vanilla_asymmetric_clip():
    # clip_ratio_high = 0.6: token 0 (ρ = 1.5 < 1.6) is no longer clipped: −1.5 instead of −1.2.
    loss, metrics, _ = vanilla(clip_ratio_high=0.6)
    assert loss.item() == pytest.approx((-1.5 + 0.8 - 1.1 + 3) / 4)
    assert metrics["pg_clipfrac"].item() == pytest.approx(0.25)


def test_vanilla_rejects_dual_clip_at_or_below_one():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        vanilla(clip_ratio_c=1.0)


def test_gspo_hand_worked():
    # Sequence log-ratio s = (log 1.2 + log 0.8) / 2 → ρ = sqrt(0.96) = 0.9798 for both tokens, inside
    # [0.8, 1.2]; loss per token −Aρ; seq-mean-token-mean gives −0.9798 and a gradient of −ρ/2 per token.
    log_prob = torch.tensor([[math.log(1.2), math.log(0.8)]], requires_grad=True)
    inputs = {
        "old_log_prob": torch.zeros(1, 2),
        "advantages": torch.ones(1, 2),
        "response_mask": torch.ones(1, 2),
    }
    loss, metrics = policy_loss("gspo", log_prob=log_prob, **inputs)
    loss.backward()
    rho = math.sqrt(0.96)
    assert loss.item() == pytest.approx(-rho)
    torch.testing.assert_close(log_prob.grad, torch.full((1, 2), -rho / 2))
    assert metrics["pg_clipfrac"].item() == 0.0
    # One row: token-mean and seq-mean-token-mean agree (−ρ); token-sum is twice that.
    summed, _ = policy_loss("gspo", log_prob=log_prob, loss_agg_mode="token-sum", **inputs)
    assert summed.item() == pytest.approx(-2 * rho)


def verl_091_gspo(old_log_prob, log_prob, advantages, mask, agg, low=0.2, high=0.2):
    """veRL 0.9.1's ``compute_policy_loss_gspo`` followed by its ``agg_loss`` (dp_size 1, no global
    counts), written out from the formulas: s_i = Σ_t Δ m / max(1, |y_i|); ρ = exp(min(sg[s_i] + logπ −
    sg[logπ], 10)); L = max(−Aρ, −A clip(ρ, 1 − low, 1 + high)); then the mode's reduction."""
    m = mask.float()
    lengths = m.sum(-1).clamp(min=1)
    s = ((log_prob - old_log_prob) * m).sum(-1) / lengths
    ratio = torch.exp(torch.clamp(log_prob - log_prob.detach() + s.detach()[:, None], max=10.0))
    loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - low, 1 + high))
    per_row_sum = (loss * m).sum(-1)
    rows = (m.sum(-1) > 0).float()
    if agg == "token-mean":
        return (loss * m).sum() / m.sum()
    if agg == "token-sum":
        return (loss * m).sum()
    if agg in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        out = (per_row_sum * rows).sum() / rows.sum()
        return out / mask.shape[-1] if agg == "seq-mean-token-sum-norm" else out
    if agg == "seq-mean-token-mean":
        return (per_row_sum / (m.sum(-1) + 1e-8) * rows).sum() / rows.sum()
    raise AssertionError(agg)


# veRL 0.9.1 aggregates GSPO with actor.loss_agg_mode, whose default is token-mean (its config's null is
# tearless's None). Random rows of different lengths, one of them empty, ratios both inside and outside
# the clip range, advantages of both signs.
@pytest.mark.parametrize(
    ("agg", "verl_agg"),
    [(None, "token-mean"), ("token-mean", "token-mean"), ("token-sum", "token-sum"),
     ("seq-mean-token-sum", "seq-mean-token-sum"), ("seq-mean-token-mean", "seq-mean-token-mean"),
     ("seq-mean-token-sum-norm", "seq-mean-token-sum-norm")],
)  # fmt: skip
def test_gspo_equals_verl_091_for_every_loss_agg_mode(agg, verl_agg):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    log_prob = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).contiguous()
    lengths = torch.tensor([7, 5, 1, 3, 0, 6])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    ours_lp = log_prob.clone().requires_grad_()
    ours, metrics = policy_loss(
        "gspo", old_log_prob=old, log_prob=ours_lp, advantages=adv, response_mask=mask, loss_agg_mode=agg
    )
    ours.backward()
    ref_lp = log_prob.clone().requires_grad_()
    ref = verl_091_gspo(old, ref_lp, adv, mask, verl_agg)
    ref.backward()
    # float64 sums of ≤ 42 terms of size ≤ ~5: agreement to 1e-12 is rounding, not luck.
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours_lp.grad, ref_lp.grad * mask, rtol=1e-12, atol=1e-12)
    assert 0.0 < metrics["pg_clipfrac"].item() < 1.0  # both branches are exercised
    if agg is not None and agg != "seq-mean-token-mean":
        # The modes really differ on these rows: the table is not one number five times.
        other = verl_091_gspo(old, log_prob, adv, mask, "seq-mean-token-mean")
        assert abs(ours.item() - other.item()) > 1e-3


def test_gspo_clips_whole_sequences():
    # mean log-ratio log 1.5 > log 1.2 with A > 0: every token is clipped and gets no gradient.
    log_prob = torch.full((1, 3), math.log(1.5), requires_grad=True)
    loss, metrics = policy_loss(
        "gspo", old_log_prob=torch.zeros(1, 3), log_prob=log_prob, advantages=torch.ones(1, 3),
        response_mask=torch.ones(1, 3),
    )  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx(-1.2)
    assert metrics["pg_clipfrac"].item() == 1.0
    assert (log_prob.grad == 0).all()


def test_cispo_hand_worked():
    # ρ = (2.0, 0.9) → weights clip(ρ, 0.8, 1.2) = (1.2, 0.9); A = 1.
    # loss = −w·A·logπ = (−1.2·log 2, −0.9·log 0.9) = (−0.831777, 0.094825); token-mean −0.368476.
    # Gradient (through logπ only): −w·A / 2 = (−0.6, −0.45): the clipped token still learns.
    log_prob = torch.tensor([[math.log(2.0), math.log(0.9)]], requires_grad=True)
    loss, metrics = policy_loss(
        "cispo", old_log_prob=torch.zeros(1, 2), log_prob=log_prob, advantages=torch.ones(1, 2),
        response_mask=torch.ones(1, 2),
    )  # fmt: skip
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 * math.log(2.0) - 0.9 * math.log(0.9)) / 2)
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-0.6, -0.45]]))
    assert metrics["pg_clipfrac"].item() == 0.5


# Covariance example: A = (3, −1, −1, −1) has mean 0, logπ = (−1, −3, −3, −3) has mean −2.5, so
# (A − Ā)(logπ − mean) = (3·1.5, −1·−0.5, …) = (4.5, 0.5, 0.5, 0.5): only token 0 lies in (1, 5) and is top-1.
COV_LOGP = torch.tensor([[-1.0, -3.0, -3.0, -3.0]])
COV_ADV = torch.tensor([[3.0, -1.0, -1.0, -1.0]])


def test_clip_cov_drops_the_high_covariance_token():
    # ρ = 1 everywhere, so no PPO clipping; token 0 is dropped: loss = (0 + 1 + 1 + 1) / 4.
    log_prob = COV_LOGP.clone().requires_grad_()
    loss, metrics = policy_loss(
        "clip_cov",
        old_log_prob=COV_LOGP,
        log_prob=log_prob,
        advantages=COV_ADV,
        response_mask=torch.ones(1, 4),
    )
    loss.backward()
    assert loss.item() == pytest.approx(0.75)
    assert metrics["pg_clipfrac"].item() == 0.25
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.25, 0.25, 0.25]]))


def test_clip_cov_random_choice_is_reproducible_with_a_generator():
    # Four eligible tokens (cov 4.5 each), budget 1: which one is dropped depends only on the generator.
    logp = torch.tensor([[-1.0, -1.0, -4.0, -4.0]])  # mean −2.5
    adv = torch.tensor([[3.0, 3.0, -3.0, -3.0]])  # cov = (3·1.5, 3·1.5, −3·−1.5, −3·−1.5): all 4.5
    choices = set()
    for seed in range(8):
        losses = [
            policy_loss(
                "clip_cov", old_log_prob=logp, log_prob=logp, advantages=adv, response_mask=torch.ones(1, 4),
                loss_agg_mode="token-sum", generator=torch.Generator().manual_seed(seed),
            )[0].item()
            for _ in range(2)
        ]  # fmt: skip
        assert losses[0] == losses[1]
        choices.add(losses[0])
    assert len(choices) == 2  # dropping a +A token (loss 3) or a −A token (loss −3), seed-dependent


def test_kl_cov_penalises_the_top_covariance_token():
    # Δ = (0.1, 0, 0, 0): token 0 (top covariance 4.5) gets −3·e^0.1 + β·0.1; the others −Aρ = 1.
    # β = ppo_kl_coef defaults to veRL's 0.1 and is settable.
    old = COV_LOGP - torch.tensor([[0.1, 0.0, 0.0, 0.0]])
    args = {
        "old_log_prob": old,
        "log_prob": COV_LOGP,
        "advantages": COV_ADV,
        "response_mask": torch.ones(1, 4),
    }
    loss, metrics = policy_loss("kl_cov", **args)
    assert loss.item() == pytest.approx((-3 * math.exp(0.1) + 0.1 * 0.1 + 3) / 4)
    stronger, _ = policy_loss("kl_cov", ppo_kl_coef=2.0, **args)
    assert stronger.item() == pytest.approx((-3 * math.exp(0.1) + 2.0 * 0.1 + 3) / 4)
    assert metrics["ppo_kl_abs"].item() == pytest.approx(0.1 / 4)
    assert metrics["pg_clipfrac"].item() == 0.0


def test_policy_loss_argument_errors():
    args = {
        "old_log_prob": torch.zeros(1, 4),
        "log_prob": torch.zeros(1, 4),
        "advantages": ADV,
        "response_mask": MASK,
    }
    with pytest.raises(ValueError, match="unknown policy loss mode 'ppo'; known: cispo, clip_cov"):
        policy_loss("ppo", **args)
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        policy_loss("gspo", loss_agg_mode="mean", **args)
    with pytest.raises(TypeError, match="clip_cov_ration"):
        policy_loss("clip_cov", clip_cov_ration=0.1, **args)
    # A knob of another mode is accepted and ignored, so a trainer can pass its whole config.
    policy_loss("vanilla", kl_cov_ratio=0.5, **args)


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
def test_every_mode_reports_the_common_metrics_and_survives_an_empty_mask(mode):
    log_prob = torch.randn(2, 3, requires_grad=True)
    loss, metrics = policy_loss(
        mode, old_log_prob=torch.randn(2, 3), log_prob=log_prob, advantages=torch.randn(2, 3),
        response_mask=torch.zeros(2, 3), dro_beta=0.1,
    )  # fmt: skip
    assert {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} <= set(metrics)
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in metrics.values())
    loss.backward()
    assert (log_prob.grad == 0).all()


def test_value_loss_hand_worked():
    # v = (1, 2), V_old = (0.5, 2), G = (1.2, 1), c = 0.2 → v_clip = (0.7, 2).
    # (v − G)² = (0.04, 1); (v_clip − G)² = (0.25, 1); max = (0.25, 1); ½·mean = 0.3125.
    vpreds = torch.tensor([[1.0, 2.0, 7.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(
        vpreds, torch.tensor([[0.5, 2.0, 0.0]]), torch.tensor([[1.2, 1.0, 0.0]]), mask, cliprange_value=0.2
    )
    assert loss.item() == pytest.approx(0.3125)
    assert metrics["vf_clipfrac"].item() == 0.5
    assert metrics["vpred_mean"].item() == 1.5
    loss.backward()
    # Token 0: the clipped branch wins, no gradient. Token 1: ½·2·(2 − 1)/2 = 0.5.
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.5, 0.0]]))
    summed, _ = value_loss(vpreds, torch.zeros(1, 3), torch.zeros(1, 3), mask, 10.0, "token-sum")
    assert summed.item() == pytest.approx(0.5 * (1 + 4))


def test_entropy_hand_worked():
    # Uniform over 2 → log 2. p = (1/4, 3/4) → −(¼ log ¼ + ¾ log ¾) = 0.562335.
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(2.0), 0.562335]))


def test_entropy_is_stable_for_huge_logits():
    # Naively, logsumexp(z) − Σ p·z cancels two numbers of size 1e6 and loses every digit of float32.
    # Offsets are multiples of 2 so the inputs are exact in float32 (its spacing near 1e6 is 1/16).
    logits = torch.tensor([[1e6, 1e6], [1e4, 0.0], [-1e6, -1e6 + 2.0]])
    p = 1 / (1 + math.exp(2.0))  # softmax(0, 2)
    h = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([math.log(2.0), 0.0, h]))


def test_entropy_chunked_equals_unchunked_and_upcasts_16_bit():
    torch.manual_seed(0)
    logits = torch.randn(4, 5, 7) * 3
    full = entropy_from_logits(logits)
    assert full.shape == (4, 5)
    for chunk in (1, 3, 20):
        torch.testing.assert_close(entropy_from_logits(logits, chunk_size=chunk), full)
    assert entropy_from_logits(logits.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)


def test_logprobs_from_logits():
    # p = (1/4, 3/4): label 1 → log ¾.
    logits = torch.tensor([[0.0, math.log(3.0)]])
    assert logprobs_from_logits(logits, torch.tensor([1])).item() == pytest.approx(math.log(0.75))
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 11) * 5
    labels = torch.randint(0, 11, (3, 4))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)


def test_value_loss_dr_grpo_mode_is_a_mean_over_responses():
    # 4 responses × 5 tokens with (v − G)² = 2 everywhere: ½ · Σ 2 / (4 responses · S = 5) = 1, like
    # token-mean; dividing by S alone gave 4.
    ones = torch.ones(4, 5)
    args = (torch.zeros(4, 5), torch.zeros(4, 5), ones * math.sqrt(2), ones, 10.0)
    loss, _ = value_loss(*args, "seq-mean-token-sum-norm")
    assert loss.item() == pytest.approx(1.0)
    assert value_loss(*args, "seq-mean-token-sum-norm", loss_scale_factor=10)[0].item() == pytest.approx(0.5)
