"""``fsdp_config.compute_copies=true`` end to end, bf16 forced on (this CPU may emulate it; the tiny
model keeps that cheap), full fine-tuning and LoRA: the actor trains from bf16 copies of float32
masters, the reference is held in bf16 (LoRA: the base itself is, the reference being the adapters-off
actor), checkpoints hold the float32 masters and the optimizer state of every trained parameter, and a
run resumed from step 1 lands on the uninterrupted run's step 2 bit for bit."""

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
from tearless.workers import build, critic
from tests.trainers.test_resume import comparable

pytestmark = pytest.mark.slow

ARR = "actor_rollout_ref"


KINDS = {
    "full": [],
    "lora": [f"{ARR}.model.lora_rank=4", f"{ARR}.actor.optim.lr=2e-3", f"{ARR}.model.lora_save_merged=true"],
    "critic": [  # PPO: the critic by its own keys
        "algorithm.adv_estimator=gae",
        "critic.model.fsdp_config.param_dtype=bfloat16",
        "critic.model.fsdp_config.compute_copies=true",
    ],
}


def run_args(overrides, run_dir, kind):
    return overrides(
        run_dir,
        *KINDS[kind],
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


@pytest.fixture(scope="module", params=list(KINDS))
def runs(request, overrides, tmp_path_factory):
    kind = request.param
    root = tmp_path_factory.mktemp(f"copies-{kind}")
    made: list[tuple] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(precision, "cpu_has_native_bf16", lambda: True)
        for name, real in (("attach", build.attach), ("hold_in", build.hold_in)):

            def counted(model, dtype, _name=name, _real=real, **kw):
                made.append((_name, dtype, *kw.values()))
                out = _real(model, dtype, **kw)
                if _name == "attach":  # the bytes the actor holds, once built
                    made.append(sorted({(p.dtype, p.requires_grad) for p in model.parameters()}, key=str))
                return out

            mp.setattr(build, name, counted)
        values = critic.response_values

        def seen_values(model, *args, **kw):  # what each critic pass computes from
            passes.add((torch.is_grad_enabled(), *sorted({str(p.dtype) for p in model.parameters()})))
            return values(model, *args, **kw)

        passes: set[tuple] = set()
        mp.setattr(critic, "response_values", seen_values)
        full, logs = root / "full", []
        train(None, run_args(overrides, full, kind), log=logs.append)
        resumed = root / "resumed"
        shutil.copytree(full, resumed)
        shutil.rmtree(resumed / "global_step_2")
        (resumed / "latest_checkpointed_iteration.txt").write_text("1")
        summary = train(None, run_args(overrides, resumed, kind), log=lambda _: None)
    return dict(kind=kind, full=full, resumed=resumed, summary=summary, made=made, passes=passes, logs=logs)


def test_the_actor_has_copies_and_the_reference_is_held_in_bf16(runs):
    f32, bf16 = torch.float32, torch.bfloat16
    if runs["kind"] != "lora":
        # Two runs, each: copies for the trained actor (float32 masters), its parameters in bf16 for
        # the frozen reference; PPO: copies for the critic too.
        made = [("attach", bf16, False), [(f32, True)], ("hold_in", bf16)]
        if runs["kind"] == "critic":
            made = [*made, ("attach", bf16, False), [(f32, True)]]
            # The critic's values for GAE (no grad) and its update (grad) both from the copies.
            assert runs["passes"] == {(False, "torch.bfloat16"), (True, "torch.bfloat16")}
    else:
        # LoRA: the base held in bf16 (the hybrid engine samples in bf16), float32 adapter masters;
        # the reference is the adapters-off actor, no model of its own.
        made = [("attach", bf16, True), [(bf16, False), (f32, True)]]
    assert runs["made"] == made * 2
    # One line at start says so, naming each key that computes from copies (LoRA's reference, the
    # adapters-off actor, and the hybrid engine compute from the actor's), and none says autocast.
    keys = [f"{ARR}.actor.fsdp_config.param_dtype", f"{ARR}.ref.fsdp_config.param_dtype"]
    keys += ["critic.model.fsdp_config.param_dtype"] if runs["kind"] == "critic" else []
    said = [line.split(":")[0] for line in runs["logs"] if line.startswith("bf16 ")]
    assert said == [f"bf16 compute copies are on ({', '.join([*keys, f'{ARR}.rollout.dtype'])})"]


def test_checkpoints_hold_float32_masters_and_every_parameters_optimizer_state(runs, task):
    start = load_file(Path(task.model_dir) / "model.safetensors")
    step = runs["full"] / "global_step_2"
    if runs["kind"] == "lora":
        adapter = load_file(step / "actor" / "adapter_model.safetensors")
        assert adapter and {t.dtype for t in adapter.values()} == {torch.float32}
        # The merged export is float32 throughout, though the base was held in bf16: W rounded to bf16
        # (exact in float32) plus the float32 (α/r)·B A.
        merged = load_file(step / "actor_merged" / "model.safetensors")
        assert merged.keys() == start.keys() and {t.dtype for t in merged.values()} == {torch.float32}
        held = {k: start[k].to(torch.bfloat16).float() for k in start}
        assert all(merged[k].equal(held[k]) for k in merged if "proj" not in k)
        assert [k for k in merged if "proj" in k and not merged[k].equal(held[k])]
        return
    for role in ("actor", "critic") if runs["kind"] == "critic" else ("actor",):
        weights = load_file(step / role / "model.safetensors")
        assert {t.dtype for t in weights.values()} == {torch.float32}
        # Float32 masters, moved by small AdamW steps: values a bf16 tensor could not hold.
        moved = [k for k in weights if k in start and not weights[k].equal(start[k])]
        assert moved
        assert any(not weights[k].equal(weights[k].to(torch.bfloat16).float()) for k in moved)
        index = json.loads((step / "optim" / role / "index.json").read_text())
        assert index["params"]
        assert all(p["keys"] == ["exp_avg", "exp_avg_sq"] for p in index["params"].values())


def test_a_run_resumed_from_step_1_lands_on_step_2_bit_for_bit(runs):
    assert runs["summary"]["start_step"] == 1
    a = {r["step"]: comparable(r) for r in read_metrics(runs["full"] / "metrics.jsonl")}
    b = {r["step"]: comparable(r) for r in read_metrics(runs["resumed"] / "metrics.jsonl")}
    assert b[2] == a[2]
    name = "adapter_model.safetensors" if runs["kind"] == "lora" else "model.safetensors"
    for role in ("actor", "critic") if runs["kind"] == "critic" else ("actor",):
        wa = load_file(runs["full"] / "global_step_2" / role / name)
        wb = load_file(runs["resumed"] / "global_step_2" / role / name)
        assert wa
        assert [k for k in wa if not wa[k].equal(wb[k])] == []
