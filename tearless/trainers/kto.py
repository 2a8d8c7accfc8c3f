r"""One KTO step on unpaired examples (``algorithm.loss_type`` ``kto`` or ``apo_zero_unpaired``).

Each example is a prompt x, a response y and a label (desirable or not), tokenised with a KL
sequence: x followed by another example's response y' (:class:`~tearless.data.pairs.UnpairedDataset`).
A step:
  1. (``kto`` only) the reference point :math:`z = \max(0, \operatorname{mean}(\log\pi(y'|x) -
     \log\pi_{ref}(y'|x)))` over the KL sequences of **every** example of the step, without gradient
     (TRL takes the mean over each device micro-batch; one value per step keeps micro-batching from
     changing the loss);
  2. per micro-batch: the responses' summed log-probs, ``kto_loss`` against the stored reference
     log-probs and z, weighted by the micro-batch's share of the step's examples, backward.
Metrics (TRL's KTO names): ``rewards/chosen`` / ``rewards/rejected`` (mean implicit reward
:math:`\beta(\log\pi - \log\pi_{ref})` of the desirable / undesirable examples), ``rewards/margins``
(their difference), ``logps/chosen`` / ``logps/rejected``, ``kl`` (z).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tearless.algos import kto_loss, kto_reference_point
from tearless.trainers.sft import side_logps


@torch.no_grad()
def reference_point(
    model: torch.nn.Module,
    items: Sequence[dict],
    ref: dict[int, tuple[float, ...]],
    *,
    pad_token_id: int,
    micro_batch_size: int | None = None,
) -> torch.Tensor:
    """KTO's z over the KL sequences of ``items`` (their reference log-probs are ``ref[index][1]``)."""
    size = micro_batch_size or len(items)
    policy = torch.cat(
        [
            side_logps(model, items[s : s + size], pad_token_id=pad_token_id, sides=("kl",))[:, 0]
            for s in range(0, len(items), size)
        ]
    )
    reference = torch.tensor([ref[it["index"]][1] for it in items], dtype=policy.dtype, device=policy.device)
    return kto_reference_point(policy, reference)


def kto_step(
    model: torch.nn.Module,
    items: Sequence[dict],
    ref: dict[int, tuple[float, ...]],
    *,
    pad_token_id: int,
    beta: float,
    kind: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    micro_batch_size: int | None = None,
    train: bool = True,
) -> dict[str, float]:
    """Loss (backward when ``train``) and the KTO metrics over ``items``, micro-batched."""
    size = micro_batch_size or len(items)
    kl = (
        reference_point(model, items, ref, pad_token_id=pad_token_id, micro_batch_size=size)
        if kind == "kto"
        else torch.zeros(())
    )
    labels = torch.tensor([bool(it["label"]) for it in items])
    counts = {True: int(labels.sum()), False: int((~labels).sum())}
    total_loss, rewards, logps = 0.0, {True: 0.0, False: 0.0}, {True: 0.0, False: 0.0}
    for start in range(0, len(items), size):
        chunk = items[start : start + size]
        desirable = labels[start : start + size]
        with torch.set_grad_enabled(train):
            policy = side_logps(model, chunk, pad_token_id=pad_token_id, sides=("completion",))[:, 0]
            reference = torch.tensor(
                [ref[it["index"]][0] for it in chunk], dtype=policy.dtype, device=policy.device
            )
            loss, implicit = kto_loss(
                policy,
                reference,
                desirable.to(policy.device),
                kl,
                beta=beta,
                desirable_weight=desirable_weight,
                undesirable_weight=undesirable_weight,
                kind=kind,
            )
            weighted = loss * len(chunk) / len(items)
        if train:
            weighted.backward()
        total_loss += weighted.item()
        for label in (True, False):
            picked = desirable.to(policy.device) == label
            rewards[label] += implicit[picked].sum().item()
            logps[label] += policy.detach()[picked].sum().item()
    metrics = {"loss": total_loss, "kl": float(kl)}
    for label, name in ((True, "chosen"), (False, "rejected")):
        if counts[label]:
            metrics[f"rewards/{name}"] = rewards[label] / counts[label]
            metrics[f"logps/{name}"] = logps[label] / counts[label]
    if counts[True] and counts[False]:
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics
