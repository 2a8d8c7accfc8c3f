"""``actor_rollout_ref.model.external_lib``: the user's modules are imported before validation and by
every rank, so a user-registered advantage estimator and policy loss are accepted and train exactly
as the built-ins they copy. The registries are the only lists validation checks names against."""

from __future__ import annotations

import sys

import pytest

from tearless import train
from tearless.algos import ADV_ESTIMATORS, POLICY_LOSSES
from tearless.config import ConfigError, load_config
from tearless.run.tracking import read_metrics
from tearless.workers.rank import Rank
from tearless.workers.spec import RankSpec

MODULE = "config.user_registry"
LIB = f"actor_rollout_ref.model.external_lib={MODULE}"
SKIP = "actor_rollout_ref.actor.skip_zero_adv_rows"
USER = ("algorithm.adv_estimator=user_grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=user_vanilla")


def forget_user_module() -> None:
    """Undo the module's import: its names leave the registries (other tests see the built-ins only)."""
    sys.modules.pop(MODULE, None)
    ADV_ESTIMATORS.pop("user_grpo", None)
    POLICY_LOSSES.pop("user_vanilla", None)


@pytest.fixture
def fresh():
    forget_user_module()
    yield
    forget_user_module()


def test_a_user_estimator_is_refused_until_its_module_is_named(fresh, overrides, tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator: 'user_grpo' is not one of .*grpo"):
        load_config(None, overrides(tmp_path, USER[0]))
    with pytest.raises(ConfigError, match=r"policy_loss\.loss_mode: 'user_vanilla' is not one of .*vanilla"):
        load_config(None, overrides(tmp_path, USER[1]))
    assert MODULE not in sys.modules
    cfg = load_config(None, overrides(tmp_path, *USER, LIB))
    assert cfg.algorithm.adv_estimator == "user_grpo"
    assert ADV_ESTIMATORS["user_grpo"] is ADV_ESTIMATORS["grpo"]
    assert POLICY_LOSSES["user_vanilla"] is POLICY_LOSSES["vanilla"]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("no_such_module_for_tearless", "cannot import 'no_such_module_for_tearless' (ModuleNotFoundError"),
        ("[config.user_registry,7]", "must be a module name or a list of module names, got"),
        # not a list: a number was a TypeError, a mapping's keys were taken as module names
        ("0", "must be a module name or a list of module names, got 0"),
        ("{config.user_registry: 1}", "must be a module name or a list of module names, got {"),
    ],
)
def test_a_bad_module_is_one_line_naming_the_key(fresh, overrides, tmp_path, value, problem):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides(tmp_path, f"actor_rollout_ref.model.external_lib={value}"))
    message = str(info.value)
    assert message.startswith("actor_rollout_ref.model.external_lib: ") and problem in message
    assert "\n" not in message


def test_a_rank_imports_the_modules_before_it_builds_its_roles(fresh, overrides, task, tmp_path):
    # Not validated here, so only the rank can have imported the module (a Ray rank is such a process).
    cfg = load_config(None, overrides(tmp_path, LIB), validate_config=False)
    assert MODULE not in sys.modules
    spec = RankSpec(
        cfg, roles=("ref",), rollout=False, model_path=str(task.model_dir), total_steps=1, device="cpu"
    )
    rank = Rank(0, 1, spec)
    assert MODULE in sys.modules and "user_vanilla" in POLICY_LOSSES
    assert rank.roles == {}  # the import came first: no role was built yet


@pytest.mark.slow
def test_user_registered_names_train_exactly_as_the_builtins_they_copy(fresh, overrides, tmp_path):
    # skip_zero_adv_rows applies to modes registered as linear in the advantage (the built-in vanilla;
    # the user's copy does not declare it): off in both runs, so both take the same path.
    same = ("trainer.total_training_steps=2", "trainer.val_before_train=false", f"{SKIP}=false")
    runs = {}
    for name, extra in (("builtin", ()), ("user", (*USER, LIB))):
        run_dir = tmp_path / name
        train(None, overrides(run_dir, *same, *extra))
        runs[name] = [
            {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))}
            for r in read_metrics(run_dir / "metrics.jsonl")
        ]
    assert len(runs["user"]) >= 2 and runs["user"] == runs["builtin"]
