"""The SFT trainer: its loss by hand, layouts that leave the gradient unchanged, the embedded warm-up,
user files with packing, checkpoints and resume, and the command line."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tearless.cli import main
from tearless.config import load_config
from tearless.config.sft import SFTConfig
from tearless.data.sft import SFTDataset
from tearless.run.tracking import read_metrics
from tearless.tasks.bootstrap import TaskSpec
from tearless.trainers.sft import SFTTrainer, collate_fn, sft_backward, sft_loss
from tearless.trainers.warmup import prepare_task
from tests.tolerances import gradient_terms, logprob_tol, sum_tol

from .tiny import save_tiny_model

TINY_TASK = dict(num_train=40, num_val=8, warmup_steps=6, hidden_size=32, num_layers=1)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-sft"))


def test_sft_loss_by_hand():
    # Two rows: log-probs (−1, −2, −3) and (−4, −5, −inf), trained positions (0, 1, 1) and (1, 0, 0);
    # N = 4 tokens in the whole step (another micro-batch holds the fourth):
    # −(−2 − 3 − 4) / 4 = 2.25. The −inf is masked out and contributes exactly 0.
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -math.inf]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    assert sft_loss(logps, mask, num_tokens=4).item() == pytest.approx(2.25)


def test_packing_and_micro_batching_leave_the_gradient_unchanged(model_dir):
    from tearless.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(model_dir)
    rows = [
        {"prompt": f"{a}+{b}=", "response": f"{a + b}"}
        for a, b in [(1, 2), (13, 40), (7, 8), (99, 99), (5, 0)]
    ]
    items = [SFTDataset(rows, tok)[i] for i in range(5)]
    grads = []
    for packing, micro in ((False, None), (False, 2), (True, None), (True, 3)):
        model = load_causal_lm(model_dir)
        collate = collate_fn(pad_token_id=tok.pad_token_id, packing=packing, max_length=40)
        loss, tokens = sft_backward(model, items, collate=collate, micro_batch_size=micro)
        grads.append((loss, torch.cat([p.grad.flatten() for p in model.parameters()])))
    assert tokens == sum(len(r["response"]) + 1 for r in rows)
    # Packed rows and micro-batches run other shapes and paddings: equal to rounding. The loss is a
    # mean of the tokens' −log p, each within logprob_tol (random-init model: logits below 1, so
    # −log p < log V + 2 < 2 log V), summed in another order; a gradient entry sums every token's
    # contribution through a forward and a backward, relative to the largest entry (safety 2 for
    # some cancellation between tokens).
    config = load_causal_lm(model_dir).config
    loss_tol = logprob_tol(config, logit_bound=1.0) + sum_tol(tokens, 2 * math.log(config.vocab_size))
    grad_tol = sum_tol(gradient_terms(config, tokens), float(grads[0][1].abs().max()), safety=2)
    for loss, grad in grads[1:]:
        assert loss == pytest.approx(grads[0][0], abs=loss_tol)
        torch.testing.assert_close(grad, grads[0][1], rtol=0, atol=grad_tol)


def test_tearless_sft_without_data_is_the_embedded_warm_up(tmp_path):
    overrides = [f"task.{k}={v}" for k, v in TINY_TASK.items()]
    cfg = load_config(
        None,
        [*overrides, f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]"],
        schema=SFTConfig,
    )
    summary = SFTTrainer(cfg, log=lambda _: None).fit()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 6 and all(math.isfinite(x) for r in records for x in r.values())
    assert losses[-1] < losses[0] - 0.2
    assert set(summary["after"]) == {
        "val/loss",
        "val-core/arithmetic/acc/greedy",
        "val-core/arithmetic/reward/greedy",
    }
    assert summary["after"]["val/loss"] < summary["before"]["val/loss"]

    # The same settings through prepare_task give bit-identical weights: the warm-up is this run.
    files = prepare_task(TaskSpec(**TINY_TASK), tmp_path / "cache", log=lambda _: None)
    from transformers import AutoModelForCausalLM

    warm = AutoModelForCausalLM.from_pretrained(files.model_dir).state_dict()
    ours = AutoModelForCausalLM.from_pretrained(summary["checkpoint"] + "/actor").state_dict()
    assert warm.keys() == ours.keys()
    assert all(torch.equal(warm[k], ours[k]) for k in warm)


def test_sft_on_chat_files_with_packing_resumes_to_the_same_weights(tmp_path, model_dir):
    rows = [
        {"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}]}
        for a in range(24)
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        f"model.path={model_dir}",
        f"data.train_files={train}",
        f"data.val_files={train}",
        "data.train_batch_size=8",
        "data.micro_batch_size_per_gpu=4",
        "data.packing=true",
        "data.max_length=64",
        "optim.lr=1e-2",
        "trainer.total_epochs=2",
        "trainer.save_freq=3",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={tmp_path / 'run'}",
    ]
    summary = SFTTrainer(load_config(None, args, schema=SFTConfig), log=lambda _: None).fit()
    assert summary["steps"] == 6 and summary["after"]["val/loss"] < summary["before"]["val/loss"] - 0.5
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "global_step_6" / "actor").state_dict()
    # Lose the last checkpoint: the rerun resumes at step 3 and must land on the same weights.
    shutil.rmtree(tmp_path / "run" / "global_step_6")
    logs: list[str] = []
    again = SFTTrainer(load_config(None, args, schema=SFTConfig), log=logs.append)
    assert again.start_step == 3 and "resumed" in logs[0]
    again.fit()
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "global_step_6" / "actor").state_dict()
    # Exactly: the same process and thread count (one_thread), and the checkpoint restores the state
    # bit for bit, so the replayed steps do the same operations on the same numbers.
    assert all(torch.equal(full[k], resumed[k]) for k in full)
    steps = [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_cli_help_and_config_errors(capsys):
    assert main(["sft", "--help", "data.train_batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "data.train_batch_size = 8\n    sequences per optimizer step" in out
    assert "data.packing = False" in out and "optim.lr_scheduler = 'cosine'" in out
    assert main(["sft", "data.train_batch_sise=8"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'data.train_batch_sise'" in err and "data.train_batch_size" in err
    assert main(["sft", "data.truncation=sideways"]) == 2
    assert "data.truncation: 'sideways' is not one of error, left, right, middle" in capsys.readouterr().err
    assert main(["sft", "data.train_batch_size=4", "data.micro_batch_size_per_gpu=8"]) == 2
    assert "data.micro_batch_size_per_gpu: 8 > data.train_batch_size=4" in capsys.readouterr().err
