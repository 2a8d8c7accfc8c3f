"""Log-probs and entropy straight from hidden states, a chunk of tokens at a time (veRL's
``use_fused_kernels``, its torch backend): the (tokens × vocabulary) float32 logits are never
materialised at once, neither in the forward nor in the backward.

For N tokens with final hidden states h (N, d), LM-head weight W (V, d), temperature τ and targets y:

    z = h Wᵀ / τ,   log p(y) = z_y − lse(z),   H = lse(z) − Σ_v p_v z_v   (p = softmax z).

The forward keeps only h, W, y and two numbers per token (lse and H); the backward recomputes each
chunk's z and uses

    ∂ log p(y)/∂z = onehot(y) − p,   ∂H/∂z_j = p_j (Σ_v p_v z_v − z_j),

then ∂/∂(hWᵀ) = ∂/∂z / τ, ∂h = ∂(hWᵀ) W and ∂W = ∂(hWᵀ)ᵀ h, chunk by chunk. Peak extra memory is
a few (chunk × V) float32 blocks instead of several (N × V) ones (logits, their float32 copy, the
log-softmax and its gradient).

Under CPU autocast (bf16 compute, :mod:`tearless.models.precision`) the products h Wᵀ, ∂z W and
∂zᵀ h run in bf16 as the LM head's own matmul would, each result upcast at once: the log-sum-exp,
the softmax, the entropy and the gradients' accumulation stay float32.
"""

from __future__ import annotations

import torch

from tearless.models.precision import active_dtype

# Elements of one chunk's float32 logits (64 MiB): 111 tokens of a 151,936-token vocabulary.
CHUNK_ELEMENTS = 1 << 24


def chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk so that one chunk's logits hold about :data:`CHUNK_ELEMENTS` floats."""
    return max(1, CHUNK_ELEMENTS // max(vocab_size, 1))


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):
        n = hidden.shape[0]
        log_prob = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32)
        lse = hidden.new_empty(n, dtype=torch.float32)
        # The matmuls' dtype: autocast's (bf16) when it is on, else float32; explicit, autocast off.
        ctx.mm_dtype = active_dtype(hidden.device.type) or torch.float32
        w = weight.to(ctx.mm_dtype)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z = _mm(hidden[start:end], w.T, ctx.mm_dtype) / temperature
            lse[start:end] = torch.logsumexp(z, dim=-1)
            log_prob[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - lse[start:end]
            p = torch.exp(z - lse[start:end, None])
            entropy[start:end] = lse[start:end] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
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
            p = torch.exp(z - lse[start:end, None])
            grad_z = torch.zeros_like(z)
            if grad_log_prob is not None:
                g = grad_log_prob[start:end, None]
                grad_z -= g * p
                grad_z.scatter_add_(-1, targets[start:end, None], g)
            if grad_entropy is not None:
                mean_z = (lse[start:end] - entropy[start:end])[:, None]  # Σ_v p_v z_v = lse − H
                grad_z += grad_entropy[start:end, None] * p * (mean_z - z)
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
