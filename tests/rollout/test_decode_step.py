"""The decode loop's fused sampling step against plain per-sample maths, and the decode cache's edges."""

from __future__ import annotations

import math

import pytest
import torch

from tearless.data import render_prompt
from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.rollout.decode_step import filter_logits, sample_step
from tearless.rollout.hf import HFRollout, decode_cache
from tearless.rollout.seeds import inverse_cdf, prompt_keys, sample_keys, uniforms
from tests.tolerances import LOGIT_BOUND, entropy_tol, logprob_tol

QUESTIONS = ["1+2=", "47+38=", "7+8=", "99+99="]


@pytest.fixture(scope="module")
def setup(task):
    tok = load_tokenizer(task.model_dir)
    model = load_causal_lm(task.model_dir).eval()
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return tok, model, prompts


def test_sample_step_by_hand():
    # Row 0: logits (0, ln 3) → p = (1/4, 3/4), CDF (0.25, 1); row 1: (ln 4, 0) → p = (4/5, 1/5).
    # Output rows draw from model rows (0, 0, 1) with u = (0.2, 0.3, 0.9): tokens 0 (0.2 < 0.25),
    # 1 (0.3 ≥ 0.25) and 1 (0.9 ≥ 0.8). Log-probs ln 1/4, ln 3/4, ln 1/5; entropies
    # H0 = −(¼ ln ¼ + ¾ ln ¾) = 0.562335, H1 = −(0.8 ln 0.8 + 0.2 ln 0.2) = 0.500402.
    logits = torch.tensor([[0.0, math.log(3.0)], [math.log(4.0), 0.0]])
    owner = torch.tensor([0, 0, 1])
    u = torch.tensor([0.2, 0.3, 0.9])
    tok, logp, ent = sample_step(logits, owner, u, temperature=1.0)
    assert tok.tolist() == [0, 1, 1]
    expected = torch.tensor([math.log(0.25), math.log(0.75), math.log(0.2)])
    torch.testing.assert_close(logp, expected)
    torch.testing.assert_close(ent, torch.tensor([0.562335, 0.562335, 0.500402]))
    # Temperature 2 halves the logits: row 0 becomes (0, ln √3), p0 = 1/(1+√3) = 0.366 > 0.3, so
    # output row 1 now draws token 0; greedy (u=None) takes each model row's argmax.
    tok, logp, _ = sample_step(logits, owner, u, temperature=2.0)
    assert tok.tolist() == [0, 0, 1]
    torch.testing.assert_close(logp[:2], torch.full((2,), -math.log(1 + math.sqrt(3.0))))
    assert sample_step(logits, owner, None, temperature=0.0)[0].tolist() == [1, 1, 0]


def test_a_minus_infinite_logit_gives_a_finite_entropy():
    # A logit of −inf (a vocabulary mask, a logits processor) has p = 0 and adds 0 to the entropy;
    # 0 · (−inf) made it NaN. Row (0, ln 3, −inf): p = (1/4, 3/4, 0), H = 0.562335 as in the hand test.
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf], [-math.inf, -math.inf, 1.0]])
    for u in (torch.tensor([0.2, 0.9]), None):
        tok, logp, ent = sample_step(logits, torch.tensor([0, 1]), u, temperature=1.0)
        torch.testing.assert_close(ent, torch.tensor([0.562335, 0.0]))
        assert torch.isfinite(logp).all() and tok[1].item() == 2


def test_the_distinct_draw_is_the_grouped_draw_bit_for_bit():
    # One output row per model row (any order, gaps allowed): the direct search of each row's CDF
    # makes the same comparisons as inverse_cdf's grouped search, including u·Z rounding up to Z.
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(40, 97, generator=gen)
    logits[5, 50:] = -1e4  # probability exactly 0 in float32: the u → 1 draw takes token 49
    perm = torch.randperm(40, generator=gen)
    owner = torch.cat([torch.tensor([5]), perm[perm != 5][:29]])
    for t in range(20):
        u = torch.rand(30, generator=gen)
        u[0] = 1.0 if t == 0 else u[0]
        grouped = sample_step(logits, owner, u, temperature=0.7, top_k=20)
        direct = sample_step(logits, owner, u, temperature=0.7, top_k=20, distinct=True)
        for a, b in zip(grouped, direct, strict=True):
            assert torch.equal(a, b)
        probs = torch.softmax(filter_logits(logits / 0.7, top_k=20), -1)
        assert torch.equal(direct[0], inverse_cdf(probs, owner, u))
    u = torch.ones(30)
    assert sample_step(logits, owner, u, temperature=1.0, distinct=True)[0][0] == 49


