"""The actor's update: micro-batching never changes it, and its schedule and splitting are as documented.

Updates and forwards run through the trainer's own route: the in-process worker group
(``local_workers``) plans, its rank runs the actor's loss with its settings from the config.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from tearless.algos import AGG_MODES, POLICY_LOSSES, register_policy_loss
from tearless.algos.losses import LINEAR_IN_ADVANTAGE
from tearless.data import render_prompt
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.rollout.hf import HFRollout
from tearless.rollout.seeds import prompt_keys
from tearless.workers.optim import lr_lambda
from tearless.workers.schedule import micro_batches
from tests.tolerances import LOGIT_BOUND, entropy_tol, eps, gradient_terms, logprob_tol, loss_rel, sum_tol

N = 4  # responses per prompt


@pytest.fixture(scope="module")
def model_and_batch(task):
    return build_batch(task.model_dir)


def build_batch(model_dir):
    """The warmed-up tiny model and a hand-built update batch from a real rollout of it.

    8 prompts × 4 responses sampled at temperature 1; ``old_log_prob`` and ``ref_log_prob`` are the
    sampler's log-probs shifted by seeded noise, so ratios differ from 1 (some get clipped, dual-clip
    included) and the KL term is non-zero; advantages are seeded ±1-ish per response.
    """
    tok = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir)
    questions = ["7+8=", "47+38=", "1+2=", "99+99=", "15+6=", "5+55=", "62+29=", "3+4="]
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in questions]
    gen = torch.Generator().manual_seed(0)
    out = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id).generate(
        prompts, n=N, max_new_tokens=16, temperature=1.0, keys=prompt_keys(0, 0, 0, len(prompts))
    )
    mask = out.response_mask
    rows = mask.shape[0]
    noise = torch.randn(out.log_probs.shape, generator=gen)
    td = TensorDict(
        {
            "prompt_ids": out.prompt_ids,
            "prompt_mask": out.prompt_mask,
            "response_ids": out.response_ids,
            "response_mask": mask,
            "old_log_prob": (out.log_probs + 0.3 * noise) * mask,
            "ref_log_prob": (out.log_probs - 0.2 * noise.abs()) * mask,
            "advantages": torch.randn(rows, 1, generator=gen).expand_as(mask) * mask,
            "rollout_entropy": out.entropy,
            # Each row's prompt group: a prompt's N responses are adjacent.
            "uid_index": torch.arange(len(prompts)).repeat_interleave(N),
        },
        batch_size=[rows],
    )
    # Responses of different lengths, so token-mean and sequence-mean weight rows differently.
    assert len(set(mask.sum(-1).tolist())) > 1
    return model, td


def update_terms(model, td) -> int:
    """The accumulation behind a gradient entry of an update on ``td``: every response token's
    contribution (a forward and a backward of the network) summed, at most all of the batch's."""
    return gradient_terms(model.config, int(td["response_mask"].sum()))


def assert_same_sgd_result(b, a, start, steps, n_terms, msg=None):
    """Weights after ``steps`` SGD steps from ``start`` by two runs whose gradients agree to rounding.

    Each step rounds θ − lr·g to float32, so the runs may land one ulp apart per step (eps·|θ|); the
    gradients' own rounding moves θ by at most lr·sum_tol(Σ|g|), and lr·Σ|g| is the distance
    travelled (safety 2: the gradient entries are sums with some cancellation between tokens).
    """
    moved = float((a - start).detach().abs().max())
    atol = steps * eps(a.dtype) * float(a.detach().abs().max()) + sum_tol(n_terms, moved, a.dtype, safety=2)
    torch.testing.assert_close(b, a, atol=atol, rtol=0, msg=msg)


