"""Tokenizers without a chat template, without a pad token, or whose pad token is the EOS token.

tearless never infers masks from the pad id (masks travel with the batch), so a tokenizer without a
pad token (given EOS as pad) must train exactly like the same tokenizer with its own pad token; a
tokenizer without a chat template trains on plain-text prompts fed as they are (as TRL does) and
refuses chat-format prompts with a message (no invented "user: … assistant:" wrapping)."""

from __future__ import annotations

import json
import shutil

import pytest

from tearless import train
from tearless.data.prompts import DataError
from tearless.data.rows import load_rows, write_parquet
from tearless.run.tracking import read_metrics
from tearless.trainers.records import read_records

pytestmark = pytest.mark.slow
ONE_STEP = (
    "trainer.total_training_steps=1",
    "trainer.val_before_train=false",
    "data.val_max_samples=4",
    "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
    "trainer.num_rollout_samples=32",
)


def _variant(task, tmp_path, name, edit):
    model = tmp_path / name
    shutil.copytree(task.model_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    edit(model, config)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    return model


def _run(overrides, run_dir, model):
    train(None, overrides(run_dir, f"actor_rollout_ref.model.path={model}", *ONE_STEP), log=lambda _: None)
    return read_metrics(run_dir / "metrics.jsonl")[0], read_records(run_dir / "rollouts.jsonl.gz")


def test_no_pad_token_means_eos_as_pad_and_the_same_training(overrides, task, tmp_path):
    no_pad = _variant(task, tmp_path, "no-pad", lambda model, config: config.pop("pad_token"))
    from tearless.models.loading import load_tokenizer

    tok = load_tokenizer(no_pad)
    assert tok.pad_token_id == tok.eos_token_id
    base_metrics, base_samples = _run(overrides, tmp_path / "base", task.model_dir)
    metrics, samples = _run(overrides, tmp_path / "eos-pad", no_pad)
    # The same responses, rewards and lengths: the pad id changed only what masked positions hold.
    # Exactly equal: scores and lengths are means of the same small integers, and the one on-policy
    # update's pg_loss is −mean(A · e^(log π − sg(log π))) = −mean(A) over the same tokens, the ratio
    # being exactly 1 whatever the forward computed.
    assert [s["response"] for s in samples] == [s["response"] for s in base_samples]
    for key in ("critic/score/mean", "response_length/mean", "response_length/clip_ratio", "actor/pg_loss"):
        assert metrics[key] == base_metrics[key], key
    assert metrics["response_length/clip_ratio"] < 1  # responses stop at the EOS that is also pad


def test_no_chat_template_feeds_plain_text_as_is_and_refuses_chat_prompts(overrides, task, tmp_path):
    def drop_template(model, config):
        (model / "chat_template.jinja").unlink()
        config.pop("chat_template", None)

    plain = _variant(task, tmp_path, "plain", drop_template)
    with pytest.raises(DataError, match="chat template"):
        _run(overrides, tmp_path / "chat", plain)
    files, texts = {}, set()
    for name, path in (("train", task.train_file), ("val", task.val_file)):
        rows = load_rows(path)
        for row in rows:
            row["prompt"] = row["prompt"][-1]["content"]  # "66+76=": the text the model was warmed up on
            texts.add(row["prompt"])
        files[name] = tmp_path / f"plain-{name}.parquet"
        write_parquet(rows, files[name])
    run = overrides(tmp_path / "run", f"actor_rollout_ref.model.path={plain}", *ONE_STEP)
    train(
        None,
        [*run, f"data.train_files={files['train']}", f"data.val_files={files['val']}"],
        log=lambda _: None,
    )
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    samples = read_records(tmp_path / "run" / "rollouts.jsonl.gz")
    # Fed as it is: this tokenizer adds no BOS token, so the decoded prompt is the row's text.
    assert samples and all(s["prompt"] in texts for s in samples)
    assert metrics["response_length/mean"] > 0 and metrics["step"] == 1
