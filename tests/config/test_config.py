"""Config: defaults, YAML, dicts and dotted overrides; every mistake caught before anything heavy runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import pytest

import tearless
from tearless.config import Config, ConfigError, describe, load_config, to_dict, to_yaml
from tearless.config.schema import all_keys

# Paths that do not exist: a config check that ran after loading anything would fail differently.
MISSING = [
    "actor_rollout_ref.model.path=/nonexistent/model",
    "data.train_files=/nonexistent/train.parquet",
    "data.val_files=/nonexistent/test.parquet",
]


def fails(*overrides: str) -> str:
    """The ConfigError message of training with ``overrides``.

    Goes through ``tearless.train`` with model and data paths that do not exist, so a config check
    that ran after loading anything would surface as a FileNotFoundError instead.
    """
    with pytest.raises(ConfigError) as info:
        tearless.train(None, [*MISSING, *overrides])
    return str(info.value)


def test_defaults_are_valid_and_mirror_verl_names():
    cfg = load_config()
    assert cfg.algorithm.adv_estimator == "grpo"
    # null: token-mean for every term (veRL's default), the policy term of sapo/geo_mean their own.
    assert cfg.actor_rollout_ref.actor.loss_agg_mode is None
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.2 and cfg.actor_rollout_ref.actor.clip_ratio_c == 3.0
    assert cfg.trainer.resume_mode == "auto"
    # Interpolation resolves when the config is built.
    assert load_config(None, ["trainer.experiment_name=x"]).trainer.default_local_dir == "runs/tearless/x"


def test_unknown_key_names_it_and_suggests_the_close_match():
    msg = fails("data.train_batch_sise=3")
    assert "'data.train_batch_sise'" in msg and "Did you mean data.train_batch_size" in msg
    assert "tearless config show" in msg
    msg = fails("actor_rollout_ref.actor.clip_ration=0.3")
    assert "actor_rollout_ref.actor.clip_ratio" in msg


def test_a_misspelt_key_fails_naming_it():
    msg = fails("actor_rollout_ref.model.use_remove_paddings=true")
    assert "unknown config key 'actor_rollout_ref.model.use_remove_paddings'" in msg


def test_wrong_type_names_the_key_and_the_value():
    msg = fails("data.train_batch_size=abc")
    assert "'data.train_batch_size'" in msg and "abc" in msg
    msg = fails("actor_rollout_ref.actor.use_kl_loss=maybe")
    assert "use_kl_loss" in msg


@pytest.mark.parametrize(
    "override",
    [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=abc",
        "trainer.total_training_steps=abc",
        "trainer.total_training_steps=-3",
        "trainer.max_actor_ckpt_to_keep=abc",
        "actor_rollout_ref.rollout.response_length=abc",
    ],
)
def test_wrong_type_in_an_optional_field_names_the_key(override):
    # Fields whose default is null (typed Any in the schema) still take numbers only.
    key = override.split("=")[0]
    assert key in fails(override)


def test_train_batch_not_divisible_by_mini_batch_shows_the_arithmetic():
    msg = fails(
        "data.train_batch_size=12",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
    )
    # 12 prompts × 4 = 48 responses cannot be cut into mini-batches of 8 × 4 = 32.
    assert msg.startswith("actor_rollout_ref.actor.ppo_mini_batch_size:")
    assert "data.train_batch_size × rollout.n = 48" in msg and "ppo_mini_batch_size × n = 32" in msg
    assert "multiple of ppo_mini_batch_size" in msg
    assert "ppo_mini_batch_size" in fails(
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8"
    )


def test_micro_batch_must_divide_the_mini_batch_responses():
    msg = fails(
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
    )
    assert "ppo_micro_batch_size_per_gpu" in msg and "= 32 responses" in msg and "size 5" in msg
    # With dynamic batching the count is not used; the token budget must hold one sequence.
    msg = fails(
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=50",
        "data.max_prompt_length=64",
        "data.max_response_length=16",
    )
    assert "ppo_max_token_len_per_gpu" in msg and "80" in msg


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "actor_rollout_ref.actor.clip_ratio_c", "> 1"),
        (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "actor_rollout_ref.actor.clip_ratio_c", "> 1"),
        (["algorithm.adv_estimator=gae", "critic.enable=false"], "critic.enable", "critic's values"),
        (
            ["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"],
            "actor_rollout_ref.rollout.n",
            "2",
        ),
        (["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"], "rollout.n", "at least 2"),
        (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator", "grpo"),
        (["actor_rollout_ref.actor.loss_agg_mode=mean"], "loss_agg_mode", "seq-mean-token-sum-norm"),
        (["actor_rollout_ref.actor.kl_loss_type=k9"], "kl_loss_type", "low_var_kl"),
        (["actor_rollout_ref.actor.policy_loss.loss_mode=dpo"], "loss_mode", "gspo"),
        (["actor_rollout_ref.rollout.top_p=0"], "top_p", "(0, 1]"),
        (["actor_rollout_ref.rollout.temperature=0"], "temperature", "> 0"),
        (["data.truncation=cut"], "data.truncation", "middle"),
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "global_step_N"),
        (["trainer.logger=[console,neptune]"], "trainer.logger", "tensorboard"),
        (
            ["trainer.placement=local", "trainer.n_gpus_per_node=8"],
            "trainer.n_gpus_per_node",
            "placement=ray",
        ),
        (["trainer.placement=cluster"], "trainer.placement", "ray"),
        (["trainer.n_gpus_per_node=0"], "trainer.n_gpus_per_node", "> 0"),
        (["trainer.worker_timeout_s=0"], "trainer.worker_timeout_s", "> 0"),
        (
            ["trainer.placement=ray", "actor_rollout_ref.rollout.nnodes=1"],
            "actor_rollout_ref.rollout.n_gpus_per_node",
            "both",
        ),
        (
            ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=2"],
            "rollout.n_gpus_per_node",
            "placement=ray",
        ),
        (
            [
                "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                "actor_rollout_ref.rollout.name=vllm",
                "trainer.placement=ray",
                "trainer.n_gpus_per_node=2",
            ],
            "actor_rollout_ref.rollout.tensor_model_parallel_size",
            "one generating worker",
        ),
        (["algorithm.rollout_correction.rollout_is=batch"], "rollout_correction.rollout_is", "sequence"),
        (
            [
                "algorithm.rollout_correction.rollout_is=token",
                "algorithm.rollout_correction.rollout_is_threshold=0.5",
            ],
            "rollout_is_threshold",
            ">= 1",
        ),
        (["actor_rollout_ref.actor.fsdp_config.param_dtype=int8"], "fsdp_config.param_dtype", "bfloat16"),
        (["reward_model.enable=true"], "reward_model.model.path", "needs a model"),
        (["reward_model.timeout_s=0"], "reward_model.timeout_s", "> 0"),
        (["data.val_files=null"], "data.val_files", "both"),
        (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name", "vllm"),
        (["task.forget_carry=1.5"], "task.forget_carry", "probability"),
    ],
)
def test_impossible_settings_name_the_key_and_the_fix(overrides, key, words):
    msg = fails(*overrides)
    assert key in msg and words in msg, msg


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_requested_without_vllm_names_the_key_and_the_extra():
    msg = fails("actor_rollout_ref.rollout.name=vllm")
    assert "actor_rollout_ref.rollout.name" in msg and "tearless[vllm]" in msg and "name=hf" in msg, msg


def test_the_straight_through_kl_forms_are_accepted():
    assert load_config(None, ["actor_rollout_ref.actor.kl_loss_type=low_var_kl+"])


def test_yaml_file_dict_and_overrides_in_order(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(
        "data:\n  train_batch_size: 32\n  max_response_length: 24\n"
        "actor_rollout_ref:\n  rollout:\n    n: 4\n  actor:\n    ppo_mini_batch_size: 16\n"
        "trainer:\n  logger: [jsonl]\n"
    )
    cfg = load_config(path)
    assert (cfg.data.train_batch_size, cfg.data.max_response_length) == (32, 24)
    assert cfg.actor_rollout_ref.rollout.n == 4 and cfg.trainer.logger == ["jsonl"]
    assert cfg.data.max_prompt_length == 64  # untouched keys keep their defaults
    # Overrides win over the file.
    cfg = load_config(str(path), ["data.train_batch_size=48", "trainer.logger=[console]"])
    assert cfg.data.train_batch_size == 48 and cfg.trainer.logger == ["console"]
    assert cfg.data.max_response_length == 24
    # A nested dict works the same way.
    cfg = load_config({"data": {"train_batch_size": 32}, "actor_rollout_ref": {"rollout": {"n": 2}}})
    assert cfg.data.train_batch_size == 32 and cfg.actor_rollout_ref.rollout.n == 2
    # So does a Config object, and a config survives a round trip through its dict.
    cfg = load_config(path, ["trainer.seed=7"])
    assert load_config(to_dict(cfg)) == cfg and load_config(cfg) == cfg
    assert "train_batch_size: 32" in to_yaml(cfg)


def test_yaml_mistakes_name_the_file(tmp_path):
    bad_key = tmp_path / "bad.yaml"
    bad_key.write_text("data:\n  train_batch_sise: 3\n")
    with pytest.raises(ConfigError, match=r"train_batch_sise.*bad\.yaml"):
        load_config(bad_key)
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(None, ["data.train_batch_size"])
    with pytest.raises(ConfigError, match="must be a Config, a dict or a YAML path"):
        load_config(42)


def test_verl_grpo_example_overrides_run_unchanged_where_the_feature_exists():
    # The supported part of veRL's examples/grpo_trainer/run_qwen2-7b.sh (GPU-only keys left out).
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=grpo",
            "data.train_batch_size=1024",
            "data.max_prompt_length=512",
            "data.max_response_length=1024",
            "data.filter_overlong_prompts=True",
            "data.truncation='error'",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.ppo_mini_batch_size=256",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=40",
            "actor_rollout_ref.actor.use_kl_loss=True",
            "actor_rollout_ref.actor.kl_loss_coef=0.001",
            "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
            "actor_rollout_ref.actor.entropy_coeff=0",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=40",
            "actor_rollout_ref.rollout.n=5",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=40",
            "algorithm.use_kl_in_reward=False",
            "trainer.logger=['console','jsonl']",
            "trainer.project_name='verl_grpo_example_gsm8k'",
            "trainer.experiment_name='qwen2_7b_function_rm'",
            "trainer.save_freq=20",
            "trainer.test_freq=5",
            "trainer.total_epochs=15",
        ],
    )
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6 and cfg.actor_rollout_ref.rollout.n == 5
    assert cfg.trainer.logger == ["console", "jsonl"] and cfg.data.truncation == "error"


def test_every_key_is_documented_and_described():
    text = describe()
    keys = list(all_keys())
    assert len(keys) > 80
    for key, field in keys:
        doc = field.metadata.get("help", "")
        assert doc.strip(), f"{key} has no documentation"
        assert f"{key} = " in text and doc in text, key
    # One "key = value" line and one doc line per key.
    assert len(text.splitlines()) == 2 * len(keys)
    assert "data.train_batch_size = 16\n    prompts per RL step" in text
    # describe shows the values of the config it is given.
    assert "data.train_batch_size = 32" in describe(load_config(None, ["data.train_batch_size=32"]))


def test_schema_sections_are_dataclasses_with_defaults():
    # Every field can be built without arguments: Config() is the default run.
    cfg = Config()
    for key, _ in all_keys():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
    assert dataclasses.is_dataclass(cfg.actor_rollout_ref.actor.optim)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor_rollout_ref.rollout.n=100000", "actor_rollout_ref.rollout.n: 100000 responses per prompt"),
        ("data.max_response_length=100000000", "data.max_response_length: 100000000 tokens"),
        ("data.max_prompt_length=2000000", "data.max_prompt_length: 2000000 tokens"),
    ],
)
def test_absurd_sizes_are_refused_by_name(override, key):
    # rollout.n ≤ 1024 and sequence lengths ≤ 2^20 tokens (the bounds are one typo wide: a value an
    # extra zero or three past anything that runs).
    with pytest.raises(ConfigError, match=re.escape(key) + ".*sanity bound"):
        load_config(None, [override])
    load_config(None, ["actor_rollout_ref.rollout.n=1024", "data.train_batch_size=1",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=1"])  # fmt: skip
