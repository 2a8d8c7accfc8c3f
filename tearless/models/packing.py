"""Padding-free forwards (veRL's ``use_remove_padding``): a micro-batch's valid tokens in one row.

A batch of B left-padded prompts and right-padded responses, (B, P + R) columns, holds
T = Σ_i (p_i + ℓ_i − 1) tokens that matter (row i's p_i prompt tokens and all but the last of its ℓ_i
attended response tokens; the last is only ever a target). :func:`pack_rows` lays them end to end
in one row (1, T), each sequence with its own position ids 0 … n_i − 1, and records where each
response token's predicting position landed, so that log-probs, entropies and values come back as
(B, R) tensors, zero past each row's attended length. The linear layers, the MLPs and the LM head
then see only these T tokens instead of B · (P + R).

Attention must stay within a sequence (block-diagonal causal). How depends on the model's
``attn_implementation``:

- ``flash_attention_2`` / ``flash_attention_3`` (GPU): the cumulative lengths are passed as
  transformers' ``FlashAttentionKwargs`` (``cu_seq_lens_q``/``cu_seq_lens_k``, ``max_length_q``/
  ``max_length_k``) and flash-attention's variable-length kernel runs on the packed row.
- ``sdpa`` on a GPU in bf16/fp16: torch's own variable-length flash kernel
  (``torch.nn.attention.varlen.varlen_attn``, torch ≥ 2.10, no extra package) on the packed row
  (:func:`varlen_causal`).
- ``sdpa`` otherwise (the default, and the CPU case): transformers would detect the packing from the
  position ids and build a (T × T) block mask, which makes attention quadratic in the *batch's*
  token count (measured 2.5–3× slower than the padded forward on this CPU). Instead the model is
  switched to :data:`PACKED_SDPA`, an attention function that scatters the packed queries, keys and
  values into one right-padded (n, heads, max n_i, d) block, runs PyTorch's causal
  ``scaled_dot_product_attention`` without any mask (its fastest kernel) and gathers the result
  back: the per-token work is padding-free and attention costs what it costs per sequence. Forwards
  without the packing arguments (rollout, the padded path) go to plain ``sdpa`` unchanged.
- anything else (``eager``, sliding-window or soft-capped attention): position ids only, and
  transformers' own packed-sequence detection builds the block mask.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from dataclasses import dataclass

import torch

PACKED_SDPA = "tearless_packed_sdpa"
FLASH = (
    "flash_attention_2",
    "flash_attention_3",
    "kernels-community/flash-attn",
    "kernels-community/flash-attn3",
)

# Set while a packed forward builds its masks: the packed-sdpa mask function then returns no mask.
_PACKED = contextvars.ContextVar("tearless_packed", default=False)


@dataclass
class PackedRows:
    """One packed row and the map back to (B, R).

    ``input_ids``/``position_ids``: (1, T). ``cu_seqlens``: (n + 1,) int32 offsets of the n packed
    sequences (rows with no attended response token are left out). ``rows``/``cols``: (K,) the row
    and response column of each returned value, K = Σ ℓ_i; ``keep``: (K,) the packed position whose
    output predicts it (row i's response column t is read at its segment start + p_i − 1 + t).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int
    rows: torch.Tensor
    cols: torch.Tensor
    keep: torch.Tensor

    def unpack(self, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """(K,) per-token values → (B, R), zero elsewhere (differentiable)."""
        out = values.new_zeros(shape)
        return out.index_put((self.rows, self.cols), values)


def packable(prompt_mask: torch.Tensor, response_mask: torch.Tensor, lengths: torch.Tensor) -> bool:
    """True when every row is the layout :func:`pack_rows` assumes: a non-empty left-padded prompt
    (its ones end at the last column) and response ones without holes (as many as the attended length),
    and at least one row has a response token."""
    if prompt_mask.shape[0] == 0:
        return False
    p = prompt_mask.bool()
    # One read of one flag (not one per condition): a micro-batch's pass reads the host once here.
    ok = (
        (lengths.max() > 0)  # else nothing to forward: the padded pass's zeros
        & (p.sum(-1) > 0).all()
        & p[:, -1].all()
        & (p.int().diff(dim=-1) >= 0).all()
        & (response_mask.bool().sum(-1) == lengths).all()
    )
    return bool(ok)


def pack_rows(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, lengths: torch.Tensor
) -> PackedRows:
    """Pack each row's prompt tokens and its first ℓ_i − 1 response tokens (see the module docstring)."""
    device = prompt_ids.device
    lengths = lengths.to(device)
    width = response_ids.shape[1]
    live = lengths > 0
    columns = torch.arange(max(width - 1, 0), device=device)
    mask = torch.cat([prompt_mask.bool() & live[:, None], columns[None] < (lengths - 1)[:, None]], dim=1)
    ids = torch.cat([prompt_ids, response_ids[:, : width - 1]], dim=1)
    flat = ids[mask][None]
    positions = (mask.cumsum(-1) - 1)[mask][None]
    n = mask.sum(-1)
    starts = torch.cumsum(n, 0) - n
    p = prompt_mask.bool().sum(-1)
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    cols = torch.arange(len(rows), device=device) - offsets[rows]
    keep = starts[rows] + p[rows] - 1 + cols
    seq = n[live]
    cu = torch.nn.functional.pad(torch.cumsum(seq, 0), (1, 0)).to(torch.int32)
    return PackedRows(flat, positions, cu, int(seq.max()) if len(seq) else 0, rows, cols, keep)


def packed_forward(model: torch.nn.Module, packed: PackedRows, **kwargs):
    """``model(...)`` on the packed row with the attention arguments its implementation needs."""
    config = model.config
    impl = config._attn_implementation
    if impl == "sdpa" and _emulation_ok(config):
        use_packed_sdpa(model)
        impl = PACKED_SDPA
    args = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False, **kwargs)
    if impl in FLASH or impl == PACKED_SDPA:
        args.update(
            cu_seq_lens_q=packed.cu_seqlens,
            cu_seq_lens_k=packed.cu_seqlens,
            max_length_q=packed.max_length,
            max_length_k=packed.max_length,
        )
    with _packing():
        return model(**args)


@contextlib.contextmanager
def _packing():
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _emulation_ok(config) -> bool:
    """Plain causal attention (no sliding window, no soft-capping): what :func:`packed_sdpa` computes."""
    window = getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True
    )
    return not window and getattr(config, "attn_logit_softcapping", None) is None


