"""``actor.use_torch_compile=true`` end to end: a packed PPO run with a KL loss to the reference and
two mini-batches × two epochs per step (so the actor's old log-probs, the reference's log-probs and the
update all run compiled) lands on the eager run's rollouts, losses and weights."""

from __future__ import annotations

import pytest

from tearless import train
from tests.distributed.test_ray_fsdp import PPO, assert_same_steps, common
from tests.models.test_compiled import spy_compile

ARR = "actor_rollout_ref"
RUN = (*PPO, "actor_rollout_ref.model.use_remove_padding=true", "trainer.total_training_steps=2")


def test_a_compiled_run_matches_the_eager_run(overrides, tmp_path, task):
    eager = tmp_path / "eager"
    train(None, common(overrides, eager, *RUN), log=lambda _: None)
    compiled_dir = tmp_path / "compiled"
    with pytest.MonkeyPatch.context() as mp:
        calls = spy_compile(mp)
        train(
            None,
            common(overrides, compiled_dir, *RUN, "actor_rollout_ref.actor.use_torch_compile=true"),
            log=lambda _: None,
        )
    # The layers ran compiled in the update (with gradient) and in the log-prob passes (without).
    assert True in calls and False in calls
    assert_same_steps(eager, compiled_dir, (1, 2), task.model_dir, optimizer_steps_per_step=4)


@pytest.mark.parametrize(
    ("keys", "world", "told"),
    [
        ((), 1, True),  # the CPU default: the shared-prompt pass, every call through a KV cache
        (("actor_rollout_ref.model.use_remove_padding=true",), 1, False),
        (("actor_rollout_ref.model.share_prompt_forward=false",), 1, False),
        (("actor_rollout_ref.model.enable_gradient_checkpointing=true",), 1, False),  # the update is plain
        ((), 2, False),  # sharded ranks take the plain pass
    ],
)
def test_a_run_whose_passes_all_run_eager_is_told_so_at_start(keys, world, told):
    from tearless.config import load_config
    from tearless.config.plan import build_plan

    on = build_plan(
        load_config(None, ["actor_rollout_ref.actor.use_torch_compile=true", *keys], device="cpu")
    )
    note = on.eager_despite_compile(world)
    assert (note is not None) == told
    if told:
        assert "actor_rollout_ref.model.use_remove_padding=true" in note
    off = build_plan(load_config(None, list(keys), device="cpu"))
    assert off.eager_despite_compile(world) is None


@pytest.mark.parametrize(
    ("keys", "told"),
    [
        ((), True),
        (("actor_rollout_ref.model.use_remove_padding=true",), True),  # a vision-language batch is not packed
        (("actor_rollout_ref.model.share_prompt_forward=false",), False),
    ],
)
def test_a_vision_language_run_whose_passes_all_run_eager_is_told_so_at_start(keys, told, tmp_path):
    import dataclasses
    import json
    from types import SimpleNamespace

    from tearless.config import load_config
    from tearless.config.plan import build_plan

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "idefics3", "vision_config": {}}))
    cfg = load_config(None, ["actor_rollout_ref.actor.use_torch_compile=true", *keys], device="cpu")
    plan = dataclasses.replace(build_plan(cfg), files=SimpleNamespace(model_path=str(tmp_path)))
    note = plan.eager_despite_compile(1)
    assert (note is not None) == told
    if told:
        assert "vision-language" in note and "share_prompt_forward=false" in note


@pytest.mark.parametrize(
    ("keys", "compiled"),
    [
        ((), set()),
        (("actor_rollout_ref.actor.use_torch_compile=true",), {"actor", "ref", "teacher"}),
        (
            (
                "actor_rollout_ref.actor.use_torch_compile=true",
                "actor_rollout_ref.ref.use_torch_compile=false",
            ),
            {"actor", "teacher"},
        ),
        (("actor_rollout_ref.teacher.use_torch_compile=true",), {"teacher"}),
    ],
)
def test_each_role_compiles_by_its_own_key_or_the_actors(keys, compiled):
    from tearless.config import load_config
    from tearless.config.plan import build_plan

    sections = build_plan(load_config(None, list(keys))).sections
    # The critic's value model never compiles (its passes are not the log-prob pass).
    assert {r for r in ("actor", "ref", "teacher", "critic") if sections.compiles(r)} == compiled
