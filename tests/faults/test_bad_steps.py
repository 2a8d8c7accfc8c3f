"""Non-finite losses and gradients: the optimizer step is skipped (parameters and optimizer state
untouched) and counted; ``trainer.max_bad_steps`` such RL steps in a row stop the run with a message
and a checkpoint whose weights no bad step touched."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from tensordict import TensorDict

from tearless.config import load_config
from tearless.run import checkpoint as ckpt
from tearless.run.tracking import read_metrics
from tearless.trainers.rl import RLTrainer, TrainingStopped
from tearless.workers.optim import make_optimizer
from tearless.workers.schedule import (
    UpdateFlags,
    UpdateSettings,
    combined_metrics,
    plan_updates,
    rank_work,
    run_plan,
)
from tests.faults.chain import _equal, optimizer_state


def _batch(rows=4, length=3):
    return TensorDict(
        {
            "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
            "response_mask": torch.ones(rows, length, dtype=torch.long),
            "x": torch.arange(rows * length, dtype=torch.float32).reshape(rows, length),
        },
        batch_size=[rows],
    )


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_a_non_finite_mini_batch_skips_its_step_and_leaves_the_optimizer_untouched(poison):
    # Two mini-batches of 2 rows: the first is clean, the second poisoned. The first step moves the
    # weight; the second must leave the weight, AdamW's moments and its step count as the first left them.
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    params = list(model.parameters())
    optim_cfg = load_config(None).actor_rollout_ref.actor.optim
    optimizer, scheduler = make_optimizer(params, optim_cfg, total_steps=10)
    if poison == "grad":
        # A NaN gradient with a finite loss: only the gradient norm tells.
        model.weight.register_hook(lambda g: g * float("nan") if model.poisoned else g)

    def micro_loss(mb, norm, flags):
        out = model(mb["x"]).sum()
        bad = bool(mb["x"][0, 0] >= 6)  # rows 2 and 3: the second mini-batch
        model.poisoned = bad
        if bad and poison == "loss":
            # NaN in a term that does not reach the parameters: the gradient stays finite.
            out = out + torch.tensor(float("nan"))
        return out, {}

    snapshots = []
    optimizer.register_step_post_hook(
        lambda opt, args, kwargs: snapshots.append(
            ({k: v.clone() for k, v in model.state_dict().items()}, copy.deepcopy(opt.state_dict()))
        )
    )
    s = UpdateSettings(
        rows_per_mini=2,
        epochs=1,
        shuffle=False,
        micro_size=None,
        token_budget=None,
        grad_clip=1.0,
        prefix="actor",
    )
    unit = SimpleNamespace(
        model=model,
        params=params,
        optimizer=optimizer,
        scheduler=scheduler,
        skipped_steps=3,
        settings=s,
        micro_loss=micro_loss,
    )
    ((rows, steps),) = rank_work(_batch(), plan_updates(_batch(), s, 1), 1)
    out = combined_metrics([run_plan(unit, rows, steps, UpdateFlags())], {})
    assert (
        unit.skipped_steps == 4
        and out["actor/skipped_steps"] == 4.0
        and out["actor/num_optimizer_steps"] == 2.0
    )
    assert len(snapshots) == 1  # the clean mini-batch's step only
    weights, state = snapshots[0]
    assert all(model.state_dict()[k].equal(v) for k, v in weights.items())
    assert _equal(optimizer.state_dict()["state"], state["state"])
    assert all(p.grad is None for p in params)  # nothing non-finite is left for a later step


@pytest.mark.slow
def test_max_bad_steps_in_a_row_stop_the_run_with_a_clean_checkpoint(overrides, tmp_path):
    # Steps 3 and 4 get a NaN gradient (a real backward through the model, poisoned by a hook);
    # with max_bad_steps=2 the run stops after step 4 of 6.
    cfg = load_config(
        None,
        overrides(
            tmp_path,
            "trainer.total_training_steps=6",
            "trainer.save_freq=2",
            "trainer.max_bad_steps=2",
            "trainer.val_before_train=false",
            "data.val_max_samples=4",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        ),
    )
    trainer = RLTrainer(cfg, log=lambda _: None)
    poisoned = {"on": False}
    model = trainer.workers.rank.roles["actor"].model  # the single-process placement: one rank here
    model.lm_head.weight.register_hook(lambda g: g * float("nan") if poisoned["on"] else g)
    original = trainer.train_step

    def train_step(step):
        poisoned["on"] = step >= 3
        return original(step)

    trainer.train_step = train_step
    with pytest.raises(TrainingStopped) as info:
        trainer.fit()
    message = str(info.value)
    assert "trainer.max_bad_steps=2: steps 3..4 in a row had a non-finite loss or gradient norm" in message
    assert f"{tmp_path / 'global_step_4'} holds the weights and optimizer state with none of" in message
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["training/bad_steps_in_a_row"] for r in records] == [0, 0, 1, 2]
    assert [r["actor/skipped_steps"] for r in records] == [0, 0, 1, 2]
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["global_step_2", "global_step_4"]
    a = load_file(tmp_path / "global_step_2" / "actor" / "model.safetensors")
    b = load_file(tmp_path / "global_step_4" / "actor" / "model.safetensors")
    assert all(a[k].equal(b[k]) for k in a)
    s4 = ckpt.load_state(tmp_path / "global_step_4")
    assert _equal(optimizer_state(tmp_path / "global_step_2"), optimizer_state(tmp_path / "global_step_4"))
    assert s4["bad_steps"] == 2 and s4["workers"]["actor"]["skipped_steps"] == 2
