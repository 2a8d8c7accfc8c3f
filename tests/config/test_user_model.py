"""Peer defaults for a pretrained model: the toy's tuned values apply to the package's tiny models only.

Only config.json is read (no weights), so each case writes a config with the hidden size it needs.
"""

from __future__ import annotations

import json

import pytest

from tearless.config import Config, load_config
from tearless.config.dpo import DPOConfig
from tearless.config.rm import RMConfig
from tearless.config.sft import SFTConfig
from tearless.config.user_model import RL_DEFAULTS, is_user_model


def model_dir(tmp_path, hidden: int):
    d = tmp_path / f"model-{hidden}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden}))
    return d


def files(tmp_path) -> list[str]:
    return [f"data.train_files={tmp_path / 't.parquet'}", f"data.val_files={tmp_path / 'v.parquet'}"]


def test_a_pretrained_model_gets_peer_defaults_and_one_note_naming_the_keys(tmp_path):
    notes: list[str] = []
    cfg = load_config(
        None,
        ["actor_rollout_ref.model.path=HuggingFaceTB/SmolLM2-135M-Instruct", *files(tmp_path)],
        notify=notes.append,
    )
    arr = cfg.actor_rollout_ref
    assert arr.actor.optim.lr == 1e-6
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (512, 256)
    assert (cfg.data.train_batch_size, arr.actor.ppo_mini_batch_size, cfg.data.val_batch_size) == (8, 8, 32)
    assert arr.rollout.val_kwargs.do_sample is False and arr.rollout.val_kwargs.n == 1
    (note,) = notes
    assert "\n" not in note
    assert note.startswith("actor_rollout_ref.model.path is a pretrained model")
    for key in RL_DEFAULTS:
        assert f"{key}=" in note, key
    assert "actor_rollout_ref.actor.optim.lr=1e-06 (was 0.0001)" in note


def test_keys_the_user_set_are_kept_and_lora_gets_a_larger_rate(tmp_path):
    notes: list[str] = []
    cfg = load_config(
        None,
        [
            f"actor_rollout_ref.model.path={model_dir(tmp_path, 576)}",
            *files(tmp_path),
            "data.max_response_length=48",
            "actor_rollout_ref.model.lora_rank=8",
        ],
        notify=notes.append,
    )
    assert cfg.data.max_response_length == 48 and "data.max_response_length" not in notes[0]
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-5
    # A preset's keys count as set too.
    cfg = load_config(
        None,
        [f"actor_rollout_ref.model.path={model_dir(tmp_path, 896)}", *files(tmp_path)],
        preset="knights_knaves",
        notify=notes.append,
    )
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.data.train_batch_size) == (
        1024,
        512,
        8,
    )


def test_the_embedded_model_and_the_default_run_keep_the_tuned_defaults(tmp_path):
    notes: list[str] = []
    tiny = load_config(
        None,
        [f"actor_rollout_ref.model.path={model_dir(tmp_path, 128)}", *files(tmp_path)],
        notify=notes.append,
    )
    default = load_config(None, [], notify=notes.append)
    assert notes == []
    for cfg in (tiny, default):
        assert cfg.actor_rollout_ref.actor.optim.lr == Config().actor_rollout_ref.actor.optim.lr == 1e-4
        assert cfg.data.max_response_length == 16 and cfg.actor_rollout_ref.rollout.val_kwargs.n == 4
    assert not is_user_model(None) and not is_user_model(model_dir(tmp_path, 511))
    assert is_user_model(model_dir(tmp_path, 512)) and is_user_model(tmp_path / "no-config-here")


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (SFTConfig, {"optim.lr": 1e-5, "data.max_response_length": 256}),
        (DPOConfig, {"optim.lr": 1e-6, "algorithm.beta": 0.1, "trainer.total_epochs": 1}),
        (RMConfig, {"optim.lr": 1e-5, "trainer.total_epochs": 1}),
    ],
)
def test_sft_dpo_kto_and_rm_get_trl_and_verl_defaults(schema, expected, tmp_path):
    notes: list[str] = []
    overrides = ["model.path=org/model", f"data.train_files={tmp_path / 't.parquet'}"]
    if schema is DPOConfig:
        overrides.append("algorithm.loss_type=kto")
    cfg = load_config(None, overrides, schema=schema, notify=notes.append)
    for key, value in expected.items():
        section, name = key.split(".")
        assert getattr(getattr(cfg, section), name) == value, key
        assert f"{key}={value}" in notes[0]
    assert notes[0].startswith("model.path is a pretrained model")
    toy = load_config(None, [], schema=schema, notify=notes.append)
    assert len(notes) == 1 and toy.optim.lr == schema().optim.lr


def test_a_lora_reward_model_gets_trls_lora_rate(tmp_path):
    overrides = ["model.path=org/model", f"data.train_files={tmp_path / 't.parquet'}", "model.lora_rank=8"]
    assert load_config(None, overrides, schema=RMConfig).optim.lr == 1e-4
    assert load_config(None, [*overrides, "optim.lr=3e-5"], schema=RMConfig).optim.lr == 3e-5
