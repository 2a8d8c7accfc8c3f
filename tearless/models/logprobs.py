"""Per-token log-probabilities and entropy of response tokens under a causal LM.

Batches are laid out as veRL does: left-padded prompts (B, P) followed by right-padded responses
(B, R). Only the logits that predict response tokens are computed (``logits_to_keep``), so the
(B, P+R, V) tensor over prompt positions is never materialised, and a response's last token, which is
only ever a target, is never forwarded.

The fast path (the default, single process) does two things veRL's remove-padding does with
variable-length kernels, with plain batched forwards:

- GRPO-style batches hold ``n`` responses per prompt in adjacent rows. Each distinct prompt is
  forwarded once: its keys and values are computed for one row (with gradient when enabled), gathered
  for its responses (a differentiable copy), and the responses attend to them as to a KV cache. The
  maths is that of one forward over each whole sequence (the same attention and the same positions);
  it saves (n − 1)/n of the prompt tokens' forward and backward work.
- Identical sequences (the same prompt and response: a confident policy's GRPO group often
  samples one answer several times) are forwarded once (:func:`distinct_rows`); their log-probs
  are copied to the duplicates, whose gradients add up in the one forward.
- The responses are forwarded in length buckets: rows sorted by length and cut where padding them to
  one width would cost more than another forward (:func:`length_buckets`), so a batch of 40-token
  answers with one 64-token straggler no longer pads every row to 64.

On CUDA, log-probs and entropies are taken from the logits a chunk of tokens at a time
(:func:`tearless.models.chunked.chunked_logits_logprobs`) when one chunk's float32 logits
(:data:`~tearless.models.chunked.CHUNK_ELEMENTS`) cannot hold them all, so that a 151,936-token
vocabulary never has its (tokens × vocabulary) float32 copy, log-softmax or softmax formed whole; a
batch that fits in one chunk (the embedded tiny models' always do), and any batch on a CPU
(:data:`tearless.devices.DEVICE_DEFAULTS`), takes the whole-tensor functions unless
``entropy_from_logits_with_chunking`` says otherwise.
The entropy, a full pass over the vocabulary, is computed only when asked for.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from tearless.algos import entropy_from_logits, logprobs_from_logits
from tearless.devices import bucket_overhead_tokens, device_defaults
from tearless.models.chunked import chunk_tokens, chunked_logits_logprobs, chunked_logprobs
from tearless.models.compat import activation_checkpointing, cache_kwargs
from tearless.models.compiled import compiled_for
from tearless.models.loading import compute_device
from tearless.models.mrope import prompt_rope, sequence_positions
from tearless.models.packing import pack_rows, packable, packed_forward
from tearless.models.precision import autocast_for
from tearless.models.vision import forward_pixels, images_placed


def sequence_inputs(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Concatenate prompt and response; drop leading all-pad columns; positions from the mask."""
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    used = mask.any(dim=0).nonzero()
    first = int(used[0]) if len(used) else 0
    ids, mask = ids[:, first:], mask[:, first:]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def response_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool | str = False,
    share_prompts: bool = True,
    remove_padding: bool = False,
    fused_kernels: bool = False,
    entropy_chunking: bool | None = None,
    entropy_checkpointing: bool = False,
    vision: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return log π(y_t | x, y_<t) of each response token, shape (B, R), and optionally its entropy.

    Logits are divided by ``temperature`` first, matching the distribution the sampler drew from.
    Entropy is computed without gradient (it is a metric unless the caller differentiates it; pass
    ``with_entropy="grad"`` for the entropy bonus). Both are 0 after each row's last attended token.
    ``share_prompts`` takes the fast path (shared prompts, length buckets; see the module
    docstring); False always runs one plain pass over every whole sequence. ``remove_padding``
    (``use_remove_padding``) forwards the valid tokens packed into one row instead
    (:mod:`tearless.models.packing`), with identical sequences still forwarded once when
    ``share_prompts`` and not sharded; rows whose masks are not the left-padded prompt / right-padded
    response layout fall back to the padded pass. ``fused_kernels`` (``use_fused_kernels``) computes
    the packed pass's log-probs and entropy from the final hidden states a chunk of tokens at a time
    (:mod:`tearless.models.chunked`) when the model is not sharded and its LM head is a plain
    bias-free linear layer; otherwise the logits are formed whole. ``entropy_chunking``
    (``entropy_from_logits_with_chunking``) takes log-probs and entropies from those logits a chunk
    of tokens at a time: None = on CUDA when they exceed one chunk (never on CPU,
    :func:`auto_chunked`), True = always, False = never (whole float32 tensors).
    ``entropy_checkpointing`` (veRL's key) recomputes the softmax of a differentiated entropy in the
    backward instead of keeping it (the chunked function, even for one chunk).

    ``vision``, for a vision-language model (:mod:`tearless.models.vision`), holds each row's pixel
    inputs (``pixel_values``, …, one row per row): every forward over the prompts takes them, on the
    fast path once per distinct prompt. Such a batch is never packed: the packed forward does not
    place image features (``remove_padding`` falls back to the padded pass).

    A model marked for bf16 compute (:func:`tearless.models.precision.set_compute_dtype`, CPU) runs
    its forwards under autocast; its logits are upcast to float32 before the log-softmax, so both
    outputs are float32 in every precision. A model whose layers were compiled
    (:func:`tearless.models.compiled.compile_layers`, ``use_torch_compile``) runs them compiled here.
    """
    with autocast_for(model), compiled_for(model):
        return _response_logprobs(
            model,
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            temperature=temperature,
            with_entropy=with_entropy,
            share_prompts=share_prompts,
            remove_padding=remove_padding,
            fused_kernels=fused_kernels,
            chunking=(entropy_chunking, entropy_checkpointing),
            vision=vision or None,
        )


def _response_logprobs(
    model,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    *,
    temperature,
    with_entropy,
    share_prompts,
    remove_padding,
    fused_kernels,
    chunking,
    vision,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    device = compute_device(model)
    rows, width = response_ids.shape
    lengths = attended_lengths(response_mask)
    # A KV cache under activation checkpointing is switched off by transformers: use the plain pass.
    checkpointing = activation_checkpointing(model) and torch.is_grad_enabled()
    # Sharded (FSDP) ranks must run the same forwards, hence the same collectives, and how a rank's
    # rows share prompts and bucket by length differs between ranks: they all take the plain pass.
    # A group of one is not sharding: a vLLM engine in this process may have created it.
    sharded = (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )
    packed = remove_padding and vision is None and packable(prompt_mask, response_mask, lengths)
    fast = share_prompts and rows > 0 and not sharded and bool(prompt_mask.any(-1).all())
    p_ids, p_mask = prompt_ids.to(device), prompt_mask.to(device)
    r_ids, r_mask = response_ids.to(device), response_mask.to(device)
    pixels = None if vision is None else {k: v.to(device) for k, v in vision.items()}
    if fast and (packed or not checkpointing):
        rep, inverse = distinct_rows(*prompt_keys(p_ids, p_mask, pixels), r_ids, r_mask, lengths.to(device))
        if len(rep) < rows:  # forward each distinct sequence once; duplicates share its outputs
            log_prob, entropy = response_logprobs(
                model,
                p_ids[rep],
                p_mask[rep],
                r_ids[rep],
                r_mask[rep],
                temperature=temperature,
                with_entropy=with_entropy,
                remove_padding=remove_padding,
                fused_kernels=fused_kernels,
                entropy_chunking=chunking[0],
                entropy_checkpointing=chunking[1],
                vision=None if pixels is None else {k: v[rep] for k, v in pixels.items()},
            )
            return log_prob[inverse], (None if entropy is None else entropy[inverse])
    if packed:
        head = model.get_output_embeddings() if fused_kernels and not sharded else None
        if not (isinstance(head, torch.nn.Linear) and head.bias is None):
            head = None
        return _packed_logprobs(
            model, p_ids, p_mask, r_ids, lengths, temperature, with_entropy, head, chunking
        )  # fmt: skip
    if fast and not checkpointing:
        pieces = _fast_logits(model, p_ids, p_mask, r_ids, r_mask, lengths, pixels)
    else:
        used = max(int(lengths.max()) if rows else 0, 1)
        pieces = [(None, _plain_logits(model, p_ids, p_mask, r_ids[:, :used], r_mask[:, :used], pixels))]
    log_probs, entropies = [], []
    for index, logits in pieces:
        targets = r_ids[:, : logits.shape[1]] if index is None else r_ids[index, : logits.shape[1]]
        pad = (0, width - logits.shape[1])
        lp, ent = logits_logprobs(logits, targets, temperature, with_entropy, *chunking)
        log_probs.append(torch.nn.functional.pad(lp, pad))
        if ent is not None:
            entropies.append(torch.nn.functional.pad(ent, pad))
    log_prob, entropy = torch.cat(log_probs), (torch.cat(entropies) if entropies else None)
    if pieces[0][0] is not None:  # rows come out bucket by bucket: put them back in order
        inverse = torch.empty(rows, dtype=torch.long, device=device)
        inverse[torch.cat([index for index, _ in pieces])] = torch.arange(rows, device=device)
        log_prob = log_prob[inverse]
        entropy = None if entropy is None else entropy[inverse]
    # Zero after each row's last attended token, whatever the model said about the padding there.
    keep = torch.arange(width, device=device) < lengths.to(device)[:, None]
    log_prob = log_prob * keep
    return log_prob, (None if entropy is None else entropy * keep)


def _packed_logprobs(
    model, prompt_ids, prompt_mask, response_ids, lengths, temperature, with_entropy, head, chunking
):
    """:func:`response_logprobs` of one packed forward: logits only at the K predicting positions,
    or, given the LM ``head``, log-probs and entropy from the hidden states in chunks."""
    packed = pack_rows(prompt_ids, prompt_mask, response_ids, lengths)
    shape = tuple(response_ids.shape)
    targets = response_ids[packed.rows, packed.cols]
    if head is not None:  # the LM head runs on one token only; the chunks do the rest
        out = packed_forward(model, packed, logits_to_keep=1, output_hidden_states=True)
        hidden = out.hidden_states[-1][0, packed.keep]
        lp, ent = chunked_logprobs(hidden, head.weight, targets, temperature=temperature)
        entropy = (
            None
            if not with_entropy
            else packed.unpack(ent if with_entropy == "grad" else ent.detach(), shape)
        )
        return packed.unpack(lp, shape), entropy
    logits = packed_forward(model, packed, logits_to_keep=packed.keep).logits[0]
    lp, ent = logits_logprobs(logits, targets, temperature, with_entropy, *chunking)
    return packed.unpack(lp, shape), (None if ent is None else packed.unpack(ent, shape))


def logits_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool | str,
    chunking: bool | None = None,
    checkpointing: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(targets), entropy or None) of ``logits`` (..., V) / ``temperature``, both float32 of
    shape ``targets.shape``; the entropy only when ``with_entropy`` (with gradient when it is
    ``"grad"``). ``chunking``: None = :func:`auto_chunked` on the logits' device, True / False =
    always / never;
    ``checkpointing`` takes the chunked function for a differentiated entropy in any case (its
    softmax recomputed in the backward)."""
    vocab = logits.shape[-1]
    tokens = logits.numel() // max(vocab, 1)
    chunked = auto_chunked(logits.device.type, tokens, vocab) if chunking is None else chunking
    if chunked or (checkpointing and with_entropy == "grad"):
        lp, ent = chunked_logits_logprobs(
            logits.reshape(tokens, vocab),
            targets.reshape(tokens),
            temperature=temperature,
            with_entropy=bool(with_entropy),
        )
        lp = lp.view(targets.shape)
        if ent is None:
            return lp, None
        return lp, (ent if with_entropy == "grad" else ent.detach()).view(targets.shape)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_prob = logprobs_from_logits(logits, targets)
    if with_entropy == "grad":
        return log_prob, entropy_from_logits(logits)
    if with_entropy:
        with torch.no_grad():
            return log_prob, entropy_from_logits(logits.detach())
    return log_prob, None


def auto_chunked(device_type: str, tokens: int, vocab: int) -> bool:
    """Whether ``tokens`` × ``vocab`` logits on ``device_type`` are chunked when
    ``entropy_from_logits_with_chunking`` is unset: where the device's defaults chunk
    (:data:`tearless.devices.DEVICE_DEFAULTS`: CUDA, not CPU) and one chunk
    (:func:`~tearless.models.chunked.chunk_tokens`) cannot hold them."""
    return device_defaults(device_type).chunk_logits and tokens > chunk_tokens(vocab)


def distinct_rows(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    lengths: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rep, inverse)``: one row index per distinct sequence (prompt, mask and response up to its
    attended length) and, for each row, the position of its sequence in ``rep`` (``rep[inverse]``
    indexes rows equal to every row). ``rep`` is in lexicographic order of the sequences, so rows
    of one prompt stay adjacent. Taking ``out[inverse]`` of the distinct rows' outputs gives every
    row its values, and under autograd sums the duplicates' gradients into their one forward: the
    gradient of one pass per row."""
    columns = torch.arange(response_ids.shape[1], device=response_ids.device)
    response = response_ids.masked_fill(columns >= lengths[:, None], 0)
    keys = torch.cat([prompt_ids, prompt_mask, response, response_mask], dim=1)
    distinct, inverse = torch.unique(keys, dim=0, return_inverse=True)
    rows = torch.arange(len(keys), device=keys.device)
    rep = torch.full((len(distinct),), len(keys), device=keys.device).scatter_reduce(0, inverse, rows, "amin")
    return rep, inverse


def attended_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) one past each row's last attended response column (0 for a row with none)."""
    columns = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    return (response_mask.bool() * columns).amax(-1) if response_mask.shape[1] else response_mask.sum(-1)


def length_buckets(lengths: list[int], overhead: int) -> list[list[int]]:
    """Rows (indices into ``lengths``) grouped so that forwarding each group padded to its own
    longest row costs least: Σ rows · width + ``overhead`` per group (what one more forward costs,
    in response tokens, on the device: :func:`tearless.devices.bucket_overhead_tokens`).

    An exact dynamic programme over the distinct lengths in increasing order (a cheapest group is
    always a run of them): with c_k rows of the k-th length ℓ_k,
    best[j] = min over i < j of best[i] + (c_i + … + c_(j−1)) · ℓ_(j−1) + overhead.
    """
    values = sorted(set(lengths))
    count = [0] * len(values)
    slot = {v: k for k, v in enumerate(values)}
    for n in lengths:
        count[slot[n]] += 1
    best = [0.0] + [float("inf")] * len(values)
    cut = [0] * (len(values) + 1)
    for j in range(1, len(values) + 1):
        rows = 0
        for i in range(j - 1, -1, -1):
            rows += count[i]
            cost = best[i] + rows * values[j - 1] + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(values)
    while j > 0:
        groups.append(set(values[cut[j] : j]))
        j = cut[j]
    return [[r for r, n in enumerate(lengths) if n in g] for g in reversed(groups)]


def _plain_logits(model, prompt_ids, prompt_mask, response_ids, response_mask, pixels=None) -> torch.Tensor:
    """(B, R, V) logits predicting each response token from one pass over every whole sequence (with
    each row's ``pixels``, a vision-language model's, placed by
    :func:`~tearless.models.vision.image_embeddings` inside the forward,
    :func:`~tearless.models.vision.images_placed`)."""
    ids, mask, positions = sequence_inputs(
        prompt_ids, prompt_mask, response_ids[:, :-1], response_mask[:, :-1]
    )
    placed = contextlib.nullcontext()
    if pixels is not None:  # the image features go to the prompt's image tokens only (image_embeddings)
        prompt_width = ids.shape[1] - (response_ids.shape[1] - 1)
        placed = images_placed(model, pixels, prompt_width)
        # M-RoPE: the prompts' positions the model's, every later one shifted by the row's delta
        rope = prompt_rope(model, ids[:, :prompt_width], mask[:, :prompt_width], pixels)
        positions = sequence_positions(positions, prompt_width, rope)
    with placed:
        return model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=response_ids.shape[1],
        ).logits


