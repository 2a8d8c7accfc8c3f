"""Log-probs and entropy from logits a chunk of tokens at a time (``entropy_from_logits_with_chunking``):
the same numbers and gradients as the whole-tensor functions, at Qwen2.5's vocabulary of 151,936."""

from __future__ import annotations

import pytest
import torch

from tearless.models.chunked import chunk_tokens, chunked_logits_logprobs
from tearless.models.logprobs import logits_logprobs
from tests.tolerances import eps, log_softmax_tol, sum_tol

QWEN_VOCAB = 151_936


def full(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """The reference: float64 log-softmax of the whole (N, V) tensor."""
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_log_probs_and_entropy_equal_the_whole_tensor_ones_at_qwen_vocabulary(dtype):
    # 150 tokens in chunks of 64 (the last one of 22). bf16 logits are what the GPU's LM head returns:
    # float64 and float32 read the same values, so the difference is float32's own rounding.
    g = torch.Generator().manual_seed(0)
    n, temperature, bound = 150, 0.7, 12.0
    logits = (torch.randn(n, QWEN_VOCAB, generator=g) * 3).clamp(-bound, bound).to(dtype)
    targets = torch.randint(0, QWEN_VOCAB, (n,), generator=g)
    g_lp, g_ent = (
        torch.randn(n, generator=g, dtype=torch.float64),
        torch.randn(n, generator=g, dtype=torch.float64),
    )

    ref_in = logits.double().requires_grad_()
    want_lp, want_ent = full(ref_in, targets, temperature)
    (want_grad,) = torch.autograd.grad((want_lp * g_lp).sum() + (want_ent * g_ent).sum(), ref_in)

    got_in = logits.clone().requires_grad_()
    lp, ent = chunked_logits_logprobs(got_in, targets, temperature=temperature, chunk=64)
    (grad,) = torch.autograd.grad((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum(), got_in)

    z = bound / temperature
    # z_y − lse over V = 151,936 float32 terms (the log-sum-exp's bound, Higham's γ_V), after the
    # division by T (one more rounding of each logit, ≤ u·z, moving lse by as much).
    lp_tol = log_softmax_tol(QWEN_VOCAB, z) + 2 * eps() * z
    torch.testing.assert_close(lp.double(), want_lp, atol=lp_tol, rtol=0)
    # H = lse − Σ p·z: one more float32 sum of V terms of size ≤ z, and p's error (that of lse) times z.
    ent_tol = lp_tol + sum_tol(QWEN_VOCAB, z) + lp_tol * z
    torch.testing.assert_close(ent.double(), want_ent, atol=ent_tol, rtol=0)
    # ∂/∂z_v = (g_lp (1[v=y] − p_v) + g_H p_v (Σp·z − z_v)) / T: p_v off by its relative error (lp_tol),
    # Σp·z by ent_tol; then one rounding to the logits' dtype.
    scale = float(g_lp.abs().max() + g_ent.abs().max() * 2 * z) / temperature
    grad_tol = scale * (lp_tol + ent_tol) + eps(dtype) * float(want_grad.abs().max())
    torch.testing.assert_close(grad.double(), want_grad, atol=grad_tol, rtol=0)
    assert grad.dtype == dtype
    # A wrong temperature or target is far outside these bounds.
    assert (
        chunked_logits_logprobs(logits, targets, chunk=64)[0].double() - want_lp
    ).abs().max() > 100 * lp_tol


def test_the_whole_tensor_path_is_taken_when_one_chunk_holds_the_logits_and_gives_the_same_numbers():
    # The embedded tiny models' logits always fit one chunk: the same functions as before, bit for bit.
    from tearless.algos import entropy_from_logits, logprobs_from_logits

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 9, 40, generator=g)
    targets = torch.randint(0, 40, (4, 9), generator=g)
    assert 4 * 9 <= chunk_tokens(40)
    lp, ent = logits_logprobs(logits, targets, 0.7, True)
    assert torch.equal(lp, logprobs_from_logits(logits / 0.7, targets))
    assert torch.equal(ent, entropy_from_logits(logits / 0.7))
    lp_no, ent_no = logits_logprobs(logits, targets, 0.7, False)
    assert torch.equal(lp_no, lp) and ent_no is None
    # Forced chunking (chunks of 2^24 / 40 tokens: one here) agrees within float32 rounding.
    lp_c, ent_c = logits_logprobs(logits, targets, 0.7, True, chunking=True)
    torch.testing.assert_close(lp_c, lp, atol=log_softmax_tol(40, 12 / 0.7), rtol=0)
    torch.testing.assert_close(ent_c, ent, atol=log_softmax_tol(40, 12 / 0.7) + sum_tol(40, 12 / 0.7), rtol=0)


def test_auto_chunking_starts_past_one_chunk_on_cuda_only_and_checkpointing_takes_the_chunked_function(
    monkeypatch,
):
    import tearless.models.logprobs as logprobs

    calls = []
    real = logprobs.chunked_logits_logprobs
    monkeypatch.setattr(
        logprobs, "chunked_logits_logprobs", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k)
    )
    vocab = 1000
    per_chunk = chunk_tokens(vocab)  # 16,777 tokens
    assert not logprobs.auto_chunked("cuda", per_chunk, vocab)
    assert logprobs.auto_chunked("cuda", per_chunk + 1, vocab)
    assert not logprobs.auto_chunked("cpu", per_chunk + 1, vocab)
    # On CPU an unset key keeps the whole-tensor functions past one chunk; True chunks.
    past = torch.zeros(1, per_chunk + 1, vocab), torch.zeros(1, per_chunk + 1, dtype=torch.long)
    logits_logprobs(*past, 1.0, True)
    assert calls == []
    logits_logprobs(*past, 1.0, True, chunking=True)
    assert calls == [(per_chunk + 1, vocab)]
    targets = past[1][:, :3]
    logits_logprobs(torch.zeros(1, 3, vocab), targets[:, :3], 1.0, "grad", chunking=None, checkpointing=True)
    logits_logprobs(torch.zeros(1, 3, vocab), targets[:, :3], 1.0, True, chunking=False, checkpointing=True)
    assert calls[1:] == [(3, vocab)]  # only the differentiated entropy is checkpointed


