"""The built-in KV-cache sampler against transformers' own generate, and the actor's log-probs."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
from tensordict import TensorDict

from tearless.data import render_prompt
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.rollout.hf import HFRollout, filter_logits, left_pad
from tearless.rollout.seeds import prompt_keys
from tests.tolerances import LOGIT_BOUND, entropy_tol, logprob_tol

# Different prompt lengths (7 to 9 tokens) so that left padding and positions matter; the answers
# differ in length too ("1+2=3, 3" vs "7+8=15, 85"), so some rows finish before others.
QUESTIONS = ["1+2=", "47+38=", "7+8=", "99+99=", "15+6=", "0+40=", "62+29=", "3+45="]


@pytest.fixture(scope="module")
def setup(task):
    tok = load_tokenizer(task.model_dir)
    model = load_causal_lm(task.model_dir)
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    rollout = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    return tok, model, prompts, rollout


def as_batch(out):
    return TensorDict(
        {
            "prompt_ids": out.prompt_ids,
            "prompt_mask": out.prompt_mask,
            "response_ids": out.response_ids,
            "response_mask": out.response_mask,
        },
        batch_size=[out.response_ids.shape[0]],
    )


def test_greedy_equals_transformers_generate(setup):
    tok, model, prompts, rollout = setup
    assert len({len(p) for p in prompts}) == 3
    ours = rollout.generate(prompts, max_new_tokens=16, do_sample=False)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    theirs = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=16,
        do_sample=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )[:, ids.shape[1] :]
    # Both stop when every row has hit EOS, so the widths agree too.
    assert theirs.shape == ours.response_ids.shape
    assert theirs.tolist() == ours.response_ids.tolist()
    texts = tok.batch_decode(ours.response_ids, skip_special_tokens=True)
    assert texts[0].startswith("1+2=3, ")  # the warm-up's format: units column, then the answer
    assert (ours.prompt_ids == ids).all() and (ours.prompt_mask == mask).all()


def test_prompts_of_one_row_and_of_a_batch_give_the_same_greedy_answer(setup):
    # Left padding and positions from the mask: a prompt's answer does not depend on its neighbours.
    _, _, prompts, rollout = setup
    batch = rollout.generate(prompts, max_new_tokens=16, do_sample=False)
    for i in (0, 3):
        alone = rollout.generate([prompts[i]], max_new_tokens=16, do_sample=False)
        length = int(alone.response_mask.sum())
        assert batch.response_ids[i, :length].tolist() == alone.response_ids[0, :length].tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampler_log_probs_and_entropy_equal_the_actors_recomputed_ones(
    setup, local_workers, temperature, dtype
):
    # The sampler's incremental KV-cache forward and the actor's one-pass forward over the padded
    # sequence do the same maths in a different order: they agree to the forward's rounding in the
    # model's dtype, then both take the log-softmax in float32 (measured: exactly equal in float64,
    # ~1.5e-5 apart on log-probs near -2 in float32). Temperature divides the logits, and so scales
    # their bound.
    tok, model, prompts, _ = setup
    model = copy.deepcopy(model).to(dtype)
    rollout = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    out = rollout.generate(
        prompts,
        n=2,
        max_new_tokens=16,
        temperature=temperature,
        top_k=5,  # filtering changes what can be drawn, not the log-probs (those are unfiltered)
        keys=prompt_keys(3, 0, 0, len(prompts)),
    )
    # The trainer's π_old forward: its worker group's actor log-probs.
    workers = local_workers(f"actor_rollout_ref.rollout.temperature={temperature}", models={"actor": model})
    recomputed, entropy = workers.compute_log_prob("actor", as_batch(out), with_entropy=True)
    valid = out.response_mask.bool()
    bound = LOGIT_BOUND / temperature
    atol = logprob_tol(model.config, dtype, logit_bound=bound)
    torch.testing.assert_close(out.log_probs[valid], recomputed[valid], atol=atol, rtol=0)
    assert (out.log_probs[~valid] == 0).all()
    # The sampler's entropy is that of the same unfiltered, temperature-scaled distribution.
    atol = entropy_tol(model.config, dtype, logit_bound=bound)
    torch.testing.assert_close(out.entropy[valid], entropy[valid], atol=atol, rtol=0)
    assert (out.entropy[~valid] == 0).all() and out.entropy[valid].sum() > 0


def test_response_mask_covers_up_to_and_including_eos_and_truncation_flags(setup):
    tok, _, prompts, rollout = setup
    # 10 new tokens: "1+2=3, 3" + EOS (9 tokens) fits, "7+8=15, 85" + EOS (11) does not.
    out = rollout.generate(prompts, n=2, max_new_tokens=10, keys=prompt_keys(0, 0, 0, len(prompts)))
    assert out.response_ids.shape == (16, 10)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    for ids, mask, truncated in zip(out.response_ids, out.response_mask, out.truncated, strict=True):
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()  # ones, then zeros
        assert (ids[length:] == pad).all()
        eos_at = (ids[:length] == eos).nonzero().flatten().tolist()
        if truncated:
            assert eos_at == [] and length == 10
        else:
            assert eos_at == [length - 1]  # EOS is the last valid token, and the only one
    assert out.truncated.any() and not out.truncated.all()


def test_top_k_1_sampling_equals_greedy(setup):
    _, _, prompts, rollout = setup
    greedy = rollout.generate(prompts, max_new_tokens=16, do_sample=False)
    sampled = rollout.generate(
        prompts, max_new_tokens=16, top_k=1, temperature=1.3, keys=prompt_keys(7, 0, 0, len(prompts))
    )
    assert sampled.response_ids.tolist() == greedy.response_ids.tolist()
    assert sampled.response_mask.tolist() == greedy.response_mask.tolist()


def test_same_generator_seed_gives_the_same_samples(setup):
    _, _, prompts, rollout = setup

    def sample(seed):
        return rollout.generate(
            prompts, n=4, max_new_tokens=16, temperature=1.5, keys=prompt_keys(seed, 0, 0, len(prompts))
        )

    a, b, c = sample(11), sample(11), sample(12)
    assert a.response_ids.equal(b.response_ids) and a.log_probs.equal(b.log_probs)
    assert not a.response_ids.equal(c.response_ids)
    # n copies of a prompt are adjacent and, at temperature 1.5, not all alike.
    assert a.prompt_ids[0].equal(a.prompt_ids[3]) and not a.prompt_ids[3].equal(a.prompt_ids[4])
    assert len({tuple(r) for r in a.response_ids[:4].tolist()}) > 1


def test_the_model_is_left_in_the_mode_it_was_in(setup):
    _, model, prompts, rollout = setup
    model.train()
    rollout.generate(prompts[:2], max_new_tokens=2, do_sample=False)
    assert model.training
    model.eval()
    rollout.generate(prompts[:2], max_new_tokens=2, do_sample=False)
    assert not model.training


def test_left_pad_by_hand():
    ids, mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]


NEG = -math.inf


def test_filter_logits_top_k_by_hand():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0], [0.0, -1.0, 5.0, 2.0]])
    assert filter_logits(logits, top_k=2).tolist() == [[NEG, 4.0, NEG, 3.0], [NEG, NEG, 5.0, 2.0]]
    assert filter_logits(logits, top_k=1).tolist() == [[NEG, 4.0, NEG, NEG], [NEG, NEG, 5.0, NEG]]
    # Off: top_k <= 0, or at least the vocabulary size.
    for k in (-1, 0, 4, 10):
        assert filter_logits(logits, top_k=k).equal(logits)
    # Ties at the k-th value are all kept.
    assert filter_logits(torch.tensor([3.0, 1.0, 3.0, 3.0]), top_k=2).tolist() == [3.0, NEG, 3.0, 3.0]


def test_filter_logits_top_p_by_hand():
    # Probabilities 0.5, 0.3, 0.15, 0.05 in a shuffled order: [0.15, 0.5, 0.05, 0.3].
    # Sorted, the mass before each token is 0, 0.5, 0.8, 0.95; a token is dropped when the mass
    # before it already reaches top_p.
    logits = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    kept = lambda p: torch.isfinite(filter_logits(logits, top_p=p)).tolist()  # noqa: E731
    assert kept(0.4) == [False, True, False, False]  # 0.5 alone reaches 0.4
    assert kept(0.7) == [False, True, False, True]  # 0.5 + 0.3
    assert kept(0.9) == [True, True, False, True]  # 0.5 + 0.3 + 0.15
    assert kept(0.99) == [True, True, True, True]
    assert kept(1e-9) == [False, True, False, False]  # the most likely token is always kept
    assert filter_logits(logits, top_p=1.0).equal(logits)
    # Kept logits are unchanged (no renormalisation here; softmax does it).
    assert filter_logits(logits, top_p=0.7)[1] == logits[1]
    # Rows are filtered independently; top-k first, then top-p over what is left.
    two = torch.stack([logits, torch.tensor([0.25, 0.25, 0.25, 0.25]).log()])
    assert torch.isfinite(filter_logits(two, top_p=0.6)).tolist() == [
        [False, True, False, True],
        [True, True, True, False],
    ]
    both = filter_logits(logits, top_k=3, top_p=0.9)
    # After top-3 the mass renormalises to 0.5/0.95, 0.3/0.95, 0.15/0.95: mass before is 0, 0.53, 0.84.
    assert torch.isfinite(both).tolist() == [True, True, False, True]


def record_batch_sizes(model):
    """Forward-hook every call's (rows, width); returns the list and the hook handle."""
    calls = []

    def record(module, args, kwargs):
        calls.append(tuple(kwargs["input_ids"].shape))

    return calls, model.register_forward_pre_hook(record, with_kwargs=True)


