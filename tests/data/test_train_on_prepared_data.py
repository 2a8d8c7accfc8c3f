"""``tearless train data.train_files=…`` on files from ``tearless data make`` and ``data prepare``:
each run picks the right scorer by ``data_source`` (the issue's acceptance check).

The policy is an untrained tiny Llama with the embedded character tokenizer, built in a second: the
point is the data and reward path, not learning.
"""

from __future__ import annotations

import json

import pytest

from tearless.cli import main
from tearless.data.prepare import prepare
from tearless.tasks.make import make_task

GSM8K = [
    {"question": f"Tom has {a} marbles and finds {b} more. How many does he have?",
     "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
    for a, b in [(3, 4), (12, 30), (7, 8), (100, 250), (5, 5), (41, 1)]
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tearless.tasks.bootstrap import tokenizer_llama
    from tearless.tasks.tokenizer import build_char_tokenizer

    path = tmp_path_factory.mktemp("policy")
    tok = build_char_tokenizer()
    tokenizer_llama(tok, hidden_size=32, num_layers=1, seed=0).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def train(model_dir, run_dir, train_file, val_file) -> dict:
    code = main(
        [
            "train",
            f"actor_rollout_ref.model.path={model_dir}",
            f"data.train_files={train_file}",
            f"data.val_files={val_file}",
            f"trainer.default_local_dir={run_dir}",
            "data.max_prompt_length=800",
            "data.max_response_length=8",
            "data.train_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.val_kwargs.n=1",
            "data.val_max_samples=4",
            "trainer.total_training_steps=1",
            "trainer.logger=[jsonl]",
            "reward_model.num_workers=0",
        ]
    )
    assert code == 0
    metrics: dict = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        metrics.update(json.loads(line))
    return metrics


@pytest.mark.slow
def test_train_on_made_knights_knaves(model_dir, tmp_path):
    files = make_task("knights_knaves", tmp_path / "kk", num_train=8, num_test=4, num_people=2)
    metrics = train(model_dir, tmp_path / "run", files["train"], files["test"])
    # Only the Logic-RL scorer reports format and answer parts; an untrained model breaks the format.
    assert metrics["reward_extra/format/mean"] == -1.0
    assert metrics["critic/score/mean"] == -3.0
    assert "val-core/knights_knaves/reward/greedy" in metrics


@pytest.mark.slow
def test_train_on_made_countdown(model_dir, tmp_path):
    files = make_task("countdown", tmp_path / "cd", num_train=8, num_test=4)
    metrics = train(model_dir, tmp_path / "run", files["train"], files["test"])
    assert "reward_extra/acc/mean" in metrics  # the countdown scorer's dict result
    assert "val-core/countdown/reward/greedy" in metrics
    assert metrics["reward/failures"] == 0.0


@pytest.mark.slow
def test_train_on_a_prepared_gsm8k_parquet(model_dir, tmp_path):
    source = tmp_path / "gsm8k"
    source.mkdir()
    for split, records in (("train", GSM8K), ("test", GSM8K[:4])):
        (source / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    files = prepare("gsm8k", source, tmp_path / "prepared")["files"]
    metrics = train(model_dir, tmp_path / "run", files["train"], files["test"])
    assert "val-core/openai/gsm8k/reward/greedy" in metrics
    assert metrics["reward/failures"] == 0.0
