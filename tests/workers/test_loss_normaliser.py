"""seq-mean-token-sum-norm (Dr. GRPO) divides by a constant S = max_response_length, so a step whose
longest response is short updates the policy exactly as one padded to the cap would."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tearless.workers.schedule import UpdateSettings, mini_batch_norm, plan_updates
from tests.workers.test_actor import assert_same_gradient, build_batch, metric_rel, update_terms

EXTRA = 5  # masked padding columns appended to every response


def padded(td: TensorDict, extra: int) -> TensorDict:
    """``td`` with ``extra`` masked columns after every response (as if another response of the step
    had been ``extra`` tokens longer)."""
    out = td.clone()
    for key in (
        "response_ids",
        "response_mask",
        "old_log_prob",
        "ref_log_prob",
        "advantages",
        "rollout_entropy",
    ):
        value = td[key]
        out.set(key, torch.cat([value, torch.zeros(value.shape[0], extra, dtype=value.dtype)], dim=1))
    return TensorDict(dict(out.items()), batch_size=td.batch_size)


@pytest.fixture(scope="module")
def batches(task):
    model, td = build_batch(task.model_dir)
    return model, td, padded(td, EXTRA)


def test_the_normaliser_does_not_depend_on_how_wide_the_batch_is_padded(batches, updated):
    model, narrow, wide = batches
    width = narrow["response_mask"].shape[1]
    common = dict(ppo_mini_batch_size=8, loss_agg_mode="seq-mean-token-sum-norm", lr=0.0)
    # S = 16, the response cap: both layouts get the same normaliser and the same gradient.
    _, g_narrow, m_narrow = updated(model, narrow, loss_scale_factor=16, **common)
    _, g_wide, m_wide = updated(model, wide, loss_scale_factor=16, **common)
    terms, rel = update_terms(model, narrow), metric_rel(model, narrow)
    for a, b in zip(g_narrow, g_wide, strict=True):
        assert_same_gradient(b, a, terms)
    assert m_wide["actor/grad_norm"] == pytest.approx(m_narrow["actor/grad_norm"], rel=rel)
    # The padded width as S (the old normaliser) scales every term by width / (width + 5).
    _, _, old_narrow = updated(model, narrow, loss_scale_factor=width, **common)
    _, _, old_wide = updated(model, wide, loss_scale_factor=width + EXTRA, **common)
    ratio = old_wide["actor/grad_norm"] / old_narrow["actor/grad_norm"]
    assert ratio == pytest.approx(width / (width + EXTRA), rel=rel)
    assert old_narrow["actor/grad_norm"] == pytest.approx(m_narrow["actor/grad_norm"] * 16 / width, rel=rel)


def test_the_sharded_schedule_carries_the_same_constant(batches):
    _, narrow, wide = batches
    for td in (narrow, wide):
        settings = UpdateSettings(
            rows_per_mini=16, epochs=1, shuffle=False, micro_size=None, token_budget=None, grad_clip=1.0,
            prefix="actor", loss_scale_factor=16,
        )  # fmt: skip
        plans = plan_updates(td, settings, 2)
        assert [p.norm["loss_scale_factor"] for p in plans] == [16.0, 16.0]
        assert mini_batch_norm(td["response_mask"], 16)["loss_scale_factor"] == 16.0
    assert mini_batch_norm(wide["response_mask"])["loss_scale_factor"] == wide["response_mask"].shape[1]
