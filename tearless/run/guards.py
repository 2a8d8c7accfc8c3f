"""The bad-step guard's weight check: stop when an update leaves the weights non-finite.

The actor already skips an optimizer step whose loss or gradient norm is not finite
(``workers/actor.py``) and the trainer stops after ``trainer.max_bad_steps`` of those. An update can
still break the weights with a finite loss and gradient norm: a learning rate of 1e10 turns finite
gradients into weights of 1e10 and more, and on main the next rollout then crashed inside sampling
(``invalid multinomial distribution``). After each step's updates :func:`check_weights` reduces
every parameter to its norm (one pass over the weights, cheaper than the optimizer step before it)
and runs the actor on one of the step's prompts (one short forward pass) and checks its logits; if
either is not finite it raises :class:`WeightsNotFinite`, naming the step and the fix, before
anything samples from, validates or saves the broken weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tearless.distributed.fsdp import local_tensor
from tearless.models.copies import copies_for
from tearless.models.loading import compute_device
from tearless.run import checkpoint as ckpt


class WeightsNotFinite(RuntimeError):
    """An update left a model's weights NaN or infinite; nothing of that step was saved."""


def weights_finite(model: torch.nn.Module) -> bool:
    r"""Whether every parameter is finite: :math:`\lVert p \rVert_2` is finite for every tensor ``p``
    (a NaN or an infinity anywhere makes its tensor's norm non-finite; so does a finite weight so
    large that its tensor's norm overflows float32, which is as broken)."""
    norms = [
        torch.linalg.vector_norm(local_tensor(p.detach()), dtype=torch.float32) for p in model.parameters()
    ]
    return not norms or bool(torch.isfinite(torch.stack([n.cpu() for n in norms])).all())


def logits_finite(model: torch.nn.Module, input_ids: torch.Tensor) -> bool:
    """Whether ``model``'s logits on ``input_ids`` (1, T) are all finite: from its compute copies when
    it has them (the weights its passes compute from, refreshed by the step; the masters' own
    finiteness is :func:`weights_finite`'s)."""
    with torch.no_grad(), copies_for(model):
        logits = model(input_ids=input_ids.to(compute_device(model))).logits
    return bool(torch.isfinite(logits).all())


def check_weights(
    step: int,
    actor: torch.nn.Module | None,
    critic: torch.nn.Module | None,
    lrs: dict[str, float],
    run_dir: str,
    probe: tuple[torch.Tensor, torch.Tensor] | None = None,
    agree: Callable[[bool], bool] = bool,
) -> None:
    """Raise :class:`WeightsNotFinite` if the actor's (or critic's) weights, or the actor's logits on
    the ``probe`` prompt (``(prompt_ids, prompt_mask)``, the first row is used), are not finite after
    step ``step``'s update (see the module docs). ``lrs`` are the roles' learning rates
    (``actor_rollout_ref.actor.optim.lr``, ``critic.optim.lr``) and ``run_dir`` the checkpoints'
    directory (``trainer.default_local_dir``), both for the message. ``agree`` turns this rank's
    verdict into the verdict of all ranks holding shards of the models (every rank then raises
    together)."""
    ids = None
    if probe is not None:
        ids = probe[0][0][probe[1][0].bool()].unsqueeze(0)
    for name, model, section in (("actor", actor, "actor_rollout_ref.actor"), ("critic", critic, "critic")):
        if model is None:
            continue
        if agree(weights_finite(model) and (name != "actor" or ids is None or logits_finite(model, ids))):
            continue
        latest = ckpt.latest_checkpoint(run_dir)
        again = (
            f"resume with trainer.resume_mode=auto trainer.resume_allow_changes=[{section}.optim.lr]"
            if latest
            else "run again"
        )
        where = (
            f"the newest checkpoint, {latest}, is from before it" if latest else "no checkpoint was saved yet"
        )
        raise WeightsNotFinite(
            f"step {step}: the {name}'s weights (or its logits) are NaN or infinite after its update, though "
            "the loss and gradient norm were finite: the update was too large "
            f"({section}.optim.lr={lrs[name]:g}). "
            f"Nothing of step {step} was saved; {where}. Lower {section}.optim.lr (or clip gradients "
            f"harder with {section}.grad_clip), then {again}"
        )
