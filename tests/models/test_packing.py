"""Padding-free forwards (``use_remove_padding``): packed log-probs, entropies, values and gradients
equal to the padded pass's, for each attention implementation that runs on CPU."""

from __future__ import annotations

import copy

import pytest
import torch

from tearless.models.logprobs import attended_lengths, response_logprobs
from tearless.models.packing import PACKED_SDPA, pack_rows, packable
from tearless.models.value import response_values
from tests.models.test_models import float64_model_tols


def test_pack_rows_by_hand():
    # Row 0: prompt [5, 6] (one pad), response [1, 2, 3] → packed 5 6 1 2 (3 is only a target).
    # Row 1: prompt [7, 8, 9], response [4] → packed 7 8 9. Row 2: no response → left out.
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 0, 3]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])
    response_ids = torch.tensor([[1, 2, 3], [4, 0, 0], [0, 0, 0]])
    response_mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    lengths = attended_lengths(response_mask)
    assert packable(prompt_mask, response_mask, lengths)
    p = pack_rows(prompt_ids, prompt_mask, response_ids, lengths)
    assert p.input_ids.tolist() == [[5, 6, 1, 2, 7, 8, 9]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2]]
    assert p.cu_seqlens.tolist() == [0, 4, 7] and p.max_length == 4
    # Row 0's response columns 0, 1, 2 are predicted at packed positions 1, 2, 3; row 1's column 0 at 6.
    assert p.rows.tolist() == [0, 0, 0, 1] and p.cols.tolist() == [0, 1, 2, 0]
    assert p.keep.tolist() == [1, 2, 3, 6]
    assert p.unpack(torch.tensor([1.0, 2.0, 3.0, 4.0]), (3, 3)).tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]


def test_layouts_that_are_not_packable():
    ones = torch.ones(1, 3, dtype=torch.long)
    # A hole in the response's attention mask, a right-padded prompt, an empty prompt.
    hole = torch.tensor([[1, 0, 1]])
    assert not packable(ones, hole, attended_lengths(hole))
    assert not packable(torch.tensor([[1, 1, 0]]), ones, attended_lengths(ones))
    assert not packable(torch.zeros(1, 3, dtype=torch.long), ones, attended_lengths(ones))
    # No response token in any row: nothing to pack (the padded pass returns its zeros).
    none = torch.zeros(1, 3, dtype=torch.long)
    assert not packable(ones, none, attended_lengths(none))


def batch(vocab, seed=3):
    """Six rows: prompts of 2-8 tokens (left-padded to 8), responses of 0-7 tokens (right-padded to
    7), two rows identical (the duplicate path), one with no response."""
    g = torch.Generator().manual_seed(seed)
    plens, rlens = [8, 3, 5, 5, 2, 6], [7, 1, 4, 4, 0, 6]
    prompt_ids = torch.zeros(6, 8, dtype=torch.long)
    prompt_mask = torch.zeros(6, 8, dtype=torch.long)
    response_ids = torch.zeros(6, 7, dtype=torch.long)
    response_mask = torch.zeros(6, 7, dtype=torch.long)
    for i, (p, r) in enumerate(zip(plens, rlens, strict=True)):
        prompt_ids[i, 8 - p :] = torch.randint(3, vocab, (p,), generator=g)
        prompt_mask[i, 8 - p :] = 1
        response_ids[i, :r] = torch.randint(3, vocab, (r,), generator=g)
        response_mask[i, :r] = 1
    prompt_ids[3], response_ids[3] = prompt_ids[2], response_ids[2]
    return prompt_ids, prompt_mask, response_ids, response_mask


