"""The multi_turn keys: validated before anything loads, each error naming the key and the fix."""

from __future__ import annotations

import pytest

from tearless.config import ConfigError, load_config

KEY = "actor_rollout_ref.rollout.multi_turn"


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ([f"{KEY}.format=xml"], f"{KEY}.format: 'xml' is not one of search_r1, hermes"),
        ([f"{KEY}.tool_response_truncate_side=top"], f"{KEY}.tool_response_truncate_side: 'top'"),
        ([f"{KEY}.max_assistant_turns=0"], f"{KEY}.max_assistant_turns: must be > 0"),
        ([f"{KEY}.max_user_turns=-1"], f"{KEY}.max_user_turns: must be >= 0"),
        ([f"{KEY}.tool_timeout_s=0"], f"{KEY}.tool_timeout_s: must be > 0"),
        ([f"{KEY}.max_parallel_calls=0"], f"{KEY}.max_parallel_calls: must be > 0"),
        ([f"{KEY}.enable=true"], "the embedded task 'arithmetic' has none. Point it at a tool YAML"),
        ([f"{KEY}.enable=true", f"{KEY}.tool_config_path=/no/such.yaml"], "'/no/such.yaml' is not a file"),
        (
            [
                f"{KEY}.enable=true",
                "task.name=multihop",
                "actor_rollout_ref.model.path=/m",
                "data.train_files=/t",
                "data.val_files=/v",
            ],
            "so that task is not built. Point it at a tool YAML for your data",
        ),
        (["task.name=qa"], "task.name: 'qa' is not one of arithmetic, multihop"),
    ],
)
def test_bad_multi_turn_settings_name_the_key(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert words in str(info.value)


def test_the_search_r1_preset_turns_the_agent_loop_on_for_the_multihop_task():
    cfg = load_config(None, preset="search_r1")
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.format == "search_r1" and cfg.task.name == "multihop"
    assert mt.tool_config_path is None  # the task's own tools.yaml
    off = load_config(None, [f"{KEY}.enable=false"], preset="search_r1")
    assert not off.actor_rollout_ref.rollout.multi_turn.enable
