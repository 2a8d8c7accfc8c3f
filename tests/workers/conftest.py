"""The actor's update as the trainer runs it, for the tests of this folder."""

from __future__ import annotations

import copy

import pytest
import torch


def actor_overrides(**actor) -> list[str]:
    """``actor_rollout_ref.actor.<key>=<value>`` overrides (keys may be dotted: ``optim.weight_decay``)."""
    return [
        f"actor_rollout_ref.actor.{k}={str(v).lower() if isinstance(v, bool) else v}"
        for k, v in actor.items()
    ]


@pytest.fixture(scope="module")
def updated(local_workers):
    """``updated(model, td, lr=0.1, sgd=True, **actor)``: run the trainer's update (``update_policy``
    of its worker group, config keys ``actor_rollout_ref.actor.<key>=<value>`` from ``actor``) on a copy
    of ``model``; return the copy, its last gradients, the metrics.

    With ``sgd`` the actor's AdamW is swapped for plain SGD at ``lr``: AdamW's first step is
    lr·g/(|g|+ε) per entry, which is blind to a wrongly scaled gradient and turns float rounding in
    entries whose gradient is ~ε into differences of up to lr. With SGD the parameter change is the
    gradient itself (times lr), so equal parameters mean equal gradients of every mini-batch, the
    second one taken after the first one's step.
    """

    def run(model, td, lr=0.1, sgd=True, **actor):
        settings = dict(
            grad_clip=1e6,  # clipping rescales to unit norm and would hide a wrongly scaled gradient
            use_kl_loss=True,
            kl_loss_coef=0.1,
            entropy_coeff=0.01,
        )
        copy_ = copy.deepcopy(model)
        # Prompts of up to 24 tokens (the batch's have 7 to 9) and responses of up to 16: a token
        # budget of 40 per micro-batch holds any one sequence, as validation asks.
        workers = local_workers(
            "data.max_prompt_length=24",
            *actor_overrides(**{**settings, **actor}),
            models={"actor": copy_},
        )
        role = workers.rank.roles["actor"]
        if sgd:
            role.optimizer = torch.optim.SGD(role.params, lr=lr)
            role.scheduler = torch.optim.lr_scheduler.LambdaLR(role.optimizer, lambda _: 1.0)
        grads: list[torch.Tensor] = []

        def keep(optimizer, args, kwargs):  # each step's gradients (a GPU's update frees them after its last)
            grads[:] = [p.grad.clone() for p in role.params]

        role.optimizer.register_step_pre_hook(keep)
        metrics = workers.update_policy(td.clone())
        return copy_, grads, metrics  # the last mini-batch's gradient

    return run
