"""Properties over random shapes and masks (hypothesis), and autograd checks of the clipping rules."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tearless.algos import (
    ADV_ESTIMATORS,
    AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    compute_advantage,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
)
from tearless.algos.losses import FIXED_AGG_MODES
from tests.tolerances import sum_tol

PROPERTY = settings(max_examples=50, deadline=None)
GARBAGE = (float("nan"), float("inf"), -1e30)


@st.composite
def batches(draw, min_valid=2, even_rows=False):
    """(generator, mask): a random (B, T) bool mask with at least `min_valid` valid tokens."""
    rows = draw(st.integers(1, 4)) * (2 if even_rows else 1)
    cols = draw(st.integers(1, 6))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mask = torch.rand(rows, cols, generator=gen) < draw(st.floats(0.1, 0.9))
    if rows * cols < min_valid:  # a 1×1 batch cannot hold two tokens: widen it
        mask = torch.zeros(rows, min_valid, dtype=torch.bool)
    mask.view(-1)[:min_valid] = True
    return gen, mask


def randn(gen, mask, scale=1.0):
    return torch.randn(mask.shape, generator=gen, dtype=torch.float64) * scale


def fill(x, mask, value):
    return torch.where(mask, x, torch.as_tensor(value, dtype=x.dtype))


# ----------------------------------------------------------------------------- masked statistics


@PROPERTY
@given(batches())
def test_masked_stats_ignore_garbage(batch):
    gen, mask = batch
    x = randn(gen, mask)
    clean = [masked_sum(x, mask), masked_mean(x, mask), masked_mean(x, mask, dim=-1), masked_var(x, mask)]
    clean.append(masked_whiten(x, mask))
    assert all(torch.isfinite(c).all() for c in clean)
    assert clean[-1].shape == x.shape
    for value in GARBAGE:
        dirty = fill(x, mask, value)
        got = [masked_sum(dirty, mask), masked_mean(dirty, mask), masked_mean(dirty, mask, dim=-1)]
        got += [masked_var(dirty, mask), masked_whiten(dirty, mask)]
        # Exactly: masked entries are replaced by 0 (torch.where) before any arithmetic, so the same
        # kernels then run on identical tensors.
        for a, b in zip(got, clean, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ----------------------------------------------------------------------------- advantages


def estimator_inputs(gen, mask):
    rows = mask.shape[0]
    # `rows` is even: groups of two, interleaved so that a group's rows are not adjacent (pass@k needs two).
    index = [f"uid-{i % (rows // 2)}" for i in range(rows)]
    return {
        "token_level_rewards": randn(gen, mask),
        "response_mask": mask,
        "index": index,
        "values": randn(gen, mask),
        "reward_baselines": torch.randn(rows, generator=gen, dtype=torch.float64),
        "step_mask": torch.rand(mask.shape, generator=gen) < 0.3,
        "teacher_log_prob": -torch.rand(mask.shape, generator=gen, dtype=torch.float64),
        "student_log_prob": -torch.rand(mask.shape, generator=gen, dtype=torch.float64),
        "distill_reward_coef": 0.5,
        "gamma": 0.9,
        "lam": 0.95,
    }


# Whitening needs an unbiased variance, so these raise (by design) with a single valid token in the batch.
WHITENED = {"gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"}


@pytest.mark.parametrize("estimator", sorted(ADV_ESTIMATORS))
@PROPERTY
@given(data=st.data())
def test_estimators_finite_shaped_masked_and_blind_to_garbage(estimator, data):
    gen, mask = data.draw(batches(min_valid=2 if estimator in WHITENED else 1, even_rows=True))
    inputs = estimator_inputs(gen, mask)
    adv, ret = compute_advantage(estimator, **inputs)
    for out in (adv, ret):
        assert out.shape == mask.shape
        assert torch.isfinite(out).all()
        assert (out[~mask] == 0).all()
    for value in GARBAGE:
        dirty = dict(inputs)
        dirty["token_level_rewards"] = fill(inputs["token_level_rewards"], mask, value)
        dirty["values"] = fill(inputs["values"], mask, value)
        dirty_adv, dirty_ret = compute_advantage(estimator, **dirty)
        # Exactly, as above: garbage is zeroed before any arithmetic.
        torch.testing.assert_close(dirty_adv, adv, rtol=0, atol=0)
        torch.testing.assert_close(dirty_ret, ret, rtol=0, atol=0)


@PROPERTY
@given(batch=batches(even_rows=True), groups=st.integers(1, 4))
def test_grpo_group_sums_are_zero_and_rows_follow_their_ids(batch, groups):
    gen, mask = batch
    mask[:, 0] = True  # a row with no valid token still counts in its group but shows no advantage
    rows = mask.shape[0]
    rewards = randn(gen, mask)
    ids = torch.randint(0, groups, (rows,), generator=gen)
    adv, _ = compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask, index=ids)
    per_row = masked_sum(adv, mask, dim=-1) / mask.sum(-1).clamp(min=1)
    for g in ids.unique():
        members = ids == g
        if int(members.sum()) > 1:
            assert abs(per_row[members].sum().item()) < 1e-9
    perm = torch.randperm(rows, generator=gen)
    shuffled, _ = compute_advantage(
        "grpo",
        token_level_rewards=rewards[perm],
        response_mask=mask[perm],
        index=[str(int(i)) for i in ids[perm]],
    )
    torch.testing.assert_close(shuffled, adv[perm])


# ----------------------------------------------------------------------------- aggregation and policy losses


@pytest.mark.parametrize("mode", sorted(AGG_MODES))
@PROPERTY
@given(batch=batches(min_valid=1), split=st.floats(0.0, 1.0))
def test_agg_micro_batches_reproduce_the_mini_batch(mode, batch, split):
    gen, mask = batch
    loss_mat = randn(gen, mask).requires_grad_()
    full = agg_loss(loss_mat, mask, mode)
    (full_grad,) = torch.autograd.grad(full, loss_mat)
    cut = round(split * mask.shape[0])
    norms = {"global_num_tokens": mask.sum(), "global_num_seqs": mask.any(-1).sum()}
    parts = [
        agg_loss(loss_mat[rows], mask[rows], mode, **norms) for rows in (slice(0, cut), slice(cut, None))
    ]
    total = parts[0] + parts[1]
    (parts_grad,) = torch.autograd.grad(total, loss_mat)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(parts_grad, full_grad)
    for value in GARBAGE:  # exactly: masked entries are zeroed before the sum
        torch.testing.assert_close(agg_loss(fill(loss_mat, mask, value), mask, mode), full, rtol=0, atol=0)


def run_policy_loss(mode, agg_mode, old, logp, adv, mask):
    log_prob = logp.clone().requires_grad_()
    loss, metrics = policy_loss(
        mode,
        old_log_prob=old,
        log_prob=log_prob,
        advantages=adv,
        response_mask=mask,
        loss_agg_mode=agg_mode,
        clip_cov_ratio=0.3,
        kl_cov_ratio=0.3,
        dro_beta=0.5,
        generator=torch.Generator().manual_seed(0),
    )
    loss.backward()
    return loss, metrics, log_prob.grad


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
@PROPERTY
@given(batch=batches(min_valid=1))
def test_policy_losses_finite_and_blind_to_garbage(mode, batch):
    gen, mask = batch
    logp = -randn(gen, mask).abs()
    old = logp + 0.3 * randn(gen, mask)
    adv = randn(gen, mask)
    # A mode with its own aggregation takes only that one (None or its name).
    agg_modes = [None, FIXED_AGG_MODES[mode]] if mode in FIXED_AGG_MODES else list(AGG_MODES)
    for agg_mode in agg_modes:
        loss, metrics, grad = run_policy_loss(mode, agg_mode, old, logp, adv, mask)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert all(torch.isfinite(v) for v in metrics.values())
        assert (grad[~mask] == 0).all()
        for value in GARBAGE:
            dirty = [fill(x, mask, value) for x in (old, logp, adv)]
            d_loss, d_metrics, d_grad = run_policy_loss(mode, agg_mode, *dirty, mask)
            # Exactly: garbage is zeroed before any arithmetic (and the seeded generator is reset).
            assert torch.equal(d_loss, loss) and torch.equal(d_grad, grad)
            assert d_metrics.keys() == metrics.keys()
            assert all(torch.equal(d_metrics[k], metrics[k]) for k in metrics)


def test_policy_loss_micro_batches_with_global_counts_match_the_mini_batch():
    torch.manual_seed(3)
    mask = torch.rand(6, 5) > 0.3
    old, adv = torch.randn(6, 5) - 1, torch.randn(6, 5)
    logp = (old + 0.3 * torch.randn(6, 5)).requires_grad_()
    norms = {"global_num_tokens": mask.sum(), "global_num_seqs": mask.any(-1).sum()}
    for agg_mode in AGG_MODES:
        args = {"loss_agg_mode": agg_mode, "clip_ratio_c": 2.0}
        full, _ = policy_loss(
            "vanilla", old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, **args
        )
        (full_grad,) = torch.autograd.grad(full, logp)
        total = sum(
            policy_loss(
                "vanilla",
                old_log_prob=old[r],
                log_prob=logp[r],
                advantages=adv[r],
                response_mask=mask[r],
                **args,
                **norms,
            )[0]
            for r in (slice(0, 1), slice(1, 4), slice(4, 6))
        )
        (total_grad,) = torch.autograd.grad(total, logp)
        # The same per-token terms, summed in three parts: a float32 sum of 30 terms, each a loss
        # |A|·ratio capped at c·|A| = 2|A| (weighted by at most 1 in every mode). Per-token gradients
        # only differ in their normaliser's rounding: assert_close's float32 default covers them.
        terms = 2 * float((adv.abs() * mask).sum())
        torch.testing.assert_close(total, full, atol=sum_tol(mask.numel(), terms), rtol=0)
        torch.testing.assert_close(total_grad, full_grad)


# ----------------------------------------------------------------------------- clipping rules (autograd)


@PROPERTY
@given(batch=batches(min_valid=1))
def test_clipped_tokens_get_exactly_zero_gradient_and_dual_clip_bounds_the_loss(batch):
    gen, mask = batch
    old = -randn(gen, mask).abs()
    logp = old + randn(gen, mask, scale=2.0)  # ratios mostly in e^±4: many clipped and dual-clipped tokens
    adv = randn(gen, mask)
    c = 3.0
    log_prob = logp.clone().requires_grad_()
    inputs = {"old_log_prob": old, "advantages": adv, "response_mask": mask}
    loss, _ = policy_loss("vanilla", log_prob=log_prob, loss_agg_mode="token-sum", clip_ratio_c=c, **inputs)
    loss.backward()
    ratio = (logp - old).exp()
    clipped = ((adv > 0) & (ratio > 1.2)) | ((adv < 0) & (ratio < 0.8))
    dual = (adv < 0) & (ratio > c)
    assert (log_prob.grad[mask & (clipped | dual)] == 0).all()
    free = mask & ~clipped & ~dual
    torch.testing.assert_close(log_prob.grad[free], (-adv * ratio)[free])
    per_token, _ = POLICY_LOSSES["vanilla"](log_prob=logp, clip_ratio_c=c, **inputs)
    negative = mask & (adv < 0)
    assert (per_token[negative] <= c * adv.abs()[negative]).all()