def _fast_logits(
    model, prompt_ids, prompt_mask, response_ids, response_mask, lengths, pixels=None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(row indices, logits (b, w, V) predicting those rows' first w response tokens) per length bucket.

    Each distinct prompt of a run of adjacent rows (:func:`shared_prompt_runs`) is forwarded once
    and its KV cache kept; each bucket's responses but their last column (only a target) are
    forwarded against that cache, gathered for the bucket's rows, with positions continuing after
    each prompt's last real token. Gradients of every bucket flow back into the one prompt pass.
    A vision-language model's ``pixels`` (one row per row) go with the prompt pass, for its first rows;
    with M-RoPE (:mod:`tearless.models.mrope`) the prompts take the model's positions and the
    responses their text positions plus their prompt's delta.
    """
    from transformers import DynamicCache

    device = prompt_ids.device
    counts = shared_prompt_runs(*prompt_keys(prompt_ids, prompt_mask, pixels)).to(device)
    first_rows = torch.cumsum(counts, 0) - counts
    used = prompt_mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else 0
    p_ids, p_mask = prompt_ids[first_rows, start:], prompt_mask[first_rows, start:]
    p_pixels = None if pixels is None else {k: v[first_rows] for k, v in pixels.items()}
    rope = prompt_rope(model, p_ids, p_mask, p_pixels)
    text = (p_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    prompt_out = model(
        input_ids=p_ids,
        attention_mask=p_mask,
        position_ids=sequence_positions(text, p_mask.shape[1], rope),
        logits_to_keep=1,
        **({} if p_pixels is None else forward_pixels(p_pixels)),
        **cache_kwargs(model, cache),
    )
    prompt_kv = [(layer.keys, layer.values) for layer in cache.layers]
    group = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
    pieces = []
    overhead = bucket_overhead_tokens(device.type)
    buckets = length_buckets([max(n - 1, 0) for n in lengths.tolist()], overhead)
    for rows in buckets:
        index = torch.tensor(rows, dtype=torch.long, device=device)
        width = max(int(lengths[rows].max()), 1)
        if len(buckets) == 1:  # every row, in order: a repeat (an expand when the runs are equal)
            gather = functools.partial(_repeat_rows, counts=counts)
        else:
            gather = functools.partial(torch.index_select, dim=0, index=group[index])
        first = gather(prompt_out.logits[:, -1:, :])
        if width == 1:
            pieces.append((index, first))
            continue
        bucket_cache = DynamicCache(config=model.config)
        for layer, (keys, values) in zip(bucket_cache.layers, prompt_kv, strict=True):
            layer.update(gather(keys), gather(values))
        mask = torch.cat([gather(p_mask), response_mask[index, : width - 1]], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, p_mask.shape[1] :]
        if rope is not None:  # after the prompt every M-RoPE section is the text position plus its delta
            positions = positions + gather(rope[1])
        out = model(
            input_ids=response_ids[index, : width - 1],
            attention_mask=mask,
            position_ids=positions,
            logits_to_keep=width - 1,
            **cache_kwargs(model, bucket_cache),
        )
        pieces.append((index, torch.cat([first, out.logits], dim=1)))
    return pieces


def prompt_keys(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, pixels: dict[str, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What makes two rows' prompts the same, as (ids, mask) to compare: the prompt itself, and for a
    vision-language model its images too (one more column per pixel input, the row's number among its
    distinct values: Qwen2-VL's grids too, as one blank image's patches fill either of two shapes), since
    prompts with the same text and other images share their token ids."""
    if pixels is None:
        return prompt_ids, prompt_mask
    numbers = [torch.unique(v.flatten(1), dim=0, return_inverse=True)[1] for v in pixels.values()]
    image = torch.stack(numbers, 1).to(prompt_ids)
    return torch.cat([prompt_ids, image], 1), torch.cat([prompt_mask, torch.ones_like(image)], 1)


def _repeat_rows(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Row i of ``x`` repeated ``counts[i]`` times. Equal counts (the usual n samples per prompt) take
    an expand, whose backward is a sum rather than the scatter of ``repeat_interleave``'s."""
    if bool((counts == counts[0]).all()):
        n = int(counts[0])
        return x.unsqueeze(1).expand(x.shape[0], n, *x.shape[1:]).reshape(x.shape[0] * n, *x.shape[1:])
    return x.repeat_interleave(counts, dim=0)


def shared_prompt_runs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Lengths of the runs of adjacent rows with identical prompts (summing to B; all ones when no
    two adjacent rows share a prompt)."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)
    starts = torch.cat([torch.tensor([True]), ~same.cpu()]).nonzero().squeeze(-1)
    return torch.diff(torch.cat([starts, torch.tensor([prompt_ids.shape[0]])]))