def assert_same_gradient(b, a, n_terms, msg=None):
    """Gradients of one loss from differently split forwards: each entry is a sum of ``n_terms``
    roundings (see :func:`update_terms`) whose terms are no larger than the tensor's largest entry,
    save some cancellation between tokens of opposite advantage (safety 2)."""
    atol = sum_tol(n_terms, float(a.abs().max()), a.dtype, safety=2)
    torch.testing.assert_close(b, a, atol=atol, rtol=0, msg=msg)


def metric_rel(model, td) -> float:
    """Relative tolerance of the update's logged losses and norms between layouts (loss_rel)."""
    return loss_rel(model.config, int(td["response_mask"].sum()))


@pytest.mark.parametrize("loss_agg_mode", list(AGG_MODES))
@pytest.mark.parametrize("mini", [8, 4], ids=["one-minibatch-on-policy", "two-minibatches-off-policy"])
def test_micro_batching_and_dynamic_batching_leave_the_update_unchanged(
    model_and_batch, updated, loss_agg_mode, mini
):
    model, td = model_and_batch
    common = dict(ppo_mini_batch_size=mini, loss_agg_mode=loss_agg_mode)
    # token-sum losses are ~100x larger than token-mean ones: scale the step so that every mode moves
    # the weights by a gradient-norm of 0.1 and one absolute tolerance means the same for all.
    _, _, probe = updated(model, td, lr=0.0, **common)
    scale = probe["actor/grad_norm"]
    common["lr"] = 0.1 / scale
    whole, whole_grads, whole_metrics = updated(model, td, **common)
    variants = {
        "micro=2": dict(ppo_micro_batch_size_per_gpu=2),
        "micro=8": dict(ppo_micro_batch_size_per_gpu=8),
        # 40 tokens hold one to three sequences of 9 to 25 tokens: uneven micro-batches.
        "dynamic=40": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40),
    }
    lengths = (td["prompt_mask"].sum(-1) + td["response_mask"].sum(-1)).tolist()
    assert max(lengths) <= 40
    # Splitting into micro-batches (and padding each to its own width) changes the order of every
    # sum, so the variants agree with the whole batch to float32 rounding of those sums, not bit for bit.
    terms, steps, rel = update_terms(model, td), 8 // mini, metric_rel(model, td)
    for name, extra in variants.items():
        other, other_grads, other_metrics = updated(model, td, **common, **extra)
        pairs = zip(whole.named_parameters(), other.parameters(), model.parameters(), strict=True)
        for (pname, a), b, start in pairs:
            assert_same_sgd_result(b, a, start, steps, terms, msg=lambda m, n=name, p=pname: f"{n}: {p}: {m}")
        for (pname, _), a, b in zip(whole.named_parameters(), whole_grads, other_grads, strict=True):
            assert_same_gradient(
                b / scale, a / scale, terms, msg=lambda m, n=name, p=pname: f"{n}: grad of {p}: {m}"
            )
        for key in (
            "actor/pg_loss",
            "actor/entropy",
            "actor/kl_loss",
            "actor/grad_norm",
            "actor/pg_clipfrac",
        ):
            assert other_metrics[key] == pytest.approx(whole_metrics[key], rel=rel), (name, key)
    assert whole_metrics["actor/num_optimizer_steps"] == 8 / mini
    # Guard against a vacuous pass: the update moved the weights, and clipping was exercised.
    assert any(not a.equal(b) for a, b in zip(whole.parameters(), model.parameters(), strict=True))
    if mini == 4:
        assert whole_metrics["actor/pg_clipfrac"] > 0


