"""Rollout/trainer mismatch metrics and truncated importance sampling."""

from __future__ import annotations

import math

import pytest
import torch

from tearless.algos import policy_loss
from tearless.rollout.correction import rollout_correction
from tearless.rollout.seeds import prompt_keys
from tests.tolerances import logprob_tol, sum_tol


def test_hand_computed_token_and_sequence_weights():
    # Row 0: Δ = old − rollout = [ln 3, ln 0.5, (masked)]; row 1: Δ = [0, (masked), (masked)].
    old = torch.tensor([[math.log(0.3), math.log(0.2), 5.0], [math.log(0.4), 7.0, 7.0]])
    rollout = torch.tensor([[math.log(0.1), math.log(0.4), -5.0], [math.log(0.4), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    w, m = rollout_correction(old, rollout, mask, level="token", threshold=2.0)
    # token ratios 3, 0.5, 1 → truncated at C = 2: 2, 0.5, 1; one of three tokens clipped
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 0.0], [1.0, 0.0, 0.0]]))
    assert m["rollout_corr/is_clip_frac"] == pytest.approx(1 / 3)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(3.5 / 3)
    # k1 = mean(−Δ) = −(ln 3 + ln 0.5 + 0)/3 ; k3 = mean(e^Δ − 1 − Δ)
    assert m["rollout_corr/kl"] == pytest.approx(-(math.log(3) + math.log(0.5)) / 3)
    k3 = (3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5)) + 0.0
    assert m["rollout_corr/k3_kl"] == pytest.approx(k3 / 3)
    assert m["rollout_corr/max_abs_log_ratio"] == pytest.approx(math.log(3))
    w, _ = rollout_correction(old, rollout, mask, level="sequence", threshold=2.0)
    # sequence ratio of row 0 = 3 × 0.5 = 1.5 (under C), row 1 = 1
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 0.0], [1.0, 0.0, 0.0]]))
    none, metrics = rollout_correction(old, rollout, mask)
    assert none is None and "rollout_corr/is_weight_mean" not in metrics


def test_k3_of_engines_that_agree_to_rounding_is_their_half_square_not_negative():
    # Log-probs one float32 ulp apart, as the built-in engine's decode and the trainer's forward give:
    # k3 = mean(e^Δ − 1 − Δ) ≈ mean(Δ²)/2 ≈ 1e-15. In float32, e^Δ − 1 − Δ is rounding noise of
    # order 1e-7 and came out negative (−1.4e-9 in a logged run).
    old = torch.full((4, 8), -2.0).float()
    rollout = torch.nextafter(old, torch.tensor(-3.0))
    delta = (old.double() - rollout.double())[0, 0].item()
    assert 0 < delta < 1e-6
    _, m = rollout_correction(old, rollout, torch.ones(4, 8))
    assert m["rollout_corr/k3_kl"] == pytest.approx(delta**2 / 2, rel=1e-6)
    _, m = rollout_correction(rollout, old, torch.ones(4, 8))
    assert m["rollout_corr/k3_kl"] == pytest.approx(delta**2 / 2, rel=1e-6)


def test_weights_multiply_each_tokens_policy_loss():
    torch.manual_seed(0)
    lp = torch.randn(2, 4, requires_grad=True)
    old, adv = lp.detach() + 0.1 * torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    weights = torch.tensor([[2.0, 0.5, 1.0, 9.0], [0.0, 1.5, 9.0, 9.0]])
    common = dict(
        old_log_prob=old, log_prob=lp, advantages=adv, response_mask=mask, loss_agg_mode="token-sum"
    )
    weighted, _ = policy_loss("vanilla", rollout_is_weights=weights, **common)
    ratio = (lp - old).exp()
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
    terms = (per_token * weights * mask).detach()
    # The same 8 terms (each a few rounded operations: safety 2), multiplied and summed in another
    # order: the bound is relative to their absolute sum, not to the (cancelling) result.
    assert float(weighted.detach()) == pytest.approx(
        float(terms.sum()), abs=sum_tol(terms.numel(), float(terms.abs().sum()), safety=2)
    )
    (g,) = torch.autograd.grad(weighted, lp)
    assert g[0, 3] == 0 and g[1, 0] == 0  # masked, and weight 0