def test_each_prompt_is_prefilled_once_finished_rows_leave_the_batch_and_no_forward_follows_the_end(setup):
    _, model, prompts, rollout = setup
    calls, handle = record_batch_sizes(model)
    try:
        out = rollout.generate(prompts, n=3, max_new_tokens=16, do_sample=False)
    finally:
        handle.remove()
    # One prefill of the 8 distinct prompts (not 24 copies), then one-token forwards.
    assert calls[0] == (8, max(len(p) for p in prompts))
    assert {width for _, width in calls[1:]} == {1}
    # A forward for every token but the last: the width of the response, not one more.
    assert len(calls) == out.response_ids.shape[1]
    # Greedy samples of a prompt never differ, so they share one model row: 8 rows, not 24; rows
    # that finished left: the decode batch only shrinks, and ends smaller than 8.
    decode = [rows for rows, _ in calls[1:]]
    assert decode[0] == 8 and all(a >= b for a, b in itertools.pairwise(decode))
    assert decode[-1] < 8
    # … and the answers are still every prompt's own greedy answer, n times over.
    alone = rollout.generate(prompts, n=1, max_new_tokens=16, do_sample=False)
    width = out.response_ids.shape[1]
    assert out.response_ids.tolist() == alone.response_ids[:, :width].repeat_interleave(3, 0).tolist()
    assert out.response_mask.sum(-1).tolist() == alone.response_mask.sum(-1).repeat_interleave(3).tolist()


