"""Reduction of a per-token loss (B, T) to the scalar that is back-propagated, by ``loss_agg_mode``.

A mode registered with :func:`register_agg_mode` is called with ``loss_mat`` already zeroed outside the
mask, the bool ``mask``, and whichever of ``global_num_tokens``, ``global_num_seqs`` and
``loss_scale_factor`` its signature names.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from tearless.algos._registry import call_accepted, lookup, registrar
from tearless.algos.masked import zero_masked

AGG_MODES: dict[str, Callable[..., Tensor]] = {}
register_agg_mode = registrar(AGG_MODES, "loss_agg_mode")
# What a loss_agg_mode of None (the config's null) means, as in veRL.
DEFAULT_AGG_MODE = "token-mean"


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str | None,
    *,
    global_num_tokens: int | Tensor | None = None,
    global_num_seqs: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    r"""Reduce a per-token loss (B, T) to a scalar with the mode registered as ``loss_agg_mode``.

    With L the loss, m the mask, :math:`\ell_i = \sum_t m_{i,t}`:

    - ``token-mean``: :math:`\sum_{i,t} L m / N_{tok}`
    - ``token-sum``: :math:`\sum_{i,t} L m`
    - ``seq-mean-token-sum``: :math:`\sum_i (\sum_t L m) / N_{seq}`
    - ``seq-mean-token-mean``: :math:`\sum_i (\sum_t L m / \ell_i) / N_{seq}`
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): :math:`\sum_{i,t} L m / (N_{seq} S)`, S =
      ``loss_scale_factor`` or else the padded width T: the mean over responses of each response's
      token sum divided by a constant, as veRL 0.9's ``agg_loss``, TRL's ``dr_grpo`` (B × max completion
      length) and the Dr. GRPO paper (1/G over responses). Pass a constant S (the trainer passes
      ``max_response_length``): with the padded width, the step size would change with the longest
      sample of the batch.

    ``None`` means ``token-mean`` (veRL's default; the config's null). :math:`N_{tok}` is the number of
    valid tokens and :math:`N_{seq}` the number of rows with at least one, both local unless
    ``global_num_tokens`` / ``global_num_seqs`` give the mini-batch counts: then a mini-batch split into
    micro-batches, each aggregated with the global counts and the results summed, gives exactly the
    mini-batch loss and gradient. Rows without valid tokens contribute 0; an all-zero mask gives a 0
    that is still part of the graph. Masked entries of ``loss_mat`` are never read. The 4×5 all-ones
    example: token-mean 1, token-sum 20, seq-mean-token-sum 5, seq-mean-token-mean 1,
    seq-mean-token-sum-norm 20 / (4 · 5) = 1.
    """
    loss_agg_mode = DEFAULT_AGG_MODE if loss_agg_mode is None else loss_agg_mode
    fn = lookup(AGG_MODES, loss_agg_mode, "loss_agg_mode")
    mask = loss_mask.bool()
    inputs = {
        "loss_mat": zero_masked(loss_mat, mask),
        "mask": mask,
        "global_num_tokens": global_num_tokens,
        "global_num_seqs": global_num_seqs,
        "loss_scale_factor": loss_scale_factor,
    }
    return call_accepted(fn, inputs, f"loss_agg_mode {loss_agg_mode!r}")


def _normaliser(local: Tensor, given: int | float | Tensor | None, like: Tensor) -> Tensor:
    # max(N, 1): an empty mask has a zero numerator, so 0/1 keeps it 0 and differentiable, never 0/0.
    n = local if given is None else torch.as_tensor(given, device=like.device)
    return n.to(like.dtype).clamp(min=1)


def _num_seqs(mask: Tensor, given: int | Tensor | None, like: Tensor) -> Tensor:
    return _normaliser(mask.any(-1).sum(), given, like)


@register_agg_mode("token-mean")
def _token_mean(*, loss_mat: Tensor, mask: Tensor, global_num_tokens: int | Tensor | None = None) -> Tensor:
    return loss_mat.sum() / _normaliser(mask.sum(), global_num_tokens, loss_mat)


@register_agg_mode("token-sum")
def _token_sum(*, loss_mat: Tensor) -> Tensor:
    return loss_mat.sum()


@register_agg_mode("seq-mean-token-sum")
def _seq_mean_token_sum(
    *, loss_mat: Tensor, mask: Tensor, global_num_seqs: int | Tensor | None = None
) -> Tensor:
    return loss_mat.sum() / _num_seqs(mask, global_num_seqs, loss_mat)


@register_agg_mode("seq-mean-token-mean")
def _seq_mean_token_mean(
    *, loss_mat: Tensor, mask: Tensor, global_num_seqs: int | Tensor | None = None
) -> Tensor:
    per_seq = loss_mat.sum(-1) / mask.sum(-1).to(loss_mat.dtype).clamp(min=1)
    return per_seq.sum() / _num_seqs(mask, global_num_seqs, loss_mat)


@register_agg_mode("seq-mean-token-sum-norm")
def _seq_mean_token_sum_norm(
    *,
    loss_mat: Tensor,
    mask: Tensor,
    global_num_seqs: int | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    scale = loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor
    if scale <= 0:
        raise ValueError(f"loss_scale_factor must be > 0, got {scale}")
    return loss_mat.sum() / _num_seqs(mask, global_num_seqs, loss_mat) / scale
