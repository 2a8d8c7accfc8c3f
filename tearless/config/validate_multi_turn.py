"""Checks of ``actor_rollout_ref.rollout.multi_turn``: the agent loop's limits and formats, and what
drives it: an environment, an agent program, or tools (a tool YAML, or the multihop task's own)."""

from __future__ import annotations

from tearless.config.errors import ConfigError, existing_file, fail, one_of, positive
from tearless.config.schema import Config


def validate_multi_turn(cfg: Config) -> None:
    """Raise ``ConfigError`` for a multi-turn key out of range, an engine that cannot drive the agent loop,
    or an environment, agent or tool file that cannot be loaded (imported now, before any model loads)."""
    # torch: ``import tearless.config`` (``config show``, ``--help``) stays torch-free
    from tearless.envs import env_factory, load_agent
    from tearless.rollout.agent import FORMATS, TRUNCATE_SIDES
    from tearless.rollout.engine import engine_capabilities
    from tearless.rollout.toolcalls import FAMILIES

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    key = "actor_rollout_ref.rollout.multi_turn"
    one_of(f"{key}.format", mt.format, FORMATS)
    one_of(f"{key}.tool_response_truncate_side", mt.tool_response_truncate_side, TRUNCATE_SIDES)
    for name in (
        "max_assistant_turns", "max_parallel_calls", "max_tool_calls_per_turn", "max_tool_response_length",
        "tool_timeout_s",
    ):  # fmt: skip
        positive(f"{key}.{name}", getattr(mt, name))
    positive(f"{key}.max_user_turns", mt.max_user_turns, allow_zero=True)
    positive(f"{key}.env_timeout_s", mt.env_timeout_s)
    if mt.tool_family is not None:
        one_of(f"{key}.tool_family", mt.tool_family, FAMILIES)
    if not mt.enable:
        return
    if not engine_capabilities(cfg.actor_rollout_ref.rollout.name).multi_turn:
        fail(
            f"{key}.enable",
            f"the {cfg.actor_rollout_ref.rollout.name} engine cannot drive the agent loop",
            "Use an engine that can (hf, vllm), or set it to false.",
        )
    if mt.env is not None and mt.agent is not None:
        fail(f"{key}.agent", "is set together with multi_turn.env", "Train an environment or an agent.")
    if mt.env is not None or mt.agent is not None:
        try:  # the user's module is imported now, so a wrong path fails before any model loads
            if mt.env is not None:
                env_factory(mt.env, mt.env_kwargs)
            else:
                load_agent(mt.agent)
        except ValueError as e:  # its message names the key, the value and the fix
            raise ConfigError(str(e)) from None
        return

    if mt.tool_config_path is None and cfg.task.name != "multihop":
        fail(
            f"{key}.tool_config_path",
            f"multi-turn rollouts need tools, and the embedded task {cfg.task.name!r} has none",
            "Point it at a tool YAML (see tearless/tools/registry.py) or set task.name=multihop.",
        )
    if mt.tool_config_path is not None:
        existing_file(f"{key}.tool_config_path", mt.tool_config_path, "config", "Point it at a tool YAML.")
    given = cfg.actor_rollout_ref.model.path is not None and cfg.data.train_files is not None
    if mt.tool_config_path is None and given:
        fail(
            f"{key}.tool_config_path",
            "null means the embedded multihop task's tools, but model.path and data.train_files are given, "
            "so that task is not built",
            "Point it at a tool YAML for your data.",
        )
