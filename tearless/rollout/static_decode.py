"""The GPU decode loop: one row per sample, static shapes, no host synchronisation per token, and the
decode step's forward optionally replayed as a CUDA graph.

The CPU loop (:meth:`tearless.rollout.hf.HFRollout._decode`) saves work by reading results on the host
at every token: finished rows leave the batch (a boolean index), samples of a prompt share a model
row until they draw different tokens (``torch.unique``). On a GPU each such read stalls the host
until the device has finished the step, and the many small kernels of a decode step are then
launched one after the other from an idle queue. This loop instead:

- prefills every sample's row (prompts × n) into a transformers ``StaticCache`` of
  ``prompt width + max_new_tokens`` positions, whose layers write each step's keys and values at a
  position counter held on the device;
- keeps every row in the batch to the end: a finished row keeps drawing, but its tokens are masked
  (pad, mask 0, log-prob 0) exactly as the CPU loop leaves them;
- attends through a (B, 1, 1, capacity) boolean mask (prompt padding off, positions up to the
  current one on) updated in place, so every step has the same shapes;
- asks the host whether every row has finished only every :data:`CHECK_EVERY` tokens (one read per
  16 tokens instead of several per token).

With those static shapes and addresses the decode step's forward is captured once per call as a
CUDA graph (``torch.cuda.CUDAGraph``) and replayed for every following token: one launch instead
of hundreds. Sampling (:func:`tearless.rollout.decode_step.sample_step`) stays eager and sync-free.

Tokens, log-probs and entropies are those of the CPU loop: the same per-sample uniforms
(:mod:`tearless.rollout.seeds`), the same fused sampling maths, so up to the rounding of another
batch composition and cache layout the same responses (tests compare the two on CPU).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import FSDPModule

from tearless.models.compat import cache_kwargs
from tearless.models.loading import compute_device
from tearless.rollout.decode_step import sample_step

CHECK_EVERY = 16  # tokens between two host reads of "has every row finished?"


def decode_static(
    model: torch.nn.Module,
    ids: torch.Tensor,
    attn: torch.Tensor,
    draws: torch.Tensor | None,
    max_new_tokens: int,
    *,
    pad_token_id: int,
    eos: torch.Tensor,
    sampling: dict,
    stop_sequences: list[list[int]] | None,
    version: int,
    graphs: bool,
) -> tuple[torch.Tensor, ...]:
    """(B, T) tokens, log-probs, entropies, mask and token versions and the (B,) EOS flags, as
    :meth:`~tearless.rollout.hf.HFRollout._decode` returns them, T ≤ ``max_new_tokens``, for the B
    left-padded sample rows ``ids``/``attn`` (B, P) (a prompt's n samples adjacent). ``draws`` (B,
    max_new_tokens) are the samples' uniforms (:mod:`tearless.rollout.seeds`), None for greedy;
    ``sampling`` holds ``temperature``, ``top_k`` and ``top_p``; ``graphs`` replays the decode step's
    forward as a CUDA graph (GPU only)."""
    from transformers import StaticCache

    device = compute_device(model)
    ids, attn = ids.to(device), attn.to(device)
    batch, width = ids.shape
    capacity = width + max_new_tokens
    draws = None if draws is None else draws.to(device)
    eos = eos.to(device)
    stops = [torch.tensor(s, dtype=torch.long, device=device) for s in stop_sequences or () if s]
    cache = StaticCache(config=model.config, max_cache_len=capacity)
    # Every full-attention layer stores keys and values in one dtype chosen once (transformers' own
    # layer takes the first keys' dtype, and rotary embeddings hand it float32 keys beside bf16 values
    # under autocast).
    layer = _one_dtype_layer_class()
    cache.layers = [
        layer(max_cache_len=capacity) if type(x).__name__ == "StaticLayer" else x for x in cache.layers
    ]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids,
        attention_mask=attn,
        position_ids=positions,
        logits_to_keep=1,
        **cache_kwargs(model, cache),
    )
    logits = out.logits[:, -1, :].float()
    step = DecodeStep(model, cache, attn, positions[:, -1:] + 1, capacity, graphs=graphs)
    tokens = torch.full((batch, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    logps = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    ents = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    mask = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    rows = torch.arange(batch, device=device)
    pad = torch.tensor(pad_token_id, device=device)
    for t in range(max_new_tokens):
        u = draws[:, t] if draws is not None else None
        tok, lp, ent = sample_step(logits, rows, u, **sampling, in_order=True)
        live = ~finished
        tok = torch.where(live, tok, pad)
        tokens[:, t] = tok
        logps[:, t] = torch.where(live, lp, 0.0)
        ents[:, t] = torch.where(live, ent, 0.0)
        mask[:, t] = live.long()
        done = torch.isin(tok, eos)
        for stop in stops:
            if len(stop) <= t + 1:
                done |= (tokens[:, t + 1 - len(stop) : t + 1] == stop).all(-1)
        finished |= live & done
        if t == max_new_tokens - 1 or ((t + 1) % CHECK_EVERY == 0 and bool(finished.all())):
            break
        logits = step(tok, width + t)
    used = int(mask.sum(-1).max()) if batch else 0  # the one read of the lengths, at the end
    versions = mask[:, :used] * version
    return tokens[:, :used], logps[:, :used], ents[:, :used], mask[:, :used], finished, versions


class DecodeStep:
    """The forward of one decode position for every row, over fixed buffers: the step's tokens (B, 1),
    position ids (B, 1) and the (B, 1, 1, capacity) attention mask, into the static cache. With
    ``graphs``, the first call runs eagerly (it also warms the kernels up, on a side stream), the second
    is captured as a CUDA graph and every call from then on replays it."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache,
        prompt_mask: torch.Tensor,
        next_positions: torch.Tensor,
        capacity: int,
        *,
        graphs: bool,
    ) -> None:
        device = prompt_mask.device
        batch, width = prompt_mask.shape
        self.model, self.cache = model, cache
        self.kwargs = cache_kwargs(model, cache)
        self.tok = torch.zeros((batch, 1), dtype=torch.long, device=device)
        self.positions = next_positions.clone()
        self.mask = torch.zeros((batch, 1, 1, capacity), dtype=torch.bool, device=device)
        self.mask[:, 0, 0, :width] = prompt_mask.bool()
        # FSDP's hooks (and CPU-offloaded shards) copy between devices inside the forward, which a
        # graph cannot capture: a sharded model decodes eagerly.
        self.graphs = graphs and device.type == "cuda" and not isinstance(model, FSDPModule)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.calls = 0
        self.logits: torch.Tensor | None = None

    def _forward(self) -> torch.Tensor:
        out = self.model(
            input_ids=self.tok, attention_mask=self.mask, position_ids=self.positions, **self.kwargs
        )
        return out.logits[:, -1, :].float()

    def __call__(self, tok: torch.Tensor, column: int) -> torch.Tensor:
        """Logits (B, V) of the position after ``tok`` (B,), which sits at cache column ``column``."""
        self.tok.copy_(tok[:, None])
        self.mask[:, 0, 0, column] = True
        if self.calls:
            self.positions += 1
        self.calls += 1
        if not self.graphs:
            return self._forward()
        if self.graph is not None:
            self.graph.replay()
            return self.logits.clone()
        if self.calls == 1:  # warm-up: run on a side stream, as capture requires of first launches
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                logits = self._forward()
            torch.cuda.current_stream().wait_stream(stream)
            return logits
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self.graph.replay()
        return self.logits.clone()


def cache_dtype(key_states: torch.Tensor) -> torch.dtype:
    """The dtype a decode cache stores: autocast's on a GPU (what SDPA casts keys and values to anyway,
    so nothing is lost), float32 for reduced-precision keys on CPU (the CPU decode attention computes
    in float32, :func:`tearless.models.packing.decode_attention`), else the keys' own."""
    if key_states.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    if not key_states.is_cuda and key_states.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return key_states.dtype


@functools.cache
def _one_dtype_layer_class() -> type:
    from transformers.cache_utils import StaticLayer

    class OneDtypeStaticLayer(StaticLayer):
        """transformers' ``StaticLayer`` with keys and values cast to one dtype (:func:`cache_dtype`)."""

        def update(self, key_states, value_states, *args, **kwargs):
            dtype = self.keys.dtype if self.is_initialized else cache_dtype(key_states)
            return super().update(key_states.to(dtype), value_states.to(dtype), *args, **kwargs)

    return OneDtypeStaticLayer