def use_tearless_attention(model: torch.nn.Module) -> None:
    """Switch an ``sdpa`` model with plain causal attention to :func:`packed_sdpa` (packed rows and
    decode steps; every other forward unchanged); other models are left alone."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and _emulation_ok(config):
        use_packed_sdpa(model)


def use_packed_sdpa(model: torch.nn.Module) -> None:
    """Register :func:`packed_sdpa` with transformers and switch ``model`` (an ``sdpa`` model) to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if PACKED_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        sdpa_mask = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]

        def mask(*args, **kwargs):
            # In a packed forward the attention needs no mask at all (it re-pads per sequence).
            return None if _PACKED.get() else sdpa_mask(*args, **kwargs)

        AttentionInterface.register(PACKED_SDPA, packed_sdpa)
        AttentionMaskInterface.register(PACKED_SDPA, mask)
    if model.config._attn_implementation != PACKED_SDPA:
        model.config._attn_implementation = PACKED_SDPA


def packed_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """tearless's attention for ``sdpa`` models: packed rows, decode steps, else transformers' sdpa.

    Attention of a packed row (1, heads, T, d) given ``cu_seq_lens_q``: per-sequence causal SDPA.

    The T tokens are scattered into (n, heads, L, d), L = the longest sequence, each sequence from
    column 0 (right padding, so the causal mask alone keeps every real query off the padding), run
    through ``scaled_dot_product_attention(is_causal=True)`` and gathered back, (1, T, heads, d).
    One query per row without autograd on CPU (a decode step of the rollout engine):
    :func:`decode_attention`. Any other forward is transformers' ``sdpa``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    decoding = query.shape[2] == 1 and not module.training and not torch.is_grad_enabled()
    if cu is None and decoding and query.device.type == "cpu":  # GPU SDPA kernels are fast in bf16
        return decode_attention(query, key, value, attention_mask, scaling), None
    if cu is None or query.shape[0] != 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if varlen_ready(query, dropout if module.training else 0.0):
        return varlen_causal(query, key, value, cu, kwargs.get("max_length_q"), scaling), None
    cu = cu.to(query.device).long()
    lengths = cu.diff()
    n, longest, tokens = len(lengths), int(kwargs.get("max_length_q") or lengths.max()), query.shape[2]
    seq = torch.repeat_interleave(torch.arange(n, device=query.device), lengths, output_size=tokens)
    dest = seq * longest + torch.arange(tokens, device=query.device) - cu[:-1][seq]

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape[1], n * longest, x.shape[3]).index_copy(1, dest, x[0])
        return out.view(x.shape[1], n, longest, x.shape[3]).transpose(0, 1)

    k, v = pad(key), pad(value)
    if k.shape[1] != query.shape[1]:  # grouped-query attention: each KV head serves a group of queries
        k = k.repeat_interleave(query.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(query.shape[1] // v.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(
        pad(query), k, v, is_causal=True, scale=scaling, dropout_p=dropout if module.training else 0.0
    )
    out = out.transpose(0, 1).reshape(query.shape[1], n * longest, query.shape[3]).index_select(1, dest)
    return out.transpose(0, 1)[None].contiguous(), None


@functools.cache
def _varlen_attn():
    """torch's own variable-length (flash) attention, ``torch.nn.attention.varlen.varlen_attn``
    (torch ≥ 2.10; CUDA only), and how its version asks for causal masking; None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in params


