"""veRL's own example scripts and ppo_trainer.yaml keys load, and the four scripts train 2 steps.

The override lists in tests/config/verl/ are copied from veRL's example scripts (the commit is in each
file's header) with only the model path, data files and GPU count replaced, and, for speed on a CPU,
data.train_batch_size / actor.ppo_mini_batch_size (the smallest sizes that keep veRL's micro-batch
sizes dividing the mini-batch) and data.max_response_length=16.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tearless.config import ConfigError, load_config
from tearless.config.load import _keys_of
from tearless.config.schema import Config
from tearless.config.verl_compat import RULES, rule_for

HERE = Path(__file__).parent / "verl"
SCRIPTS = ["grpo_qwen2-7b", "grpo_qwen2-7b_seq_balance", "grpo_qwen2_5-3b_gsm8k_lora", "ppo_deepseek7b_llm"]


def _lines(name: str, **paths: str) -> list[str]:
    text = (HERE / f"{name}.txt").read_text()
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return [line.format(**paths) for line in lines] if paths else lines


def _script(name: str, model="/m", train="/t.parquet", val="/v.parquet") -> list[str]:
    return _lines(name, model=model, train_file=train, val_file=val)


def _lacking(overrides: list[str]) -> list[str]:
    """The overrides that name an engine or package this machine lacks (sglang; vllm without vllm;
    wandb without wandb), each of which is refused with its reason."""
    out = []
    for item in overrides:
        key, value = item.split("=", 1)
        if key == "actor_rollout_ref.rollout.name" and (
            value == "sglang" or importlib.util.find_spec("vllm") is None
        ):
            out.append(item)
        if key == "trainer.logger" and "wandb" in value and importlib.util.find_spec("wandb") is None:
            out.append(item)
    return out


def test_every_ppo_trainer_key_is_a_tearless_key_or_in_the_table():
    keys, _ = _keys_of(Config)
    lines = _lines("ppo_trainer_defaults")
    assert len(lines) == 556  # the flattened _generated_ppo_trainer.yaml
    unmatched = [x for x in lines if x.split("=", 1)[0] not in keys and rule_for(x.split("=", 1)[0]) is None]
    assert unmatched == []


def test_ppo_trainer_defaults_of_veRL_only_keys_load_with_notices_and_aliases():
    keys, _ = _keys_of(Config)
    extra = [x for x in _lines("ppo_trainer_defaults") if x.split("=", 1)[0] not in keys]
    notes: list[str] = []
    cfg = load_config(None, [*extra, "actor_rollout_ref.actor.optim.clip_grad=0.5"], notify=notes.append)
    # lora_adapter_path (issue 32), enforce_eager (31), model.external_lib (34) and the actor's
    # calculate_entropy, entropy_from_logits_with_chunking, entropy_checkpointing (41), the actor's
    # freeze_vision_tower and data.image_key (46), the actor's and reference's use_torch_compile (41)
    # are tearless keys
    assert len(extra) == 394
    # Aliases move the value (clip_grad → grad_clip, fsdp_config.dtype → param_dtype) without a note;
    # every other key gets exactly one note.
    aliased = [x for x in extra if rule_for(x.split("=", 1)[0]).alias is not None]
    assert len(notes) == len(extra) - len(aliased)
    assert cfg.actor_rollout_ref.actor.grad_clip == 0.5
    assert any(n.startswith("trainer.use_legacy_worker_impl=auto has no effect here") for n in notes)


TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_aliases_set_the_tearless_key():
    cfg = load_config(
        None,
        [
            "critic.optim.clip_grad=0.3",
            "actor_rollout_ref.actor.fsdp_config.dtype=bfloat16",
            f"actor_rollout_ref.model.custom_chat_template='{TEMPLATE}'",
            "ray_kwargs.ray_init.num_cpus=3",
        ],
        notify=lambda _: None,
    )
    assert cfg.critic.grad_clip == 0.3
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_dtype == "bfloat16"
    assert cfg.data.chat_template == TEMPLATE
    assert cfg.ray_init.num_cpus == 3


@pytest.mark.parametrize(
    ("item", "says"),
    [
        ("actor_rollout_ref.rollout.name=sglang", "no sglang or TensorRT-LLM backend"),
        ("actor_rollout_ref.actor.strategy=megatron", "no Megatron backend"),
        ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "Ulysses sequence parallelism"),
        ("algorithm.use_pf_ppo=true", "PF-PPO"),
        ("actor_rollout_ref.model.trust_remote_code=true", "without remote code"),
    ],
)
def test_refusals_name_the_key_why_and_what_instead(item, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, [item], notify=lambda _: None)
    text = str(e.value)
    assert item.split("=")[0] in text and says in text and "Instead:" in text


def test_accepted_values_note_once_and_refused_values_of_the_same_key_fail():
    notes: list[str] = []
    load_config(None, ["actor_rollout_ref.rollout.mode=async", "trainer.logger=console"], notify=notes.append)
    assert len(notes) == 1 and notes[0].startswith("actor_rollout_ref.rollout.mode=async has no effect")
    with pytest.raises(ConfigError, match=r"rollout\.mode"):
        load_config(None, ["actor_rollout_ref.rollout.mode=batch"], notify=notes.append)


def test_a_single_logger_name_is_a_list():
    cfg = load_config(None, ["trainer.logger=console"])
    assert cfg.trainer.logger == ["console"]


def test_every_rule_pattern_is_distinct():
    patterns = [r.pattern for r in RULES]
    assert len(patterns) == len(set(patterns))


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_keys_lacking_here_are_refused_by_name(name):
    overrides = _script(name)
    lacking = _lacking(overrides)
    for item in lacking:
        others = [x for x in overrides if x not in lacking]
        with pytest.raises(ConfigError) as e:
            load_config(None, [*others, item], notify=lambda _: None)
        # vllm's own refusal may come first from its tensor_model_parallel_size (one engine per GPU).
        key = item.split("=")[0]
        assert key in str(e.value) or (key.endswith("rollout.name") and "vLLM engine" in str(e.value))
    # Every other key of the script loads as it is.
    load_config(None, [x for x in overrides if x not in lacking], notify=lambda _: None)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_trains_two_steps(name, task, tmp_path, capsys):
    """The script's overrides (minus the engine/package this machine lacks), plus the run directory,
    2 steps, 8 validation prompts and in-process scoring so that it takes seconds."""
    from tearless import train

    overrides = _script(name, str(task.model_dir), str(task.train_file), str(task.val_file))
    overrides = [x for x in overrides if x not in _lacking(overrides)]
    summary = train(
        None,
        [
            *overrides,
            f"trainer.default_local_dir={tmp_path}",
            "trainer.total_training_steps=2",
            "data.val_max_samples=8",
            "reward_model.num_workers=0",
        ],
        log=lambda _: None,
    )
    assert summary["steps"] == 2
    from tearless.run.tracking import read_metrics

    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "critic/score/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= r["critic/score/mean"] <= 1.0
    if name.startswith("ppo"):
        assert all("critic/vf_loss" in r for r in steps)
    # Every sample of every prompt group is recorded by default (trainer.num_rollout_samples=-1).
    from tearless.trainers.records import ROLLOUTS_FILE, read_records

    records = read_records(tmp_path / ROLLOUTS_FILE)
    # prompts × rollout.n: the PPO script leaves n to the default, tearless's 8 (veRL's is 1).
    per_step = {"ppo_deepseek7b_llm": 32 * 8}.get(name, 8 * 5)
    assert [sum(r["step"] == s for r in records) for s in (1, 2)] == [per_step, per_step]


def test_the_docs_page_lists_every_rule():
    page = (Path(__file__).parents[2] / "docs" / "verl-compat.md").read_text()
    missing = [r.pattern for r in RULES if f"| `{r.pattern}` |" not in page]
    assert missing == []


def test_sft_takes_verls_partial_pretrain(tmp_path):
    from tearless.config.sft import SFTConfig

    cfg = load_config(None, [f"model.partial_pretrain={tmp_path}"], schema=SFTConfig)
    assert cfg.model.path == str(tmp_path)


def test_verls_defaults_with_gspo_load_and_keep_verls_token_mean():
    # veRL 0.9.1 aggregates GSPO with actor.loss_agg_mode (default token-mean): its ppo_trainer.yaml with
    # only the loss mode changed must load and train with that mode, not be refused or changed.
    # Its actor lines (and the batch size they divide) that are tearless keys are enough to show it.
    keys, _ = _keys_of(Config)
    actor = [
        x for x in _lines("ppo_trainer_defaults")
        if x.startswith(("actor_rollout_ref.actor.", "data.train_batch_size="))
    ]  # fmt: skip
    lines = [x.replace("loss_mode=vanilla", "loss_mode=gspo") for x in actor if x.split("=", 1)[0] in keys]
    assert "actor_rollout_ref.actor.loss_agg_mode=token-mean" in lines
    cfg = load_config(None, lines)
    actor = cfg.actor_rollout_ref.actor
    assert (actor.policy_loss.loss_mode, actor.loss_agg_mode) == ("gspo", "token-mean")
