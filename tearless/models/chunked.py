"""Log-probs and entropy a chunk of tokens at a time, so that the (tokens × vocabulary) float32 logits
are never materialised at once, neither in the forward nor in the backward: straight from the final
hidden states (:func:`chunked_logprobs`, veRL's ``use_fused_kernels``, its torch backend), or from
logits the model already formed in its own dtype (:func:`chunked_logits_logprobs`, veRL's
``entropy_from_logits_with_chunking`` / ``entropy_checkpointing``: a bf16 (N × V) tensor is not
copied to float32 whole, and the softmax is recomputed per chunk in the backward instead of kept).

For N tokens with final hidden states h (N, d), LM-head weight W (V, d), temperature τ and targets y:

    z = h Wᵀ / τ,   log p(y) = z_y − lse(z),   H = lse(z) − Σ_v p_v z_v   (p = softmax z),

H evaluated on the row-max-shifted s = z − max z (the same value, without the cancellation of two
terms of z's size).

The forward keeps only h, W, y and two numbers per token (lse and H); the backward recomputes each
chunk's z and uses

    ∂ log p(y)/∂z = onehot(y) − p,   ∂H/∂z_j = p_j (Σ_v p_v z_v − z_j),

then ∂/∂(hWᵀ) = ∂/∂z / τ, ∂h = ∂(hWᵀ) W and ∂W = ∂(hWᵀ)ᵀ h, chunk by chunk. Peak extra memory is
a few (chunk × V) float32 blocks instead of several (N × V) ones (logits, their float32 copy, the
log-softmax and its gradient).

Under CPU autocast (bf16 compute, :mod:`tearless.models.precision`) the products h Wᵀ, ∂z W and
∂zᵀ h run in bf16 as the LM head's own matmul would, each result upcast at once: the log-sum-exp,
the softmax, the entropy and the gradients' accumulation stay float32.

Both share the per-chunk maths: :func:`_chunk_stats` (lse, log p(y), H of one chunk of float32 logits)
and :func:`_chunk_grad` (∂/∂z of g_lp · log p(y) + g_H · H).
"""

from __future__ import annotations

import torch

from tearless.models.precision import active_dtype

# Elements of one chunk's float32 logits (64 MiB): 111 tokens of a 151,936-token vocabulary.
CHUNK_ELEMENTS = 1 << 24


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one chunk's logits hold about :data:`CHUNK_ELEMENTS` floats."""
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


def _float32_rows(like: torch.Tensor, n: int, count: int) -> list[torch.Tensor]:
    """``count`` uninitialised (n,) float32 tensors on ``like``'s device: a forward's per-row outputs."""
    return [like.new_empty(n, dtype=torch.float32) for _ in range(count)]


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):
        n = hidden.shape[0]
        log_prob, entropy, lse = _float32_rows(hidden, n, 3)
        # The matmuls' dtype: autocast's (bf16) when it is on, else float32; explicit, autocast off.
        ctx.mm_dtype = active_dtype(hidden.device.type) or torch.float32
        w = weight.to(ctx.mm_dtype)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z = _mm(hidden[start:end], w.T, ctx.mm_dtype) / temperature
            lse[start:end], log_prob[start:end], entropy[start:end] = _chunk_stats(z, targets[start:end])
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        # An output the loss does not use (the entropy, with no entropy bonus) gets None, not zeros.
        ctx.set_materialize_grads(False)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(lse)
        return log_prob, entropy, lse

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy, _):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        w = weight.to(ctx.mm_dtype)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:end]
            z = _mm(h, w.T, ctx.mm_dtype) / ctx.temperature
            grad_z = _chunk_grad(
                z, targets[start:end], lse[start:end], entropy[start:end],
                None if grad_log_prob is None else grad_log_prob[start:end],
                None if grad_entropy is None else grad_entropy[start:end],
            )  # fmt: skip
            grad_z /= ctx.temperature
            if grad_hidden is not None:
                grad_hidden[start:end] = _mm(grad_z, w, ctx.mm_dtype)
            if grad_weight is not None:
                grad_weight += _mm(grad_z.T, h, ctx.mm_dtype)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None,
            None,
            None,
        )