def tiny(attn: str, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = attn
    torch.manual_seed(0)
    return LlamaForCausalLM(config).double()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("share_prompts", [True, False], ids=["dedup", "no-dedup"])
def test_packed_log_probs_entropies_and_gradients_equal_the_padded_pass(attn, share_prompts):
    # sdpa is switched to the packed-sdpa attention (per-sequence causal SDPA); eager keeps transformers'
    # block mask built from the position ids. Grouped-query attention (4 query heads on 2 KV heads).
    # A float64 model, so that the tolerances check the maths (see float64_model_tols). The padded
    # reference runs with sdpa (transformers' eager padded pass gives NaN at float64 pad rows).
    model, reference = tiny(attn), tiny("sdpa")
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61)
    weight = torch.randn(response_ids.shape, generator=torch.Generator().manual_seed(4))

    def run(remove_padding):
        model_ = model if remove_padding else reference
        params = list(model_.parameters())
        lp, ent = response_logprobs(
            model_, prompt_ids, prompt_mask, response_ids, response_mask, temperature=0.7,
            with_entropy="grad", share_prompts=share_prompts, remove_padding=remove_padding,
        )  # fmt: skip
        loss = (lp * weight * response_mask).sum() + 0.1 * (ent * response_mask).sum()
        return lp.detach(), ent.detach(), torch.autograd.grad(loss, params)

    padded, padded_ent, padded_grads = run(False)
    packed, packed_ent, packed_grads = run(True)
    assert model.config._attn_implementation == (PACKED_SDPA if attn == "sdpa" else "eager")
    mask = response_mask.bool()
    lp_atol, grad_rtol = float64_model_tols(model.config, temperature=0.7, n_tokens=int(mask.sum()))
    torch.testing.assert_close(packed[mask], padded[mask], atol=lp_atol, rtol=0)
    # Past each row's length the packed pass returns exact zeros (the padded pass zeroes them too).
    assert packed[~mask].eq(0).all() and packed_ent[~mask].eq(0).all()
    # The entropy is a second float32 sum over the vocabulary of p·z (|z| ≤ 1 for this random model).
    torch.testing.assert_close(packed_ent[mask], padded_ent[mask], atol=2 * lp_atol, rtol=0)
    for a, b in zip(padded_grads, packed_grads, strict=True):
        torch.testing.assert_close(b, a, atol=grad_rtol * float(a.abs().max()), rtol=0)
    assert sum(float(g.abs().sum()) for g in packed_grads) > 0


def test_the_packed_sdpa_model_forwards_unpacked_batches_exactly_as_sdpa(tmp_path):
    # After the switch, padded forwards (rollout, the padded pass) take transformers' own sdpa path:
    # the same kernel on the same inputs, so bit-for-bit the same logits. The switch is not saved.
    model = tiny("sdpa")
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61)
    before = response_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, share_prompts=False
    )[0]
    response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, remove_padding=True)
    assert model.config._attn_implementation == PACKED_SDPA
    after = response_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, share_prompts=False
    )[0]
    assert torch.equal(before, after)
    model.save_pretrained(tmp_path)
    assert PACKED_SDPA not in (tmp_path / "config.json").read_text()


def test_packed_values_and_their_gradients_equal_the_padded_pass():
    from transformers import LlamaConfig, LlamaForTokenClassification

    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, pad_token_id=0, num_labels=1, classifier_dropout=0.0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForTokenClassification(config).double()
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61, seed=5)
    params = list(model.parameters())
    mask = response_mask.bool()

    def run(remove_padding):
        v = response_values(
            model, prompt_ids, prompt_mask, response_ids, response_mask, remove_padding=remove_padding
        )
        return v.detach(), torch.autograd.grad((v * response_mask).square().sum(), params)

    padded, padded_grads = run(False)
    packed, packed_grads = run(True)
    assert packed.dtype == padded.dtype == torch.float32 and packed[~mask].eq(0).all()
    # float64 forwards in another layout, cast to float32: one float32 ulp of |v| apart at most.
    scale = float(padded[mask].abs().max())
    torch.testing.assert_close(
        packed[mask], padded[mask], atol=2 * torch.finfo(torch.float32).eps * scale, rtol=0
    )
    _, grad_rtol = float64_model_tols(model.config, temperature=1.0, n_tokens=int(mask.sum()))
    for a, b in zip(padded_grads, packed_grads, strict=True):
        torch.testing.assert_close(b, a, atol=grad_rtol * float(a.abs().max()), rtol=0)


