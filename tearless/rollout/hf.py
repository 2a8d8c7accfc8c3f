"""The built-in rollout engine: batched sampling with a KV cache over a Hugging Face model's forward.

It is a hand-written decode loop rather than ``model.generate`` because on small models the
per-step Python overhead of ``generate`` dominates (1.1-1.7x slower on this machine) and because
the loop returns exactly what RL needs: response ids, the response mask and the per-token
log-probabilities of the sampled tokens under the temperature-scaled distribution.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import torch

from tearless.models.compat import cache_kwargs
from tearless.models.loading import compute_device
from tearless.models.mrope import prompt_rope, sequence_positions
from tearless.models.packing import use_tearless_attention
from tearless.models.precision import autocast, forward_only
from tearless.models.vision import forward_pixels, stack_pixels
from tearless.rollout.decode_step import filter_logits, sample_step
from tearless.rollout.engine import Capabilities, RolloutOutput, concat_rollouts, left_pad, select_rows
from tearless.rollout.seeds import sample_keys, uniforms
from tearless.rollout.static_decode import decode_static

__all__ = ["HFRollout", "RolloutOutput", "concat_rollouts", "filter_logits", "left_pad", "select_rows"]


class HFRollout:
    """Sample responses from a causal LM with a KV cache.

    Log-probs are those of the temperature-scaled, unfiltered distribution, which is what the actor
    recomputes for the PPO ratio (top-k/top-p only change which tokens can be drawn).
    """

    # It samples from the model it is given (the trained one, hybrid), with the trainer's forward.
    capabilities = Capabilities(
        holds_own_weights=False,
        exact_log_probs=True,
        records_versions=True,
        resumes_partial=True,
        multi_turn=True,
        raw_images=False,
    )

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        compute_dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.model = model
        # On GPU: the static loop (rollout.static_decode), its decode step replayed as a CUDA graph
        # unless cuda_graphs is off (rollout.enforce_eager). static_loop None = on GPU only.
        self.cuda_graphs = cuda_graphs
        self.static_loop: bool | None = None
        use_tearless_attention(model)  # decode steps in float32 matmul attention (packing.decode_attention)
        # bf16: the decode loop's forwards run under CPU autocast (tearless.models.precision); the
        # sampling distribution is computed from logits upcast to float32.
        self.compute_dtype = compute_dtype
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long)
        self.pad_token_id = pad_token_id

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy named tensors (the plain model's state-dict names) into the sampled model: how a
        separate rollout worker takes the policy broadcast after each update."""
        state = self.model.state_dict()
        for name, tensor in weights:
            state[name].copy_(tensor)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int = 1,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        do_sample: bool = True,
        keys: Sequence[int] | None = None,
        stop_sequences: list[list[int]] | None = None,
        version: int = 0,
        between_tokens: Callable[[], int | None] | None = None,
        vision: Sequence[dict[str, torch.Tensor]] | None = None,
    ) -> RolloutOutput:
        """Return ``n`` responses per prompt (rows of a prompt adjacent), at most ``max_new_tokens`` each.

        Each prompt is prefilled once; its ``n`` samples then share one model row for as long as
        they have drawn the same tokens (see ``_decode``); rows that have emitted EOS leave the
        decode batch; no forward pass runs after the last token.

        A response ends at an EOS token or, when ``stop_sequences`` are given, right after it has
        produced one of those token sequences (kept in the response, like an EOS).

        ``keys`` (one per prompt, :mod:`tearless.rollout.seeds`) fix each sample's random numbers:
        sample j of prompt i draws the tokens its key ``mix(keys[i], j)`` gives, in any batch. Without
        them, keys are drawn from torch's global generator.

        Partial rollouts: ``between_tokens``, when given, is called before every forward of the decode
        loop (after the tokens of a position are drawn, before the logits of the next one). It returns
        None, or the policy version of new weights it has just loaded into the model; then every live
        response is re-prefilled (prompt + the tokens drawn so far) under the new weights and continues
        from there, keeping the log-probs of the tokens already drawn. ``version`` is the version of
        the weights at the start; ``token_versions`` records each token's.

        ``vision`` (one dict per prompt, :func:`tearless.models.vision.prompt_pixels`) gives a
        vision-language model each prompt's pixel inputs: every prefill forward of a prompt takes them
        (its image features replace its image tokens), the decode steps read the cache as for text.
        Such a call takes the host-driven loop on every device, and no ``between_tokens``.
        """
        if do_sample and keys is None:
            keys = torch.randint(0, 2**62, (len(prompts),)).tolist()
        if vision is not None and between_tokens is not None:
            raise ValueError("partial rollouts (between_tokens) do not take a vision-language model's pixels")
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} sampling keys for {len(prompts)} prompts; give one per prompt")
        was_training = self.model.training
        self.model.eval()
        expanded = [p for p in prompts for _ in range(n)]
        prompt_ids, prompt_mask = left_pad(expanded, self.pad_token_id)
        try:
            device = compute_device(self.model)
            with forward_only(device, self.compute_dtype), autocast(device, self.compute_dtype):
                static = device.type == "cuda" if self.static_loop is None else self.static_loop
                draws = uniforms(sample_keys(keys, n), max_new_tokens) if do_sample else None
                sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p)
                # the GPU loop: no host read per token
                if static and between_tokens is None and vision is None:
                    tokens, logps, ents, mask, finished, versions = decode_static(
                        self.model,
                        prompt_ids,
                        prompt_mask,
                        draws,
                        max_new_tokens,
                        pad_token_id=self.pad_token_id,
                        eos=self.eos,
                        sampling=sampling,
                        stop_sequences=stop_sequences,
                        version=version,
                        graphs=self.cuda_graphs,
                    )
                else:
                    tokens, logps, ents, mask, finished, versions = self._decode(
                        prompts,
                        n,
                        max_new_tokens,
                        draws,
                        sampling,
                        stop_sequences,
                        version,
                        between_tokens,
                        vision,
                    )
        finally:
            self.model.train(was_training)
        # Outside inference mode, so the tensors can take part in autograd later (as constants).
        return RolloutOutput(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            response_ids=tokens.cpu().clone(),
            response_mask=mask.cpu().clone(),
            log_probs=logps.cpu().clone(),
            truncated=~finished.cpu().clone(),
            entropy=ents.cpu().clone(),
            token_versions=versions.cpu().clone(),
        )

    def _prefill(self, ids: torch.Tensor, attn: torch.Tensor, capacity: int, pixels: dict | None = None):
        """Forward left-padded ``ids`` (rows, L), with their ``pixels`` (a vision-language model's
        stacked pixel inputs, one row per row of ``ids``), into a fresh decode cache of ``capacity``
        positions; returns (last-position logits in float32, cache, attention mask, next position ids).
        With M-RoPE (:mod:`tearless.models.mrope`) the prompt takes the model's positions and the next
        ones are the text positions plus the row's delta, one (B, 1) tensor that the model reads in
        all three sections."""
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        rope = prompt_rope(self.model, ids, attn, pixels)
        cache = decode_cache(self.model.config, capacity)
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=sequence_positions(positions, ids.shape[1], rope),
            logits_to_keep=1,
            **({} if pixels is None else forward_pixels(pixels)),
            **cache_kwargs(self.model, cache),
        )
        next_pos = positions[:, -1:] + 1
        if rope is not None:  # every later M-RoPE section is the text position plus the prompt's delta
            next_pos = next_pos + rope[1]
        return out.logits[:, -1, :].float(), cache, attn, next_pos

    def _decode(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        draws: torch.Tensor | None,
        sampling: dict[str, float],
        stop_sequences: list[list[int]] | None,
        version: int,
        between_tokens: Callable[[], int | None] | None,
        vision: Sequence[dict[str, torch.Tensor]] | None,
    ) -> tuple[torch.Tensor, ...]:
        """The decode loop: (B, T) tokens, log-probs, entropies, mask and token versions and the (B,)
        EOS flags, T ≤ max_new_tokens. It takes what :func:`~tearless.rollout.static_decode.decode_static`
        takes: ``draws`` (B, max_new_tokens) the samples' uniforms (None: greedy) and ``sampling`` the
        temperature, top-k and top-p.

        The model forwards one row per distinct token history, not one per sample: a prompt's n
        samples share their history until they draw different tokens. ``owner`` maps each live output
        row to its model row; every live output row draws its own token from its model row's
        distribution (independent draws, as with one model row per sample), then the output rows of a
        model row that drew different tokens split it, one model row per token (its cache rows
        copied). Once a split leaves at least half as many model rows as live samples, every sample
        gets its own row and no split copies the cache again. Rows that finished are dropped with the
        next split, or once a quarter of the model rows are idle. Greedy samples of one prompt
        therefore cost one row, and samples of a confident policy little more.

        When ``between_tokens`` loads new weights, the live output rows are re-prefilled, one model
        row each (the cache built by the old weights is dropped), and the loop goes on at the same
        position: the same sampling draws, the new weights' distributions.
        """
        device = compute_device(self.model)
        ids, attn = (t.to(device) for t in left_pad(prompts, self.pad_token_id))
        draws = None if draws is None else draws.to(device)
        eos = self.eos.to(device)
        stops = [torch.tensor(s, dtype=torch.long, device=device) for s in stop_sequences or () if s]
        pixels = None if vision is None else {k: v.to(device) for k, v in stack_pixels(vision).items()}
        logits, cache, attn, next_pos = self._prefill(ids, attn, ids.shape[1] + max_new_tokens, pixels)
        batch = len(prompts) * n
        tokens = torch.full((batch, max_new_tokens), self.pad_token_id, dtype=torch.long, device=device)
        logps = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        ents = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
        mask = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
        versions = torch.zeros((batch, max_new_tokens), dtype=torch.long, device=device)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        rows = torch.arange(batch, device=device)  # the live output rows
        owner = rows // n  # the model row of each live output row
        width = 0
        shared = n > 1  # False once every live sample has its own model row (rows never merge)
        for t in range(max_new_tokens):
            u = draws[rows, t] if draws is not None else None
            tok, logps[rows, t], ents[rows, t] = sample_step(
                logits, owner, u, **sampling, distinct=not shared
            )
            tokens[rows, t] = tok
            mask[rows, t] = 1
            versions[rows, t] = version
            width = t + 1
            done = torch.isin(tok, eos) | _ends_with_stop(tokens, rows, t, stops)
            finished[rows[done]] = True
            rows, owner, tok = rows[~done], owner[~done], tok[~done]
            if len(rows) == 0 or t == max_new_tokens - 1:
                break
            new_version = between_tokens() if between_tokens is not None else None
            if new_version is not None:  # new weights: the live responses so far, prefilled again
                version = new_version
                torch.clear_autocast_cache()  # the bf16 casts of the old weights (precision.forward_only)
                history = [prompts[int(r) // n] + tokens[r, : t + 1].tolist() for r in rows]
                ids, attn = (x.to(device) for x in left_pad(history, self.pad_token_id))
                capacity = ids.shape[1] + max_new_tokens - t - 1
                logits, cache, attn, next_pos = self._prefill(ids, attn, capacity)
                owner, shared = torch.arange(len(rows), device=device), False
                continue
            # The next model rows: one per distinct (model row, token) among the live output rows.
            if shared:
                vocab = logits.shape[-1]
                keys, inverse = torch.unique(owner * vocab + tok, return_inverse=True)
                parent, step_tok = keys // vocab, keys % vocab
                split = bool((parent[1:] == parent[:-1]).any())
            else:  # every sample has its own row: nothing to group
                parent, step_tok, split = owner, tok, False
                inverse = torch.arange(len(rows), device=device)
            if split and 2 * len(parent) >= len(rows):
                # Mostly distinct already: one row per sample from here on, so no split copies the
                # cache again (samples that diverge early would otherwise pay one copy per step).
                parent, step_tok, inverse = owner, tok, torch.arange(len(rows), device=device)
                shared = False
            if split or len(parent) <= 0.75 * len(logits):
                cache.batch_select_indices(parent)
                attn, next_pos, owner = attn[parent], next_pos[parent], inverse
            else:  # no split and few idle rows: keep the batch, idle rows read a pad token
                by_row = torch.full((len(logits),), self.pad_token_id, dtype=torch.long, device=device)
                by_row[parent] = step_tok
                step_tok = by_row
            attn = torch.cat([attn, torch.ones((len(attn), 1), dtype=attn.dtype, device=device)], dim=1)
            out = self.model(
                input_ids=step_tok[:, None],
                attention_mask=attn,
                position_ids=next_pos,
                **cache_kwargs(self.model, cache),
            )
            logits = out.logits[:, -1, :].float()
            next_pos = next_pos + 1
        return (
            tokens[:, :width],
            logps[:, :width],
            ents[:, :width],
            mask[:, :width],
            finished,
            versions[:, :width],
        )


# Below this many positions the stock cache's copies are cheaper than attention over buffer views.
BUFFERED_CACHE_MIN_POSITIONS = 64


def decode_cache(config, capacity: int):
    """A ``DynamicCache`` for ``config``; when ``capacity`` (prompt + new tokens) reaches
    :data:`BUFFERED_CACHE_MIN_POSITIONS`, its full-attention layers keep keys and values in buffers
    of ``capacity`` positions (float32 on CPU), so that appending a token writes in place: the stock layer
    concatenates, copying the whole cache at every step (quadratic in the response length).

    Measured on the benchmark cases (one thread, median of paired runs): 79 positions, the medium
    case's rollout 6.89 → 6.06 s (1.14× faster); 25 positions, the small case's 0.159 → 0.169 s
    (4.5% slower: at that length the copies cost less than attention over buffer views).
    On CPU the decode steps over these buffers run :func:`tearless.models.packing.decode_attention`.
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    if capacity < BUFFERED_CACHE_MIN_POSITIONS:
        return cache
    buffered = _buffered_layer_class()
    cache.layers = [buffered(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@functools.cache
def _buffered_layer_class() -> type:
    from transformers.cache_utils import DynamicLayer

    class BufferedLayer(DynamicLayer):
        """A ``DynamicLayer`` over preallocated (B, H, capacity, D) buffers: ``keys``/``values`` are
        (B, H, length, D) views of their first ``length`` positions, each (row, head)'s keys one
        contiguous block, which is what the decode step's batched matmuls read fastest.

        Keys and values computed in bf16 on CPU (autocast) are stored in float32: attention over
        a bf16 cache measured 2.4–5× slower than over a float32 one (no fast bf16 kernel for one
        query against a long cache; BENCHMARKS.md, "Decode attention"), and the cache costs no
        rounding beyond the projections' own.
        """

        def __init__(self, capacity: int) -> None:
            super().__init__()
            self.capacity = capacity
            self.length = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                reduced = key_states.dtype in (torch.bfloat16, torch.float16)
                on_cpu = key_states.device.type == "cpu"
                dtype = torch.float32 if reduced and on_cpu else key_states.dtype
                self.dtype, self.device = dtype, key_states.device
                rows, heads, _, dim = key_states.shape
                self.key_buffer = key_states.new_empty((rows, heads, self.capacity, dim), dtype=dtype)
                self.value_buffer = value_states.new_empty(
                    (rows, heads, self.capacity, value_states.shape[-1]), dtype=dtype
                )
                self.is_initialized = True
            end = self.length + key_states.shape[-2]
            if end > self.capacity:
                raise ValueError(f"the decode cache holds {self.capacity} positions, not {end}")
            self.key_buffer[:, :, self.length : end] = key_states
            self.value_buffer[:, :, self.length : end] = value_states
            self.length = end
            self._views()
            return self.keys, self.values

        def _views(self) -> None:
            self.keys = self.key_buffer[:, :, : self.length]
            self.values = self.value_buffer[:, :, : self.length]

        def get_seq_length(self) -> int:
            return self.length

        def _select(self, rows: torch.Tensor) -> None:
            for name in ("key_buffer", "value_buffer"):
                old = getattr(self, name)
                new = old.new_empty((len(rows), *old.shape[1:]))
                new[:, :, : self.length] = old[rows, :, : self.length]
                setattr(self, name, new)
            self._views()

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.length:
                rows = torch.arange(self.key_buffer.shape[0], device=self.key_buffer.device)
                self._select(rows.repeat_interleave(repeats))

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.length:
                self._select(indices)

    return BufferedLayer


def _ends_with_stop(
    tokens: torch.Tensor, rows: torch.Tensor, t: int, stops: list[torch.Tensor]
) -> torch.Tensor:
    """(len(rows),) True where output rows ``rows`` of ``tokens`` end at column ``t`` with a stop sequence."""
    hit = torch.zeros(len(rows), dtype=torch.bool, device=tokens.device)
    for stop in stops:
        if len(stop) <= t + 1:
            hit |= (tokens[rows, t + 1 - len(stop) : t + 1] == stop).all(-1)
    return hit
