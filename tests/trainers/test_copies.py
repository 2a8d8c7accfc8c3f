"""``fsdp_config.compute_copies=true`` end to end, bf16 forced on (this CPU may emulate it; the tiny
model keeps that cheap): the actor trains from bf16 copies of float32 masters, the reference is held
in bf16, checkpoints hold the float32 masters and the optimizer state of every trained parameter,
and a run resumed from step 1 lands on the uninterrupted run's step 2 bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tearless import train
from tearless.models import precision
from tearless.run.tracking import read_metrics
from tearless.workers import build
from tests.trainers.test_resume import comparable

pytestmark = pytest.mark.slow

ARR = "actor_rollout_ref"


def run_args(overrides, run_dir):
    return overrides(
        run_dir,
        f"{ARR}.actor.fsdp_config.param_dtype=bfloat16",
        f"{ARR}.ref.fsdp_config.param_dtype=bfloat16",
        f"{ARR}.actor.fsdp_config.compute_copies=true",  # the reference follows the actor's setting
        f"{ARR}.actor.use_kl_loss=true",
        f"{ARR}.actor.ppo_mini_batch_size=4",  # two optimizer steps per RL step
        "data.val_max_samples=8",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=null",
        "trainer.num_threads=1",
    )


@pytest.fixture(scope="module")
def runs(overrides, tmp_path_factory):
    root = tmp_path_factory.mktemp("copies")
    made: list[tuple[str, torch.dtype]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "cpu_has_native_bf16", lambda: True)
        for name, real in (("attach", build.attach), ("hold_in", build.hold_in)):

            def counted(model, dtype, _name=name, _real=real):
                made.append((_name, dtype))
                return _real(model, dtype)

            mp.setattr(build, name, counted)
        full = root / "full"
        train(None, run_args(overrides, full), log=lambda _: None)
        resumed = root / "resumed"
        shutil.copytree(full, resumed)
        shutil.rmtree(resumed / "global_step_2")
        (resumed / "latest_checkpointed_iteration.txt").write_text("1")
        summary = train(None, run_args(overrides, resumed), log=lambda _: None)
    return dict(full=full, resumed=resumed, summary=summary, made=made)


def test_the_actor_has_copies_and_the_reference_is_held_in_bf16(runs):
    # Two runs, each: copies for the trained actor, its parameters in bf16 for the frozen reference.
    assert runs["made"] == [("attach", torch.bfloat16), ("hold_in", torch.bfloat16)] * 2


def test_checkpoints_hold_float32_masters_and_every_parameters_optimizer_state(runs, task):
    start = load_file(Path(task.model_dir) / "model.safetensors")
    weights = load_file(runs["full"] / "global_step_2" / "actor" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    # Float32 masters, moved by small AdamW steps: values a bf16 tensor could not hold.
    moved = [k for k in weights if not weights[k].equal(start[k])]
    assert moved
    assert any(not weights[k].equal(weights[k].to(torch.bfloat16).float()) for k in moved)
    index = json.loads((runs["full"] / "global_step_2" / "optim" / "actor" / "index.json").read_text())
    assert index["params"] and all(p["keys"] == ["exp_avg", "exp_avg_sq"] for p in index["params"].values())


def test_a_run_resumed_from_step_1_lands_on_step_2_bit_for_bit(runs):
    assert runs["summary"]["start_step"] == 1
    a = {r["step"]: comparable(r) for r in read_metrics(runs["full"] / "metrics.jsonl")}
    b = {r["step"]: comparable(r) for r in read_metrics(runs["resumed"] / "metrics.jsonl")}
    assert b[2] == a[2]
    wa = load_file(runs["full"] / "global_step_2" / "actor" / "model.safetensors")
    wb = load_file(runs["resumed"] / "global_step_2" / "actor" / "model.safetensors")
    assert [k for k in wa if not wa[k].equal(wb[k])] == []