@pytest.mark.parametrize("offset", [0.0, 300.0, 1000.0])
def test_the_chunked_entropy_of_logits_far_from_zero_is_as_accurate_as_of_centred_ones(offset):
    # The entropy is shift-invariant, and so must its rounding be: computed as lse(z) − Σ p·z on
    # logits near 300, both terms are ~300 and float32's relative error u of each (p = e^{z − lse}
    # carries u·300 of it) leaves ~u·300² ≈ 5e-3 after the cancellation; after shifting by the row
    # max (s = z − max z ∈ [−8, 0] here) nothing large is ever formed.
    g = torch.Generator().manual_seed(2)
    n, vocab, bound = 64, 1000, 4.0
    logits = (torch.randn(n, vocab, generator=g) * bound / 3).clamp(-bound, bound) + offset
    targets = torch.randint(0, vocab, (n,), generator=g)
    want_lp, want_ent = full(logits, targets, 1.0)
    lp, ent = chunked_logits_logprobs(logits, targets, chunk=16)
    span = 2 * bound
    # The bound of the test above with the shifted logits' size (the span, whatever the offset):
    # lse of V terms in (0, 1], Σ p·s of V terms of total size ≤ span, p's relative error times span.
    lp_tol = log_softmax_tol(vocab, span) + 2 * eps() * span
    ent_tol = lp_tol + sum_tol(vocab, span) + lp_tol * span
    torch.testing.assert_close(ent.double(), want_ent, atol=ent_tol, rtol=0)
    # log p(y) = z_y − lse(z) keeps one rounding of numbers of the offset's size.
    lp_far_tol = log_softmax_tol(vocab, offset + bound) + 2 * eps() * (offset + bound)
    torch.testing.assert_close(lp.double(), want_lp, atol=lp_far_tol, rtol=0)


def test_on_cpu_an_unset_chunking_key_keeps_the_whole_tensor_numbers_of_a_pretrained_vocabulary():
    # SmolLM2's 49,152 logits: one chunk holds 341 tokens and this batch has 4 · 120 = 480. Chunked,
    # the entropy differs from the whole-tensor one by float32 rounding (9.5e-7 measured); a CPU run
    # with the key unset must give the numbers it gave before chunking existed: bit for bit.
    from transformers import LlamaConfig, LlamaForCausalLM

    from tearless.models.logprobs import response_logprobs

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49_152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    rows, p_len, r_len = 4, 16, 120
    assert rows * r_len > chunk_tokens(config.vocab_size)
    batch = (
        torch.randint(0, config.vocab_size, (rows, p_len), generator=g),
        torch.ones(rows, p_len, dtype=torch.long),
        torch.randint(0, config.vocab_size, (rows, r_len), generator=g),
        torch.ones(rows, r_len, dtype=torch.long),
    )
    with torch.no_grad():
        unset = response_logprobs(model, *batch, temperature=0.7, with_entropy=True)
        whole = response_logprobs(model, *batch, temperature=0.7, with_entropy=True, entropy_chunking=False)
    assert torch.equal(unset[0], whole[0]) and torch.equal(unset[1], whole[1])
