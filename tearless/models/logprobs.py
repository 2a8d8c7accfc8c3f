"""Per-token log-probabilities and entropy of response tokens under a causal LM.

Batches are laid out as veRL does: left-padded prompts (B, P) followed by right-padded responses
(B, R). Only the logits that predict response tokens are computed (``logits_to_keep``), so the
(B, P+R, V) tensor over prompt positions is never materialised.

GRPO-style batches hold ``n`` responses per prompt in adjacent rows. Such a run of rows with the same
prompt is forwarded through the prompt once: the prompt's keys and values are computed for one row
(with gradient when enabled), repeated for the run's rows, and the responses attend to them as to a
KV cache. The maths is that of one forward over each whole sequence (the same attention and the
same positions); it saves (n − 1)/n of the prompt tokens' forward and backward work.
"""

from __future__ import annotations

import torch

from tearless.algos import entropy_from_logits, logprobs_from_logits
from tearless.models.loading import compute_device


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return log π(y_t | x, y_<t) of each response token, shape (B, R), and optionally its entropy.

    Logits are divided by ``temperature`` first, matching the distribution the sampler drew from.
    Entropy is computed without gradient (it is a metric unless the caller differentiates it; pass
    ``with_entropy="grad"`` for the entropy bonus). ``share_prompts`` forwards a prompt shared by adjacent
    rows once (see the module docstring); False always runs one plain pass over every whole sequence.
    """
    device = compute_device(model)
    counts = shared_prompt_runs(prompt_ids, prompt_mask) if share_prompts else None
    # A KV cache under activation checkpointing is switched off by transformers: use the plain pass.
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    checkpointing = checkpointing and torch.is_grad_enabled()
    # Sharded (FSDP) ranks must run the same forwards, hence the same collectives, and whether a rank's
    # batch has shared prompts differs between ranks: they all take the plain pass.
    sharded = torch.distributed.is_available() and torch.distributed.is_initialized()
    if counts is not None and not checkpointing and not sharded:
        logits = _shared_prompt_logits(
            model, *(t.to(device) for t in (prompt_ids, prompt_mask, response_ids, response_mask)), counts
        )
    else:
        ids, mask, positions = (
            t.to(device) for t in sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
        )
        width = response_ids.shape[1]
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=width + 1,
        ).logits[:, :-1, :]
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = logprobs_from_logits(logits, response_ids.to(device))
    entropy = None
    if with_entropy == "grad":
        entropy = entropy_from_logits(logits)
    elif with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach())
    return log_probs, entropy


def shared_prompt_runs(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor | None:
    """Lengths of the runs of adjacent rows with identical prompts (summing to B), or None when
    every run has length 1 (nothing to share) or some prompt is empty."""
    if prompt_ids.shape[0] < 2 or not bool(prompt_mask.any(-1).all()):
        return None
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(-1) & (prompt_mask[1:] == prompt_mask[:-1]).all(-1)
    if not bool(same.any()):
        return None
    starts = torch.cat([torch.tensor([True]), ~same.cpu()]).nonzero().squeeze(-1)
    return torch.diff(torch.cat([starts, torch.tensor([prompt_ids.shape[0]])]))


def _shared_prompt_logits(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """(B, R, V) logits predicting each response token, each distinct prompt forwarded once.

    ``counts`` are the run lengths of :func:`shared_prompt_runs`. The prompt pass keeps its KV cache;
    each layer's keys and values are repeated ``counts`` times (a differentiable copy, so gradients
    of all the run's responses flow back into one prompt pass) and the responses are forwarded
    against it with positions continuing after each prompt's last real token.
    """
    from transformers import DynamicCache

    counts = counts.to(prompt_ids.device)
    first_rows = torch.cumsum(counts, 0) - counts
    used = prompt_mask.any(dim=0).nonzero()
    start = int(used[0]) if len(used) else 0
    p_ids, p_mask = prompt_ids[first_rows, start:], prompt_mask[first_rows, start:]
    cache = DynamicCache(config=model.config)
    prompt_out = model(
        input_ids=p_ids,
        attention_mask=p_mask,
        position_ids=(p_mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    for layer in cache.layers:
        layer.keys = layer.keys.repeat_interleave(counts, dim=0)
        layer.values = layer.values.repeat_interleave(counts, dim=0)
    mask = torch.cat([p_mask.repeat_interleave(counts, dim=0), response_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, p_mask.shape[1] :]
    width = response_ids.shape[1]
    response_out = model(
        input_ids=response_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=width,
    )
    first = prompt_out.logits[:, -1:, :].repeat_interleave(counts, dim=0)
    return torch.cat([first, response_out.logits[:, : width - 1, :]], dim=1)