def test_on_policy_update_ignores_old_log_prob(model_and_batch, updated):
    # One mini-batch, one epoch: the ratio is exactly 1, so old_log_prob is not needed (not even read).
    model, td = model_and_batch
    without = td.exclude("old_log_prob")
    a, _, ma = updated(model, td, ppo_mini_batch_size=8)
    b, _, _ = updated(model, without, ppo_mini_batch_size=8)
    assert all(x.equal(y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    assert ma["actor/ppo_kl"] == 0.0 and ma["actor/pg_clipfrac"] == 0.0


def zero_groups(td: TensorDict, groups: list[int]) -> TensorDict:
    """``td`` with the advantages of the given prompt groups (N rows each) set to 0."""
    td = td.clone()
    for g in groups:
        td["advantages"][g * N : (g + 1) * N] = 0.0
    return td


PG_ONLY = dict(use_kl_loss=False, entropy_coeff=0.0)


@pytest.mark.parametrize(
    "loss",
    [("vanilla", "token-mean"), ("vanilla", "seq-mean-token-mean"), ("vanilla", "seq-mean-token-sum-norm"),
     ("gspo", "seq-mean-token-mean"), ("cispo", "token-mean")],
    ids=lambda x: "-".join(x),
)  # fmt: skip
@pytest.mark.parametrize("entropy_source", ["rollout", "forward"])
def test_skipping_zero_advantage_rows_leaves_the_update_and_its_metrics_unchanged(
    model_and_batch, updated, loss, entropy_source
):
    model, td = model_and_batch
    mode, agg = loss
    td = zero_groups(td, [0, 2, 5])  # 12 of 32 responses carry no signal
    if entropy_source == "forward":
        td = td.exclude("rollout_entropy")
    common = dict(ppo_mini_batch_size=8, loss_agg_mode=agg, **PG_ONLY)
    common["policy_loss.loss_mode"] = mode
    _, _, probe = updated(model, td, lr=0.0, skip_zero_adv_rows=False, **common)
    common["lr"] = 0.1 / probe["actor/grad_norm"]
    full, full_grads, full_m = updated(model, td, skip_zero_adv_rows=False, **common)
    skip, skip_grads, skip_m = updated(model, td, **common)
    assert skip_m["actor/zero_adv_rows_skipped"] == 12 / 32
    assert "actor/zero_adv_rows_skipped" not in full_m
    # Leaving rows out changes the batch the sums run over: equal to float32 rounding of those sums.
    terms, rel = update_terms(model, td), metric_rel(model, td)
    pairs = zip(full.named_parameters(), skip.parameters(), model.parameters(), strict=True)
    for (name, a), b, start in pairs:
        assert_same_sgd_result(b, a, start, 1, terms, msg=lambda m, p=name: f"{p}: {m}")
    for a, b in zip(full_grads, skip_grads, strict=True):
        assert_same_gradient(b * common["lr"], a * common["lr"], terms)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        # ppo_kl is a mean of log-ratios that are exactly 0 on policy (old = the detached log-prob).
        assert skip_m[key] == pytest.approx(full_m[key], rel=rel), key
    # The skipped rows' entropy comes from another forward (the sampler's, or one without gradient)
    # than the full update's: per token equal to the entropy's rounding (entropy_tol), and so is the
    # mean over tokens.
    assert skip_m["actor/entropy"] == pytest.approx(full_m["actor/entropy"], abs=entropy_tol(model.config))
    assert any(not a.equal(b) for a, b in zip(full.parameters(), model.parameters(), strict=True))


def test_a_loss_registered_as_linear_in_the_advantage_leaves_zero_advantage_rows_out(
    model_and_batch, updated
):
    # The same maths under two user names: only the one registered as linear in A_t is skipped.
    model, td = model_and_batch
    td = zero_groups(td, [0, 2, 5])
    register_policy_loss("test_linear_vanilla", linear_in_advantage=True)(POLICY_LOSSES["vanilla"])
    register_policy_loss("test_plain_vanilla")(POLICY_LOSSES["vanilla"])
    try:
        runs = {
            name: updated(model, td, ppo_mini_batch_size=8, **PG_ONLY, **{"policy_loss.loss_mode": name})[2]
            for name in ("test_linear_vanilla", "test_plain_vanilla")
        }
    finally:
        for name in ("test_linear_vanilla", "test_plain_vanilla"):
            POLICY_LOSSES.pop(name)
            LINEAR_IN_ADVANTAGE.discard(name)
    assert runs["test_linear_vanilla"]["actor/zero_adv_rows_skipped"] == 12 / 32
    assert "actor/zero_adv_rows_skipped" not in runs["test_plain_vanilla"]


def test_a_batch_without_signal_still_takes_its_optimizer_step(model_and_batch, updated):
    # Every advantage 0: the gradient is 0 and AdamW still decays the weights and its moments; one
    # row is forwarded so that the step, and every metric, happens as it would without skipping.
    model, td = model_and_batch
    td = zero_groups(td, list(range(8)))
    runs = {}
    for skip in (False, True):
        actor = dict(ppo_mini_batch_size=8, skip_zero_adv_rows=skip, **PG_ONLY, **{"optim.weight_decay": 0.1})
        trained, _, metrics = updated(model, td, sgd=False, **actor)
        runs[skip] = (trained, metrics)
    (full, full_m), (skipped, skip_m) = runs[False], runs[True]
    assert skip_m["actor/zero_adv_rows_skipped"] == 31 / 32
    assert set(full_m) <= set(skip_m) and skip_m["actor/grad_norm"] == full_m["actor/grad_norm"] == 0.0
    # Exactly equal: both gradients are exact zeros (A = 0 times finite factors), so both AdamW steps
    # are the same pure weight decay of the same weights.
    for a, b in zip(full.parameters(), skipped.parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert any(not a.equal(b) for a, b in zip(full.parameters(), model.parameters(), strict=True))


@pytest.mark.parametrize(
    "settings",
    [dict(entropy_coeff=0.01, use_kl_loss=False), dict(entropy_coeff=0.0, use_kl_loss=True),
     {**PG_ONLY, "policy_loss.loss_mode": "clip_cov"}, dict(**PG_ONLY, ppo_epochs=2),
     dict(**PG_ONLY, mini=4)],
    ids=["entropy-bonus", "kl-loss", "clip-cov", "two-epochs", "two-minibatches"],
)  # fmt: skip
def test_zero_advantage_rows_are_forwarded_when_their_gradient_is_not_zero(
    model_and_batch, updated, settings
):
    # An entropy bonus or a KL loss has a gradient at A = 0; clip_cov centres over the batch; off
    # policy the ratio and its metrics (ppo_kl, clip fractions) involve every row.
    model, td = model_and_batch
    settings = dict(settings)
    mini = settings.pop("mini", 8)
    _, _, metrics = updated(model, zero_groups(td, [0, 2, 5]), ppo_mini_batch_size=mini, **settings)
    assert "actor/zero_adv_rows_skipped" not in metrics


def test_log_prob_micro_batches_give_the_same_log_probs(model_and_batch, local_workers):
    model, td = model_and_batch
    hot = "actor_rollout_ref.rollout.temperature=0.7"
    whole, ent = local_workers(hot, models={"actor": model}).compute_log_prob("actor", td, with_entropy=True)
    micro = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3"
    parts, ent_parts = local_workers(hot, micro, models={"actor": model}).compute_log_prob(
        "actor", td, with_entropy=True
    )
    mask = td["response_mask"].bool()
    # Other micro-batches, other padded widths: the forwards agree to rounding. Temperature 0.7
    # divides the logits, so their bound grows by 1/0.7.
    lp_atol = logprob_tol(model.config, logit_bound=LOGIT_BOUND / 0.7)
    ent_atol = entropy_tol(model.config, logit_bound=LOGIT_BOUND / 0.7)
    torch.testing.assert_close(parts[mask], whole[mask], atol=lp_atol, rtol=0)
    torch.testing.assert_close(ent_parts[mask], ent[mask], atol=ent_atol, rtol=0)
    assert whole.shape == mask.shape and (whole[mask] <= 0).all()


def _toy_td(lengths_prompt, lengths_response):
    rows = len(lengths_prompt)
    pm = torch.zeros(rows, max(lengths_prompt), dtype=torch.long)
    rm = torch.zeros(rows, max(lengths_response), dtype=torch.long)
    for i, (p, r) in enumerate(zip(lengths_prompt, lengths_response, strict=True)):
        pm[i, pm.shape[1] - p :] = 1
        rm[i, :r] = 1
    return TensorDict({"prompt_mask": pm, "response_mask": rm, "row": torch.arange(rows)}, batch_size=[rows])


def test_micro_batches_by_count_and_by_token_budget():
    td = _toy_td([2, 3, 2, 1, 3], [3, 1, 4, 2, 5])  # real lengths 5, 4, 6, 3, 8
    assert [mb["row"].tolist() for mb in micro_batches(td, size=2)] == [[0, 1], [2, 3], [4]]
    assert [mb["row"].tolist() for mb in micro_batches(td)] == [[0, 1, 2, 3, 4]]
    # Budget 10: 5+4 fit, +6 does not; 6+3 fit, +8 does not; 8 alone.
    assert [mb["row"].tolist() for mb in micro_batches(td, token_budget=10)] == [[0, 1], [2, 3], [4]]
    # A row longer than the budget still gets a micro-batch of its own.
    assert [mb["row"].tolist() for mb in micro_batches(td, token_budget=5)] == [[0], [1], [2], [3], [4]]


def test_lr_schedule_by_hand():
    warm = lr_lambda(10, 2, "constant", 0.0, 0.5)
    assert [warm(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    # Cosine after 2 warm-up steps over 10: progress (s-2)/8; half-way (s=6) is 0.5, the end 0.
    cos = lr_lambda(10, 2, "cosine", 0.0, 0.5)
    assert cos(2) == pytest.approx(1.0)
    assert cos(6) == pytest.approx(0.5)
    assert cos(10) == pytest.approx(0.0, abs=1e-12)
    floor = lr_lambda(10, 0, "cosine", 0.1, 0.5)
    assert floor(5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert floor(10) == pytest.approx(0.1)


def test_without_calculate_entropy_the_update_skips_the_entropy_pass_and_reports_the_samplers(
    model_and_batch, updated, monkeypatch
):
    # calculate_entropy=false and no entropy bonus: no pass over the vocabulary for the entropy, and
    # actor/entropy is the sampler's entropy of the same tokens, aggregated as the update's would be.
    import tearless.models.logprobs as logprobs
    from tearless.algos import agg_loss

    model, td = model_and_batch
    calls = []
    real = logprobs.entropy_from_logits
    monkeypatch.setattr(logprobs, "entropy_from_logits", lambda *a, **k: calls.append(1) or real(*a, **k))
    common = dict(entropy_coeff=0.0, use_kl_loss=False, skip_zero_adv_rows=False, ppo_mini_batch_size=8)
    _, _, computed = updated(model, td, lr=0.0, **common)
    assert calls
    calls.clear()
    _, _, sampled = updated(model, td, lr=0.0, calculate_entropy=False, **common)
    assert calls == []
    mask = td["response_mask"]
    want = float(agg_loss(td["rollout_entropy"], mask, "token-mean"))
    assert sampled["actor/entropy"] == pytest.approx(want, rel=sum_tol(int(mask.sum()), 1.0))
    # The sampler drew from the weights being updated (one on-policy mini-batch): the two agree.
    assert sampled["actor/entropy"] == pytest.approx(computed["actor/entropy"], abs=entropy_tol(model.config))
    _, _, none = updated(model, td.exclude("rollout_entropy"), lr=0.0, calculate_entropy=False, **common)
    assert "actor/entropy" not in none and calls == []
    # An entropy bonus needs the entropy whatever calculate_entropy says.
    _, _, bonus = updated(model, td, lr=0.0, calculate_entropy=False, entropy_coeff=0.01, use_kl_loss=False)
    assert calls and bonus["actor/entropy"] == pytest.approx(
        computed["actor/entropy"], rel=metric_rel(model, td)
    )