def _chunk_stats(
    z: torch.Tensor, targets: torch.Tensor, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""(lse, log p(y), H), each (n,), of float32 logits z (n, V): lse = log Σ_v e^{z_v},
    log p(y) = z_y − lse, H = lse − Σ_v p_v z_v (zeros unless ``with_entropy``: a softmax pass saved).

    H is taken on s = z − max_v z_v (H is shift-invariant): H = lse(s) − Σ_v p_v s_v, p = e^{s − lse(s)},
    and lse = max z + lse(s), the sum torch.logsumexp forms (the same float32 operations).
    """
    top = z.amax(dim=-1, keepdim=True)
    s = z - top
    lse_s = torch.logsumexp(s, dim=-1)
    lse = top.squeeze(-1) + lse_s
    log_prob = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    if not with_entropy:
        return lse, log_prob, torch.zeros_like(lse)
    # Both terms on the unshifted z are of z's size (~300 for logits offset by 300): float32 keeps
    # u·300 of each, and p = e^{z − lse} as much again, ~u·300² ≈ 5e-3 left after they cancel.
    p = torch.exp(s - lse_s[:, None])
    return lse, log_prob, lse_s - (p * s).sum(-1)


def _chunk_grad(
    z: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_log_prob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
) -> torch.Tensor:
    r"""∂/∂z of Σ g_lp · log p(y) + g_H · H for one chunk: g_lp (onehot(y) − p) + g_H p (Σ_v p_v z_v − z),
    with Σ_v p_v z_v = lse − H."""
    p = torch.exp(z - lse[:, None])
    grad_z = torch.zeros_like(z)
    if grad_log_prob is not None:
        g = grad_log_prob[:, None]
        grad_z -= g * p
        grad_z.scatter_add_(-1, targets[:, None], g)
    if grad_entropy is not None:
        grad_z += grad_entropy[:, None] * p * ((lse - entropy)[:, None] - z)
    return grad_z


class _ChunkedLogitsLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk, with_entropy):
        n = logits.shape[0]
        log_prob, entropy, lse = _float32_rows(logits, n, 3)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z = logits[start:end].float() / temperature
            lse[start:end], log_prob[start:end], entropy[start:end] = _chunk_stats(
                z, targets[start:end], with_entropy
            )
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk):
            end = min(start + ctx.chunk, logits.shape[0])
            z = logits[start:end].float() / ctx.temperature
            grad_z = _chunk_grad(
                z, targets[start:end], lse[start:end], entropy[start:end],
                None if grad_log_prob is None else grad_log_prob[start:end],
                None if grad_entropy is None else grad_entropy[start:end],
            )  # fmt: skip
            grad[start:end] = grad_z / ctx.temperature
        return grad, None, None, None, None


def chunked_logits_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int | None = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None), each (N,) float32, of ``logits`` (N, V) (any float dtype) divided by
    ``temperature``, ``chunk`` tokens at a time (default :func:`chunk_tokens`): no (N, V) float32 copy,
    log-softmax or softmax is formed whole, and the backward recomputes each chunk's softmax from
    ``logits`` (the one (N, V) tensor kept) rather than storing it. The gradient with respect to
    ``logits`` comes in their dtype; the entropy's costs nothing unless it is used.
    """
    chunk = chunk or chunk_tokens(logits.shape[-1])
    log_prob, entropy = _ChunkedLogitsLogProbs.apply(logits, targets, float(temperature), chunk, with_entropy)
    return log_prob, (entropy if with_entropy else None)


def _mm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with both operands in ``dtype`` (autocast off), the result in float32."""
    with torch.autocast(a.device.type, enabled=False):
        return (a.to(dtype) @ b.to(dtype)).float()


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy), each (N,) float32, of logits ``hidden @ weight.T / temperature``.

    ``hidden`` (N, d), ``weight`` (V, d) (the LM head, no bias), ``targets`` (N,) int64; ``chunk``
    tokens at a time (default :func:`chunk_tokens`). Both outputs are differentiable with respect to
    ``hidden`` and ``weight``; the entropy's gradient costs nothing unless it is used.
    """
    chunk = chunk or chunk_tokens(weight.shape[0])
    log_prob, entropy, _ = _ChunkedLogProbs.apply(hidden, weight, targets, float(temperature), chunk)
    return log_prob, entropy
