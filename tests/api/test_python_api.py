"""The Python API (tearless.api): config objects, datasets and models as objects, callbacks, rewards."""

from __future__ import annotations

import json

import pytest

import tearless
from tearless.api import SummedReward, Trainer
from tearless.config import ConfigError
from tearless.config.schema import Config
from tearless.data.rows import load_rows
from tearless.run.tracking import read_metrics


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Objects that are not files are written under $TEARLESS_CACHE/python-api: a fresh one per test."""
    monkeypatch.setenv("TEARLESS_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "python-api"


def test_rl_config_is_the_schema_and_its_sections_are_exported():
    assert tearless.RLConfig is Config
    cfg = tearless.RLConfig(data=tearless.DataConfig(train_batch_size=12))
    assert cfg.data.train_batch_size == 12
    assert cfg.actor_rollout_ref.rollout.n == 8  # the untouched sections keep their defaults
    assert tearless.ActorConfig().ppo_mini_batch_size == 16
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = tearless.Nope


def test_every_public_name_of_the_api_module_is_served_at_the_top_lazily():
    """``tearless.X`` for every name of ``tearless.api.__all__`` (and nothing else), without
    ``import tearless`` importing the API module (a fresh interpreter checks the laziness)."""
    import subprocess
    import sys

    from tearless import api

    for name in api.__all__:
        assert getattr(tearless, name) is getattr(api, name)
    assert set(tearless.__all__) == {"__version__", "train", *api.__all__}
    probe = "import sys, tearless; print('tearless.api' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_a_config_object_is_validated_like_the_cli_and_overrides_win():
    bad = tearless.RLConfig(
        data=tearless.DataConfig(train_batch_size=12),
        actor_rollout_ref=tearless.ActorRolloutRefConfig(actor=tearless.ActorConfig(ppo_mini_batch_size=5)),
    )
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        Trainer(args=bad).resolved_config()
    # The override makes 12 prompts a multiple of the mini-batch again (12 = 2 × 6).
    cfg = Trainer(args=bad, overrides=["actor_rollout_ref.actor.ppo_mini_batch_size=6"]).resolved_config()
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 6
    assert bad.actor_rollout_ref.actor.ppo_mini_batch_size == 5  # the caller's object is not changed


def test_rows_are_written_in_verl_schema_once_and_named_by_their_content(cache):
    rows = [
        {"prompt": "1+2=", "ground_truth": "3", "difficulty": 1},
        {"prompt": [{"role": "user", "content": "2+2="}], "ground_truth": "4", "difficulty": 2,
         "extra_info": {"index": 7}},
    ]  # fmt: skip
    cfg = Trainer(reward_funcs=lambda *a, **k: 0.0, train_dataset=rows).resolved_config()
    assert str(cache) in cfg.data.train_files
    # No eval_dataset: validation runs on the training rows.
    assert cfg.data.val_files == cfg.data.train_files
    written = load_rows(cfg.data.train_files)
    assert [r["data_source"] for r in written] == ["custom", "custom"]
    assert [r["reward_model"] for r in written] == [
        {"style": "rule", "ground_truth": "3"},
        {"style": "rule", "ground_truth": "4"},
    ]
    # Other columns travel in extra_info (merged with the row's own), as TRL hands them to rewards.
    assert [r["extra_info"] for r in written] == [{"difficulty": 1}, {"difficulty": 2, "index": 7}]
    assert "ground_truth" not in written[0] and "difficulty" not in written[0]
    again = Trainer(reward_funcs=lambda *a, **k: 0.0, train_dataset=list(rows)).resolved_config()
    assert again.data.train_files == cfg.data.train_files  # same rows, same file, same run directory
    assert again.trainer.experiment_name == cfg.trainer.experiment_name
    other = Trainer(reward_funcs=lambda *a, **k: 0.0, train_dataset=rows[:1]).resolved_config()
    assert other.data.train_files != cfg.data.train_files


def test_a_datasets_dataset_is_taken_as_its_rows(cache):
    datasets = pytest.importorskip("datasets")  # optional: tearless does not depend on it
    ds = datasets.Dataset.from_list([{"prompt": "5+5=", "ground_truth": "10", "level": 3}])
    cfg = Trainer(reward_funcs=lambda *a, **k: 0.0, train_dataset=ds).resolved_config()
    [row] = load_rows(cfg.data.train_files)
    assert row["reward_model"]["ground_truth"] == "10" and row["extra_info"] == {"level": 3}


def test_bad_datasets_name_the_row_and_the_fix(cache):
    def resolve(rows, **kw):
        return Trainer(train_dataset=rows, **kw).resolved_config()

    with pytest.raises(ValueError, match="row 1: no 'prompt' column"):
        resolve([{"prompt": "a", "ground_truth": 1}, {"question": "b"}], reward_funcs=len)
    with pytest.raises(ValueError, match=r"row 0: no 'data_source' column.*or pass reward_funcs"):
        resolve([{"prompt": "a", "ground_truth": 1}])
    with pytest.raises(ValueError, match="row 0: no 'ground_truth'"):
        resolve([{"prompt": "a"}], reward_funcs=len)
    with pytest.raises(TypeError, match="not int"):
        resolve(3)
    with pytest.raises(ValueError, match="has no rows"):
        resolve([], reward_funcs=len)


def test_summed_reward_weights_each_function_and_reports_its_part():
    def exact(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)

    def short(data_source, solution_str, ground_truth, extra_info=None, limit=3):
        return {"score": float(len(solution_str) <= limit), "length": len(solution_str)}

    reward = SummedReward([exact, short], weights=[1.0, 0.5])
    # "12" == "12" scores 1, its length 2 <= 3 scores 1: 1·1 + 0.5·1 = 1.5.
    assert reward("s", "12", "12") == {"score": 1.5, "exact": 1.0, "short": 1.0}
    # limit=1 reaches short() as a reward kwarg: "12" is too long, so 1·1 + 0.5·0 = 1.0.
    assert reward("s", "12", "12", None, limit=1)["score"] == 1.0
    twins = SummedReward([lambda *a: 1.0, lambda *a: 2.0])
    assert twins("s", "x", "y") == {"score": 3.0, "<lambda>_0": 1.0, "<lambda>_1": 2.0}
    with pytest.raises(ValueError, match="2 weights for 1 reward functions"):
        SummedReward([exact], weights=[1, 2])
    assert Trainer(reward_funcs=[exact]).reward_fn("s", "1", "1") == {"score": 1.0, "exact": 1.0}
    assert Trainer(reward_funcs=exact).reward_fn is exact


def test_a_pretrained_model_is_cached_by_content_and_needs_its_tokenizer(task, cache):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(task.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(task.model_dir)
    first = Trainer(model=model, processing_class=tokenizer).resolved_config()
    path = first.actor_rollout_ref.model.path
    assert path.startswith(str(cache / "models"))
    reloaded = AutoModelForCausalLM.from_pretrained(path)
    for (name, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(path).get_vocab() == tokenizer.get_vocab()
    # name_or_path is the task's directory, which holds the tokenizer: no processing_class needed.
    assert Trainer(model=model).resolved_config().actor_rollout_ref.model.path == path
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert Trainer(model=model).resolved_config().actor_rollout_ref.model.path != path
    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="merge_and_unload"):
        Trainer(model=adapted, processing_class=tokenizer).resolved_config()
    model = adapted.unload()
    model.name_or_path = ""
    with pytest.raises(ValueError, match="pass processing_class=tokenizer"):
        Trainer(model=model).resolved_config()
    with pytest.raises(ValueError, match="processing_class with a model path"):
        Trainer(model=task.model_dir, processing_class=tokenizer).resolved_config()


@pytest.mark.slow
def test_train_calls_back_with_every_logged_step(task, tmp_path):
    steps = []
    trainer = Trainer(
        model=task.model_dir,
        train_dataset=task.train_file,
        eval_dataset=task.val_file,
        overrides=[
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "data.train_batch_size=8",
            "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "data.val_max_samples=16",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
            "trainer.logger=[jsonl]",
            "reward_model.num_workers=0",
            "trainer.total_training_steps=2",
        ],
        log=lambda _: None,
    )
    trainer.add_callback(lambda step, metrics: steps.append((step, metrics)))
    summary = trainer.train()
    # Step 0 is the validation before training, then one record per step, equal to metrics.jsonl's.
    assert [s for s, _ in steps] == [0, 1, 2]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [{"step": s, **m} for s, m in steps] == json.loads(json.dumps(records))
    assert steps[2][1]["val-core/arithmetic/acc/greedy"] == summary["after"]["val-core/arithmetic/acc/greedy"]
    assert "critic/score/mean" in steps[1][1]


def test_the_packages_all_is_string_literals_for_the_docs():
    # mkdocstrings (griffe) reads __all__ from the source and fails the strict docs build on anything but
    # string literals: `[*API_NAMES]` did (CI's docs build, not the tests, caught it once).
    import ast
    from pathlib import Path

    source = ast.parse(Path(tearless.__file__).read_text())
    (value,) = [n.value for n in source.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"]
    assert isinstance(value, ast.List) and all(isinstance(e, ast.Constant) for e in value.elts)