def test_a_lora_model_packs_through_peft(task):
    # PEFT passes the packing arguments through to the base model; the adapters change the numbers.
    from peft import LoraConfig, get_peft_model

    from tearless.models.loading import load_causal_lm

    model = get_peft_model(
        copy.deepcopy(load_causal_lm(task.model_dir)),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    prompt_ids, prompt_mask, response_ids, response_mask = batch(60, seed=6)
    with torch.no_grad():
        padded = response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask)[0]
        packed = response_logprobs(
            model, prompt_ids, prompt_mask, response_ids, response_mask, remove_padding=True
        )[0]
        with model.disable_adapter():
            base = response_logprobs(
                model, prompt_ids, prompt_mask, response_ids, response_mask, remove_padding=True
            )[0]
    from tests.tolerances import logprob_tol

    mask = response_mask.bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=logprob_tol(model.config), rtol=0)
    assert (base[mask] - packed[mask]).abs().max() > 100 * logprob_tol(model.config)


def test_chunked_log_probs_and_entropy_match_the_full_log_softmax_with_their_gradients():
    # 37 tokens in chunks of 5 (the last one of 2) against log_softmax over whole float64 logits.
    from tearless.models.chunked import chunked_logprobs
    from tests.tolerances import log_softmax_tol, sum_tol

    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64) / 4
    y = torch.randint(0, 50, (37,), generator=g)
    gl, ge = (
        torch.randn(37, generator=g, dtype=torch.float64),
        torch.randn(37, generator=g, dtype=torch.float64),
    )
    h64, w64 = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.T / 0.7, -1)
    want_lp, want_ent = logp.gather(-1, y[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)
    want_grads = torch.autograd.grad((want_lp * gl).sum() + (want_ent * ge).sum(), (h64, w64))
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    lp, ent = chunked_logprobs(h32, w32, y, temperature=0.7, chunk=5)
    grads = torch.autograd.grad((lp * gl.float()).sum() + (ent * ge.float()).sum(), (h32, w32))
    # float32 logits: a 16-term dot product of |h||w| ≲ 20 (divided by 0.7), then the float32
    # log-softmax (the entropy has one more vocabulary sum of p·z).
    bound = float((h.abs() @ w.abs().T).max()) / 0.7
    atol = 2 * sum_tol(16, bound) + log_softmax_tol(50, bound)
    torch.testing.assert_close(lp.double(), want_lp, atol=atol, rtol=0)
    torch.testing.assert_close(ent.double(), want_ent, atol=atol + sum_tol(50, bound), rtol=0)
    for a, b in zip(want_grads, grads, strict=True):
        # each entry sums over 37 tokens or 50 vocabulary entries of float32-rounded terms
        torch.testing.assert_close(
            b.double(), a, atol=sum_tol(16 + 50 + 37, float(a.abs().max()) * 10), rtol=0
        )


def test_fused_kernels_give_the_log_probs_entropies_and_gradients_of_the_full_logits():
    from tests.tolerances import entropy_tol, gradient_terms, logprob_tol, sum_tol

    model = tiny("sdpa").float()
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61)
    weight = torch.randn(response_ids.shape, generator=torch.Generator().manual_seed(4))
    params = list(model.parameters())
    seen = []
    hook = model.lm_head.register_forward_hook(lambda _m, _i, out: seen.append(out.shape))

    def run(fused):
        lp, ent = response_logprobs(
            model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=0.7,
            with_entropy="grad", remove_padding=True, fused_kernels=fused,
        )  # fmt: skip
        loss = (lp * weight * response_mask).sum() + 0.1 * (ent * response_mask).sum()
        return lp.detach(), ent.detach(), torch.autograd.grad(loss, params)

    full, full_ent, full_grads = run(False)
    fused, fused_ent, fused_grads = run(True)
    hook.remove()
    assert seen[-1][1] == 1  # the fused pass ran the LM head on one position only
    mask = response_mask.bool()
    torch.testing.assert_close(fused[mask], full[mask], atol=logprob_tol(model.config), rtol=0)
    torch.testing.assert_close(fused_ent[mask], full_ent[mask], atol=entropy_tol(model.config), rtol=0)
    terms = gradient_terms(model.config, int(mask.sum()))
    for a, b in zip(full_grads, fused_grads, strict=True):
        torch.testing.assert_close(b, a, atol=sum_tol(terms, float(a.abs().max()), safety=2), rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_decode_attention_is_sdpa_over_the_cache_with_grouped_heads_and_both_mask_kinds(kv_heads):
    # One query per row against a cache of 37 positions, rows left-padded by 0-5 positions.
    from transformers.integrations.sdpa_attention import repeat_kv

    from tearless.models.packing import decode_attention
    from tests.tolerances import sum_tol

    gen = torch.Generator().manual_seed(3)
    rows, heads, length, dim = 5, 4, 37, 16
    q = torch.randn(rows, heads, 1, dim, generator=gen)
    k = torch.randn(rows, kv_heads, length, dim, generator=gen)
    v = torch.randn(rows, kv_heads, length, dim, generator=gen)
    attend = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    for r in range(rows):
        attend[r, ..., :r] = False
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, repeat_kv(k, heads // kv_heads), repeat_kv(v, heads // kv_heads), attn_mask=attend
    ).transpose(1, 2)
    additive = torch.zeros(attend.shape).masked_fill(~attend, float("-inf"))
    # Scores q·k of |q_i k_i| ≲ 16 terms; softmax-weighted sums of |v| ≲ 4 over 37 positions.
    tol = sum_tol(dim, 16.0) + sum_tol(length, 4.0)
    for mask in (attend, additive):
        out = decode_attention(q, k, v, mask)
        assert out.shape == (rows, 1, heads, dim)
        torch.testing.assert_close(out, ref, atol=tol, rtol=0)
    # Masked positions get no weight: changing their values changes nothing, bit for bit.
    v2 = v.clone()
    v2[1, :, 0] = 1e6  # row 1's first position is padding
    assert torch.equal(decode_attention(q, k, v2, attend)[1], decode_attention(q, k, v, attend)[1])
    # A bf16 query (autocast) is computed in float32 (the same kernels on the same numbers as for its
    # float32 copy) and rounded to bf16 once at the end.
    out = decode_attention(q.bfloat16(), k, v, attend)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, decode_attention(q.bfloat16().float(), k, v, attend).bfloat16())


