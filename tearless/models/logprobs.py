"""Per-token log-probabilities and entropy of response tokens under a causal LM.

Batches are laid out as veRL does: left-padded prompts (B, P) followed by right-padded responses
(B, R). Only the logits that predict response tokens are computed (``logits_to_keep``), so the
(B, P+R, V) tensor over prompt positions is never materialised.
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return log π(y_t | x, y_<t) of each response token, shape (B, R), and optionally its entropy.

    Logits are divided by ``temperature`` first, matching the distribution the sampler drew from.
    Entropy is computed without gradient (it is a metric unless the caller differentiates it; pass
    ``with_entropy="grad"`` for the entropy bonus).
    """
    device = compute_device(model)
    ids, mask, positions = (
        t.to(device) for t in sequence_inputs(prompt_ids, prompt_mask, response_ids, response_mask)
    )
    width = response_ids.shape[1]
    logits = (
        model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=width + 1,
        )
        .logits[:, :-1, :]
        .float()
    )
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
