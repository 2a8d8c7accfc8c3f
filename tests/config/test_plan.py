"""The run's plan (tearless/config/plan.py): each derived fact worked out by hand from the config, the
config left as the user wrote it, and the measured ``auto`` held by the plan alone."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from tearless.config import load_config
from tearless.config.plan import RunFiles, build_plan
from tearless.workers.calibrate import resolve_auto
from tearless.workers.spec import RankSpec


def cfg_of(*overrides: str):
    return load_config(None, list(overrides), notify=lambda _: None)


def test_default_run_plan_by_hand():
    # defaults: data.max_response_length=16, rollout.response_length null, train_batch_size =
    # ppo_mini_batch_size = 16 prompts, ppo_epochs 1, the built-in hf engine sampling the trained weights
    plan = build_plan(cfg_of())
    assert plan.response_length == 16
    assert plan.loss_scale_factor == 16.0
    assert plan.roles == ("actor",) and not plan.critic and not plan.distills
    assert not plan.capabilities.holds_own_weights and plan.capabilities.exact_log_probs
    assert not plan.separate_rollout
    assert plan.on_policy(16) and not plan.on_policy(8)
    assert plan.rollout_dtype("cpu") == "float32" and plan.rollout_dtype("cuda") == "bfloat16"
    assert plan.param_dtypes == {"actor": None, "ref": None, "teacher": None, "critic": None}


def test_response_cap_and_loss_constant_follow_their_keys():
    plan = build_plan(cfg_of("actor_rollout_ref.rollout.response_length=24", "data.max_response_length=32"))
    assert plan.response_length == 24 and plan.loss_scale_factor == 24.0
    given = build_plan(cfg_of("actor_rollout_ref.actor.loss_scale_factor=100"))
    assert given.response_length == 16 and given.loss_scale_factor == 100.0


def test_two_epochs_are_never_on_policy():
    plan = build_plan(cfg_of("actor_rollout_ref.actor.ppo_epochs=2"))
    assert plan.on_policy_prompts is None
    assert not any(plan.on_policy(n) for n in (1, 8, 16))


def test_roles_and_the_critic_section_resolved_from_the_actor():
    cfg = cfg_of(
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_epochs=2",
    )
    plan = build_plan(cfg)
    assert plan.roles == ("actor", "ref", "critic") and plan.critic
    section = plan.critic_section
    assert (section.ppo_mini_batch_size, section.ppo_epochs, section.loss_scale_factor) == (8, 2, 16.0)
    assert section.loss_agg_mode == cfg.actor_rollout_ref.actor.loss_agg_mode
    # the config keeps its nulls: the plan holds a copy
    assert cfg.critic.ppo_mini_batch_size is None and cfg.critic.loss_scale_factor is None


def test_precision_mismatch_by_device_and_dtype():
    # on a GPU the actor's null param_dtype computes in bf16; rollout.dtype=float32 samples in float32
    plan = build_plan(cfg_of("actor_rollout_ref.rollout.dtype=float32"))
    assert plan.hybrid_rollout_dtype("cuda", warn=False) == torch.float32
    assert plan.precision_mismatch("cuda") and not plan.precision_mismatch("cpu")
    # with rollout.dtype null the engine computes in the actor's dtype: no mismatch anywhere
    same = build_plan(cfg_of())
    assert not same.precision_mismatch("cuda") and not same.precision_mismatch("cpu")


def test_a_lora_base_is_held_in_bf16_only_where_its_engine_samples_in_bf16(monkeypatch):
    from tearless.models import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    arr = "actor_rollout_ref"
    copies = (
        f"{arr}.model.lora_rank=4",
        f"{arr}.actor.fsdp_config.param_dtype=bfloat16",
        f"{arr}.actor.fsdp_config.compute_copies=true",
    )
    split = ("trainer.placement=ray", f"{arr}.rollout.nnodes=1", f"{arr}.rollout.n_gpus_per_node=1")
    bf16, fp32 = f"{arr}.rollout.dtype=bfloat16", f"{arr}.rollout.dtype=float32"

    def held(*extra, own_weights=False):
        plan = build_plan(cfg_of(*copies, *extra))
        if own_weights:  # an engine holding its own copy (vLLM, not installed here)
            caps = dataclasses.replace(plan.capabilities, holds_own_weights=True)
            plan = dataclasses.replace(plan, capabilities=caps, separate_rollout=True)
        return plan.holds_base_in_copies("cpu")

    # The hybrid built-in engine computes in rollout.dtype, else in the actor's bf16.
    assert held() and held(bf16) and not held(fp32)
    # An engine of its own, and the built-in engine on rollout nodes, hold rollout.dtype (float32 on
    # CPU): a float32 engine is sent float32 weights, so the base keeps its float32 masters.
    assert not held(own_weights=True) and held(bf16, own_weights=True)
    assert not held(*split) and held(*split, bf16)
    assert not build_plan(cfg_of(*copies[1:])).holds_base_in_copies("cpu")  # no LoRA: no base


def test_the_measured_auto_lives_in_the_plan_not_the_config():
    cfg = cfg_of("actor_rollout_ref.actor.fsdp_config.param_dtype=auto")
    plan = build_plan(cfg)
    assert plan.param_dtype("actor") == "auto"
    resolved = plan.with_dtypes({"actor": "bfloat16"})
    assert resolved.param_dtype("actor") == "bfloat16" and resolved.auto_resolved == {"actor"}
    assert plan.param_dtype("actor") == "auto"  # the unresolved plan is another object
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_dtype == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.response_length = 8  # type: ignore[misc]
    # what a Ray rank receives: the same plan after pickling
    assert pickle.loads(pickle.dumps(resolved)) == resolved


def test_resolve_auto_on_a_gpu_driver_names_each_section_once(tmp_path):
    # the actor and the reference read one model: one choice, one line naming both sections; the
    # teacher is not built, so its auto stays unresolved
    cfg = cfg_of(
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.fsdp_config.param_dtype=auto",
        "actor_rollout_ref.ref.fsdp_config.param_dtype=auto",
        "actor_rollout_ref.teacher.fsdp_config.param_dtype=auto",
    )
    lines: list[str] = []
    files = RunFiles(str(tmp_path), None, None, None, None)
    plan = resolve_auto(cfg, build_plan(cfg, files), gpu=True, log=lines.append)
    assert lines == [
        "precision: fsdp_config.param_dtype=auto -> bfloat16 for actor_rollout_ref.actor, "
        "actor_rollout_ref.ref (a GPU: bf16 tensor cores)"
    ]
    assert (plan.param_dtype("actor"), plan.param_dtype("ref"), plan.param_dtype("teacher")) == (
        "bfloat16",
        "bfloat16",
        "auto",
    )
    assert plan.auto_resolved == {"actor", "ref"}
    assert cfg.actor_rollout_ref.ref.fsdp_config.param_dtype == "auto"


def test_a_spec_given_no_plan_builds_its_configs():
    cfg = cfg_of("data.max_response_length=12")
    spec = RankSpec(cfg, ("actor",), False, "unused", 1, "cpu")
    assert spec.plan == build_plan(cfg) and spec.plan.response_length == 12


def test_the_lora_sync_is_the_keys_or_the_devices_default():
    from tearless.config import load_config
    from tearless.config.plan import build_plan

    assert build_plan(load_config(None, [])).lora_sync("cpu") == "merged"
    assert build_plan(load_config(None, [])).lora_sync("cuda") == "adapter"
    chosen = build_plan(load_config(None, ["actor_rollout_ref.rollout.lora_sync=adapter"]))
    assert chosen.lora_sync("cpu") == chosen.lora_sync("cuda") == "adapter"


def test_the_drivers_files_and_source_settings_travel_in_the_plan():
    cfg = cfg_of(
        "actor_rollout_ref.rollout.n=4", "data.max_response_length=12", "algorithm.adv_estimator=remax"
    )
    files = RunFiles("/models/policy", ["train.parquet"], ["val.parquet"], "tools.yaml", "/models/teacher")
    plan = build_plan(cfg, files, total_steps=7)
    assert plan.files == files
    s = plan.source
    # 4 samples of each of the 16 prompts, 12 new tokens (the response cap), a synchronous source (k = 0)
    # with ReMax's greedy baselines, over the 7 steps the driver counted
    assert (s.n, s.max_new_tokens, s.total_steps, s.target_groups) == (4, 12, 7, 16)
    assert (s.max_staleness, s.asynchronous, s.greedy_baselines, s.filter_groups) == (0, False, True, False)
    assert s.seed == cfg.trainer.seed and s.sampling == {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    # a plan built without a driver holds neither; a Ray rank receives the driver's as sent
    bare = build_plan(cfg)
    assert bare.files is None and bare.source is None
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_a_spec_carries_the_plan_not_the_config():
    cfg = cfg_of("data.max_response_length=12", "trainer.seed=3")
    spec = RankSpec(cfg, ("actor",), False, "unused", 1, "cpu")
    assert "cfg" not in vars(spec)  # what a Ray rank receives: the plan, its sections, no config
    assert spec.sections.rollout is cfg.actor_rollout_ref.rollout  # the config's own section, not a copy
    assert spec.sections.trainer.seed == 3 and spec.sections.fsdp("critic") is cfg.critic.model.fsdp_config
    received = pickle.loads(pickle.dumps(spec))
    assert received.plan == spec.plan and received.plan.response_length == 12
    moved = spec.replaced(roles=(), rollout=True)
    assert moved.plan is spec.plan and (moved.roles, moved.rollout) == ((), True)
    assert spec.roles == ("actor",)
    with pytest.raises(ValueError, match="needs a plan, or the config"):
        RankSpec(None, ("actor",), False, "unused", 1, "cpu")


def test_the_driver_resolves_the_adapter_and_the_critic_into_the_plans_files(tmp_path, monkeypatch, task):
    """A LoRA adapter and a critic named by Hub ID become their cached snapshots in the driver, once:
    the plan's files hold the local directories the ranks load; a run without a critic (or without
    LoRA) resolves neither."""
    import json

    from tearless.models.hub import add_to_hub_cache
    from tearless.trainers.setup import resolve_files
    from tests.conftest import small_overrides

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    adapter_snapshot = add_to_hub_cache(adapter, "org/adapter", commit="a" * 40)
    critic_snapshot = add_to_hub_cache(task.model_dir, "org/critic", commit="c" * 40)
    base = [*small_overrides(task, tmp_path / "run"), "critic.model.path=org/critic"]
    lora = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_adapter_path=org/adapter"]

    files = resolve_files(cfg_of(*base, *lora, "algorithm.adv_estimator=gae"), log=lambda _: None)
    assert (files.lora_adapter_path, files.critic_path) == (str(adapter_snapshot), str(critic_snapshot))
    assert build_plan(cfg_of(*base), files).files.critic_path == str(critic_snapshot)
    # GRPO has no critic: its critic.model.path is never resolved (nor downloaded)
    assert resolve_files(cfg_of(*base), log=lambda _: None).critic_path is None
    # a critic without its own path starts from the policy's weights (RunFiles leaves it None)
    gae = [*small_overrides(task, tmp_path / "run"), "algorithm.adv_estimator=gae"]
    assert resolve_files(cfg_of(*gae), log=lambda _: None).critic_path is None