def test_a_rollout_model_decodes_through_decode_attention_as_sdpa_would():
    # The engine switches an sdpa model to tearless's attention; its decode steps then run
    # decode_attention, and sample the tokens transformers' own sdpa samples (log-probs to rounding).
    from unittest import mock

    from tearless.models import packing
    from tearless.rollout.hf import HFRollout
    from tests.tolerances import logprob_tol

    model = tiny("sdpa")
    reference = copy.deepcopy(model)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    engine = HFRollout(model, eos_token_ids=[1], pad_token_id=0)
    assert model.config._attn_implementation == PACKED_SDPA
    with mock.patch.object(packing, "decode_attention", wraps=packing.decode_attention) as spy:
        out = engine.generate(prompts, n=2, max_new_tokens=70, keys=[1, 2, 3])  # 70: the buffered cache
    # Every token after the first is drawn from a decode forward: one call per layer and step.
    steps = int(out.response_mask.sum(-1).max()) - 1
    assert steps > 10 and spy.call_count >= model.config.num_hidden_layers * steps
    plain = HFRollout(reference, eos_token_ids=[1], pad_token_id=0)
    reference.config._attn_implementation = "sdpa"  # undo the switch: transformers' sdpa throughout
    with mock.patch.object(packing, "decode_attention", side_effect=AssertionError("not sdpa")):
        ref = plain.generate(prompts, n=2, max_new_tokens=70, keys=[1, 2, 3])
    assert torch.equal(out.response_ids, ref.response_ids)
    tol = logprob_tol(model.config)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=tol, rtol=0)