def test_hf_engine_matches_the_trainer_log_probs(task):
    """The built-in sampler's log-probs are the trainer's up to float noise: the metrics' baseline."""
    from tearless.models.loading import load_causal_lm, load_tokenizer
    from tearless.models.logprobs import response_logprobs
    from tearless.rollout.hf import HFRollout

    tok = load_tokenizer(task.model_dir)
    model = load_causal_lm(task.model_dir)
    engine = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    prompts = [tok("12+34=")["input_ids"], tok("5+7=")["input_ids"]]
    out = engine.generate(prompts, n=2, max_new_tokens=6, keys=prompt_keys(0, 0, 0, len(prompts)))
    with torch.no_grad():
        trainer_lp, _ = response_logprobs(
            model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask
        )
    _, m = rollout_correction(trainer_lp, out.log_probs, out.response_mask, level="token")
    # Incremental KV-cache decoding against one padded pass: equal to the forward's rounding.
    assert m["rollout_corr/max_abs_log_ratio"] <= logprob_tol(model.config)
    tokens = int(out.response_mask.sum())
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=weight_mean_tol(m, tokens))


def weight_mean_tol(metrics: dict, tokens: int) -> float:
    """|mean(w) − 1| for token weights w = e^Δ with |Δ| ≤ the logged max: e^max − 1, plus the float32
    rounding of a mean of ``tokens`` weights of size ~1."""
    return math.expm1(metrics["rollout_corr/max_abs_log_ratio"]) + sum_tol(tokens, 1.0)


def test_trainer_logs_the_mismatch_and_applies_tis(overrides, task, tmp_path):
    """With the hf engine the sampler is the trainer's own model, so the weights are 1 up to float
    noise and the TIS run's losses equal the plain run's: the wiring is exercised end to end."""
    from tearless import train
    from tearless.run.tracking import read_metrics

    common = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_max_samples=4"]
    common += ["actor_rollout_ref.rollout.val_kwargs.do_sample=false", "trainer.num_threads=1"]
    train(None, overrides(tmp_path / "plain", *common), log=lambda _: None)
    train(
        None,
        overrides(tmp_path / "tis", *common, "algorithm.rollout_correction.rollout_is=token"),
        log=lambda _: None,
    )
    (plain,) = read_metrics(tmp_path / "plain" / "metrics.jsonl")
    (tis,) = read_metrics(tmp_path / "tis" / "metrics.jsonl")
    assert "rollout_corr/kl" not in plain  # on-policy with hf: no old log-probs, no mismatch to measure
    # The old log-probs (the trainer's forward) against the sampler's: equal to the forward's rounding.
    from transformers import AutoConfig

    assert tis["rollout_corr/max_abs_log_ratio"] <= logprob_tol(AutoConfig.from_pretrained(task.model_dir))
    tokens = round(tis["response_length/mean"] * 32)  # 8 prompts × 4 responses
    assert tis["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=weight_mean_tol(tis, tokens))
    assert tis["rollout_corr/is_clip_frac"] == 0.0
    # On policy the PPO ratio is exactly 1 (old = the detached log-prob), so the TIS loss is the plain
    # one, −mean(A), with each term scaled by a weight within e^±max|Δ| of 1: off by at most
    # max|A|·(e^max|Δ| − 1), plus the rounding of the two means over the same tokens (terms ≤ max|A|).
    max_adv = max(abs(plain["critic/advantages/max"]), abs(plain["critic/advantages/min"]))
    shift = max_adv * math.expm1(tis["rollout_corr/max_abs_log_ratio"]) + sum_tol(tokens, max_adv)
    assert tis["actor/pg_loss"] == pytest.approx(plain["actor/pg_loss"], abs=shift)