def flash_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half-precision dtype flash attention would read ``query`` in: its own (bf16/fp16), or, for a
    float32 query under CUDA autocast (rotary embeddings in float32 promote the projections' bf16
    outputs), autocast's, which is what SDPA would cast it to; None otherwise."""
    half = (torch.bfloat16, torch.float16)
    if query.dtype in half:
        return query.dtype
    if query.is_cuda and torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in half:
        return torch.get_autocast_dtype("cuda")
    return None


def varlen_ready(query: torch.Tensor, dropout: float) -> bool:
    """Whether a packed row's attention can run torch's varlen kernel: a CUDA tensor computed in
    bf16/fp16 (flash attention's dtypes, :func:`flash_dtype`), no dropout, and a torch that has the
    kernel."""
    return query.is_cuda and flash_dtype(query) is not None and dropout == 0.0 and _varlen_attn() is not None


def varlen_causal(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_length: int | None,
    scaling: float | None,
) -> torch.Tensor:
    """Block-diagonal causal attention of a packed row through ``varlen_attn``: (1, heads, T, d)
    queries, (1, kv heads, T, d) keys and values, sequences cut at ``cu_seqlens`` (n + 1,); returns
    (1, T, heads, d) in :func:`flash_dtype` (as SDPA under autocast returns it). The same function as
    :func:`packed_sdpa`'s re-padded SDPA, without padding: flash attention reads each sequence's own
    keys only."""
    varlen_attn, causal, gqa = _varlen_attn()
    dtype = flash_dtype(query)
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # (T, heads, d)
    extra = dict(causal)
    if k.shape[1] != q.shape[1]:
        if gqa:
            extra["enable_gqa"] = True
        else:  # grouped-query attention by hand: each KV head serves a group of query heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    longest = int(max_length) if max_length else int(cu.diff().max())
    out = varlen_attn(
        q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, longest, longest, scale=scaling, **extra
    )
    return out[None]


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
) -> torch.Tensor:
    r"""One decode step's attention in float32 (float64 for a float64 model): (B, heads, 1, d)
    queries against (B, kv heads, T, d) cached keys and values; returns (B, 1, heads, d) in the
    query's dtype.

    :math:`o = \mathrm{softmax}(s \, q K^\top + m) V` with :math:`s` = ``scaling`` (default
    :math:`d^{-1/2}`) and :math:`m` the mask (boolean: True attends; or additive), as two batched
    matmuls and a softmax, autocast off. Grouped-query attention multiplies each KV head's keys by
    its group of query heads at once (no repeated keys). Measured on this project's CPU (one
    thread, 64–256 rows against 79–270 cached positions, BENCHMARKS.md "Decode attention"):
    1.0–1.7× the speed of ``scaled_dot_product_attention`` over the engine's former (B, capacity,
    H, D) float32 buffers, 2.4–5× over a bf16 cache (autocast); equal to it to float32 rounding.
    """
    rows, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    work = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for a float64 model
    with torch.autocast(query.device.type, enabled=False):
        q = query.to(work).reshape(rows, kv_heads, heads // kv_heads, dim)
        scores = torch.matmul(q, key.to(work).transpose(-1, -2)) * (dim**-0.5 if scaling is None else scaling)
        if attention_mask is not None:
            mask = attention_mask[..., :length]
            if mask.dtype == torch.bool:
                scores = scores.masked_fill(~mask, float("-inf"))
            else:
                scores = scores + mask.to(work)
        out = torch.matmul(torch.softmax(scores, dim=-1), value.to(work))
    return out.reshape(rows, heads, 1, dim).transpose(1, 2).to(query.dtype).contiguous()