def reference_rollout(model, prompts, keys, n, max_new_tokens, temperature, top_k, eos):
    """Each sample alone, no KV cache: the whole sequence forwarded for every token, its token drawn
    by inverse CDF of softmax(filter(z/T)) at its keyed uniform, log-prob and entropy by log_softmax."""
    draws = uniforms(sample_keys(keys, n), max_new_tokens)
    rows = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            seq, toks, logps, ents = list(prompt), [], [], []
            for t in range(max_new_tokens):
                with torch.no_grad():
                    z = model(input_ids=torch.tensor([seq])).logits[0, -1].float() / temperature
                probs = torch.softmax(filter_logits(z, top_k), -1)[None]
                y = int(inverse_cdf(probs, torch.tensor([0]), draws[i * n + j, t : t + 1])[0])
                logsm = torch.log_softmax(z, -1)
                toks.append(y)
                logps.append(float(logsm[y]))
                ents.append(float(-(logsm.exp() * logsm).sum()))
                seq.append(y)
                if y == eos:
                    break
            rows.append((toks, logps, ents))
    return rows


@pytest.mark.parametrize("n", [1, 3])
def test_the_decode_loop_draws_what_a_plain_per_sample_loop_draws(setup, n):
    # n = 1: every sample its own row from the prefill on (the unshared path); n = 3: samples share
    # a prompt's row until they draw different tokens. Either way each sample's tokens are those its
    # key draws alone. Token ids are compared exactly: a rounding difference of the logits could
    # move a probability across a uniform draw only with a chance of about the rounding (~1e-7).
    tok, model, prompts = setup
    keys = prompt_keys(7, 0, 0, len(prompts))
    temperature, top_k = 1.3, 8  # a hot distribution: the samples diverge
    rollout = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    out = rollout.generate(prompts, n=n, max_new_tokens=12, temperature=temperature, top_k=top_k, keys=keys)
    ref = reference_rollout(model, prompts, keys, n, 12, temperature, top_k, tok.eos_token_id)
    bound = LOGIT_BOUND / temperature
    lp_tol = logprob_tol(model.config, logit_bound=bound)
    ent_tol = entropy_tol(model.config, logit_bound=bound)
    for row, (toks, logps, ents) in enumerate(ref):
        length = int(out.response_mask[row].sum())
        assert out.response_ids[row, :length].tolist() == toks
        torch.testing.assert_close(out.log_probs[row, :length], torch.tensor(logps), atol=lp_tol, rtol=0)
        torch.testing.assert_close(out.entropy[row, :length], torch.tensor(ents), atol=ent_tol, rtol=0)
    if n > 1:  # a prompt's samples did diverge (the shared rows split)
        assert len({tuple(t) for t, _, _ in ref}) > len(prompts)


def test_the_buffered_cache_fills_to_its_capacity_and_refuses_one_more_position(setup):
    _, model, _ = setup
    cfg = model.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    cache = decode_cache(cfg, 64)  # 64 positions: buffered
    layer = cache.layers[0]
    assert type(layer).__name__ == "BufferedLayer"
    gen = torch.Generator().manual_seed(0)
    written = torch.randn(3, heads, 64, dim, generator=gen)
    layer.update(written[:, :, :60], written[:, :, :60])  # a prefill of 60 positions
    for p in range(60, 64):  # then one position at a time, up to exactly the capacity
        keys, values = layer.update(written[:, :, p : p + 1], written[:, :, p : p + 1])
    assert torch.equal(keys, written) and torch.equal(values, written)
    layer.batch_select_indices(torch.tensor([2, 0]))  # rows selected at a full cache keep every position
    assert torch.equal(layer.keys, written[[2, 0]])
    with pytest.raises(ValueError, match="holds 64 positions, not 65"):
        layer.update(written[:2, :, :1], written[:2, :, :1])
    assert type(decode_cache(cfg, 63).layers[0]).__name__ == "DynamicLayer"  # below the threshold: stock


def test_in_order_rows_draw_what_distinct_rows_draw_without_a_host_read():
    # in_order (the GPU loop: output row i draws from model row i) takes the same draws as distinct,
    # including the clamp of a uniform that rounds up to the total mass (u = 1 - 2^-24 at a row whose
    # last tokens have zero probability).
    torch.manual_seed(0)
    logits = torch.randn(5, 7)
    logits[2, 4:] = -1e4  # probability exactly 0 in float32 (e^-1e4 underflows), entropy finite
    owner = torch.arange(5)
    u = torch.tensor([0.1, 0.5, 1 - 2**-24, 0.9, 0.0])
    expected = sample_step(logits, owner, u, temperature=0.7, distinct=True)
    got = sample_step(logits, owner, u, temperature=0.7, in_order=True)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    assert int(got[0][2]) <= 3  # the clamped draw stays on the row's support