def test_samples_share_a_model_row_until_they_draw_different_tokens(setup):
    # At every step the model forwards at least one row per distinct history of the live samples
    # (prompt + tokens so far), and no more than needed: exactly that many after a split, or at
    # most a third more while finished rows wait to be dropped; once half the samples are distinct,
    # one row per live sample (no more split copies).
    _, model, prompts, rollout = setup
    n = 8
    calls, handle = record_batch_sizes(model)
    try:
        out = rollout.generate(prompts, n=n, max_new_tokens=16, keys=prompt_keys(2, 0, 0, len(prompts)))
    finally:
        handle.remove()
    ids, mask = out.response_ids, out.response_mask
    decode = [rows for rows, _ in calls[1:]]
    assert len(decode) == ids.shape[1] - 1
    expanded = False
    for t, rows in enumerate(decode, start=1):  # the forward after step t-1 reads token t-1
        live = [r for r in range(len(ids)) if mask[r, t]]
        distinct = len({(r // n, tuple(ids[r, :t].tolist())) for r in live})
        expanded = expanded or 2 * distinct >= len(live)
        assert distinct <= rows <= 4 * (len(live) if expanded else distinct) // 3 + 1
    # The warmed-up model is confident: the 64 samples are far fewer histories (~6x on this task).
    assert sum(decode) < 0.4 * int(mask[:, 1:].sum())
    assert len({tuple(r) for r in ids.tolist()}) > len(prompts)  # and yet the samples do differ


def test_each_output_row_draws_an_independent_sample_of_its_model_rows_distribution():
    from tearless.rollout.seeds import inverse_cdf, mix, uniforms

    probs = torch.tensor([[0.5, 0.5, 0.0], [0.1, 0.2, 0.7]])
    owner = torch.tensor([1, 0, 1, 1, 0])
    # 4,000 draws of the 5 rows: sample r's t-th draw uses the uniform of (its key, t).
    u = uniforms([mix(7, r) for r in range(5)], 4000)  # (5, 4000)
    draws = torch.stack([inverse_cdf(probs, owner, u[:, t]) for t in range(4000)])  # (4000, 5)
    for row, model_row in enumerate(owner.tolist()):
        freq = torch.bincount(draws[:, row], minlength=3).float() / len(draws)
        torch.testing.assert_close(freq, probs[model_row], atol=0.03, rtol=0)
    # Rows 0 and 2 share model row 1 but draw independently: equal with probability Σ p² = 0.54.
    same = (draws[:, 0] == draws[:, 2]).float().mean().item()
    assert abs(same - 0.54) < 0.03
    assert (draws[:, 1] != 2).all() and (draws[:, 4] != 2).all()  # zero-probability tokens never drawn


def test_inverse_cdf_by_hand():
    from tearless.rollout.seeds import inverse_cdf

    # CDF of [0.1, 0, 0.6, 0.3] is [0.1, 0.1, 0.7, 1.0]: u = 0.05 → token 0; 0.11 → token 2 (the
    # zero-probability token 1 is never drawn); 0.69 → 2; 0.71 → 3; and u·Z rounding up to Z → the
    # last token of non-zero probability (row 2's token 1).
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3], [0.2, 0.8, 0.0, 0.0]])
    owner = torch.tensor([0, 0, 0, 0, 1])
    u = torch.tensor([0.05, 0.11, 0.69, 0.71, 1.0])
    assert inverse_cdf(probs, owner, u).tolist() == [0, 2, 2, 3, 1]


def test_the_same_keys_draw_the_same_samples_in_any_batch(setup):
    # Placement invariance: a prompt's samples depend on its key, not on its neighbours.
    _, _, prompts, rollout = setup
    keys = [11 * (i + 1) for i in range(len(prompts))]
    together = rollout.generate(prompts, n=3, max_new_tokens=12, keys=keys)
    for i, prompt in enumerate(prompts):
        alone = rollout.generate([prompt], n=3, max_new_tokens=12, keys=[keys[i]])
        rows = slice(3 * i, 3 * i + 3)
        width = alone.response_ids.shape[1]
        assert together.response_ids[rows, :width].tolist() == alone.response_ids.tolist()
        assert not together.response_mask[rows, width:].any()


def test_the_buffered_decode_cache_samples_exactly_what_the_stock_cache_samples(setup, monkeypatch):
    # Buffers written in place instead of a cache re-concatenated every step: the same keys and
    # values, so with one seed the same tokens, and the same log-probs and entropies to rounding.
    # n = 3 repeats the prefilled cache; rows finishing early compact it (batch_select_indices).
    import tearless.rollout.hf as hf

    _, model, prompts, rollout = setup
    outs, layers = {}, {}
    for name, threshold in (("stock", 10**9), ("buffered", 0)):
        monkeypatch.setattr(hf, "BUFFERED_CACHE_MIN_POSITIONS", threshold)
        layers[name] = type(hf.decode_cache(model.config, 40).layers[0]).__name__
        outs[name] = rollout.generate(
            prompts, n=3, max_new_tokens=24, temperature=1.0, keys=prompt_keys(5, 0, 0, len(prompts))
        )
    assert layers == {"stock": "DynamicLayer", "buffered": "BufferedLayer"}
    stock, buffered = outs["stock"], outs["buffered"]
    # Token ids are integers drawn with one seed: equal unless rounding moved a probability across a
    # uniform draw (a chance of about the rounding itself, ~1e-7 per token), so compared exactly.
    assert torch.equal(buffered.response_ids, stock.response_ids)
    assert torch.equal(buffered.response_mask, stock.response_mask)
    lengths = stock.response_mask.sum(-1)
    assert lengths.min() < lengths.max()  # rows left the decode batch at different steps
    # The attention reads the keys and values from differently laid-out buffers (other kernels).
    torch.testing.assert_close(buffered.log_probs, stock.log_probs, atol=logprob_tol(model.config), rtol=0)
    torch.testing.assert_close(buffered.entropy, stock.entropy, atol=entropy_tol(model.config), rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_the_gpu_loop_samples_what_the_cpu_loop_samples(setup, temperature):
    # The static loop (rollout.static_decode, the GPU default, run here on CPU) keeps one row per
    # sample to the end and reads nothing back per token; the same keys draw the same tokens, and a
    # finished row's later columns are masked exactly as the CPU loop leaves them.
    _, model, prompts, rollout = setup
    keys = prompt_keys(5, 0, 0, len(prompts)) if temperature else None
    outs = {}
    for static in (False, True):
        rollout.static_loop = static
        try:
            outs[static] = rollout.generate(
                prompts,
                n=3,
                max_new_tokens=24,
                temperature=temperature or 1.0,
                do_sample=temperature > 0,
                keys=keys,
            )
        finally:
            rollout.static_loop = None
    cpu, gpu = outs[False], outs[True]
    # Integers drawn with one seed: equal unless rounding moved a probability across a draw.
    assert torch.equal(gpu.response_ids, cpu.response_ids)
    assert torch.equal(gpu.response_mask, cpu.response_mask)
    assert torch.equal(gpu.truncated, cpu.truncated)
    lengths = cpu.response_mask.sum(-1)
    assert lengths.min() < lengths.max()  # rows finished at different steps
    # Another batch composition and cache layout: the log-probs and entropies agree to rounding.
    torch.testing.assert_close(gpu.log_probs, cpu.log_probs, atol=logprob_tol(model.config), rtol=0)
    torch.testing.assert_close(gpu.entropy, cpu.entropy, atol=entropy_tol(model.config), rtol=0)
    assert torch.equal(gpu.log_probs == 0, cpu.log_probs == 0)
