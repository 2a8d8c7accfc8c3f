"""``tearless rm``: the Bradley–Terry loss by hand and against TRL's formula, the trainer's batch loss,
the token ids and rewards of the ``reward_model`` role, a run on the embedded task that learns, LoRA,
resume after SIGKILL, bad input, and a GRPO run whose reward is the trained model."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tearless.algos import bradley_terry_loss
from tearless.cli import main
from tearless.config import load_config
from tearless.config.rm import RMConfig
from tearless.data.pairs import RewardPairDataset
from tearless.data.rows import DataError
from tearless.rewards.model import RewardModelScorer
from tearless.run.tracking import read_metrics
from tearless.trainers.records import read_records
from tearless.trainers.rm import RewardModelTrainer, pair_rewards, reward_step
from tests.tolerances import gradient_terms, logit_tol, sum_tol

from .tiny import save_tiny_model


def reward_tol(directory, rewards) -> float:
    """Rewards of one model from two differently batched forwards (padding, micro-batches, the role's
    batches against the trainer's): a forward's rounding of logits as large as the largest reward
    (at least 1: a new head's rewards stay below it)."""
    from transformers import AutoConfig

    bound = max([1.0, *(abs(float(r)) for r in torch.as_tensor(rewards).flatten())])
    return logit_tol(AutoConfig.from_pretrained(directory), logit_bound=bound)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (its backbone under a new head) and a file of 24 pairs with margins."""
    root = tmp_path_factory.mktemp("tiny-rm")
    model = save_tiny_model(root / "model")
    rows = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b - 10), "margin": (a % 3) / 2}
        for a, b in [(a, 9 - a % 7) for a in range(11, 35)]
    ]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, root


def test_loss_by_hand():
    # Pair 1: r_c = 2, r_r = 0, m = 0:    -log σ(2)          = log(1 + e^-2)  = 0.126928
    # Pair 2: r_c = 0, r_r = 1, m = 0.5:  -log σ(0 - 1 - 0.5) = log(1 + e^1.5) = 1.701413
    # mean: 0.914171. Centring with c = 0.1: ((2 + 0)² + (0 + 1)²) / 2 = 2.5, so + 0.25 = 1.164171.
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0])
    margin = torch.tensor([0.0, 0.5])
    loss, stats = bradley_terry_loss(chosen, rejected, margin=margin)
    assert loss.item() == pytest.approx(0.914171, abs=1e-6)
    centred, _ = bradley_terry_loss(chosen, rejected, margin=margin, center_rewards_coefficient=0.1)
    assert centred.item() == pytest.approx(1.164171, abs=1e-6)
    assert stats["gap"].tolist() == [2.0, -1.0] and stats["correct"].tolist() == [1.0, 0.0]
    # No margin column is a margin of 0: pair 2 alone is then log(1 + e^1) = 1.313262.
    plain, _ = bradley_terry_loss(chosen[1:], rejected[1:])
    assert plain.item() == pytest.approx(1.313262, abs=1e-6)
    # Equal rewards: -log σ(0) = log 2, and a tie is not a correct pair.
    tie, stats = bradley_terry_loss(torch.zeros(3), torch.zeros(3))
    assert tie.item() == pytest.approx(math.log(2), abs=1e-7) and stats["correct"].sum() == 0


def trl_reward_loss(
    logits: torch.Tensor, inputs: dict, center_rewards_coefficient: float | None
) -> torch.Tensor:
    """TRL's ``RewardTrainer.compute_loss`` as its documentation states it: the model scores the chosen
    and the rejected sequences of a batch concatenated, (2P, 1) logits split in half; with a
    ``margin`` column, ``-logsigmoid(r_c - r_r - margin).mean()``, else ``-logsigmoid(r_c - r_r).mean()``;
    with ``center_rewards_coefficient`` c, ``+ c * mean((r_c + r_r) ** 2)``."""
    rewards_chosen, rewards_rejected = torch.chunk(logits.squeeze(-1), chunks=2)
    if "margin" in inputs:
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected - inputs["margin"]).mean()
    else:
        loss = -F.logsigmoid(rewards_chosen - rewards_rejected).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((rewards_chosen + rewards_rejected) ** 2)
    return loss


@pytest.mark.parametrize("seed", range(6))
def test_parity_with_trls_reward_trainer_loss_on_random_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    pairs = 1 + seed * 5
    logits = (torch.randn(2 * pairs, 1, generator=g, dtype=torch.float64) * 3).requires_grad_()
    margin = torch.rand(pairs, generator=g, dtype=torch.float64) * 2
    coeff = [None, 0.01, 0.5][seed % 3]
    for inputs in ({}, {"margin": margin}):
        expected = trl_reward_loss(logits, inputs, coeff)
        chosen, rejected = logits[:pairs, 0], logits[pairs:, 0]
        got, _ = bradley_terry_loss(
            chosen, rejected, margin=inputs.get("margin"), center_rewards_coefficient=coeff
        )
        # float64, a mean over at most 26 terms of size below ~20: rounding far below 1e-12.
        assert got.item() == pytest.approx(expected.item(), rel=0, abs=1e-12)
        (g_expected,) = torch.autograd.grad(expected, logits)
        (g_got,) = torch.autograd.grad(got, logits)
        torch.testing.assert_close(g_got, g_expected, rtol=0, atol=1e-12)


def test_pairs_are_the_ids_the_reward_model_role_scores_and_its_rewards(tiny, tmp_path):
    model_dir, _ = tiny
    trainer = RewardModelTrainer(
        load_config(
            None, overrides(tiny, tmp_path / "run", "trainer.total_training_steps=1"), schema=RMConfig
        ),
        log=lambda _: None,
    )
    trainer.fit()
    scorer = RewardModelScorer(str(tmp_path / "run" / "global_step_1" / "reward_model"))
    assert type(scorer.model).__name__ == "LlamaForSequenceClassification"
    assert (
        scorer.model.config.num_labels == 1
        and scorer.model.config.pad_token_id == scorer.tokenizer.pad_token_id
    )
    rows = [
        {"prompt": "12+9=", "chosen": "21", "rejected": "11"},
        {"prompt": [{"role": "user", "content": "40+2="}], "chosen": "42", "rejected": "a long wrong 4"},
    ]
    data = RewardPairDataset(rows, scorer.tokenizer)
    for i, row in enumerate(rows):
        item = data[i]
        assert item["chosen_ids"] == scorer.encode(row["prompt"], row["chosen"])
        assert item["rejected_ids"] == scorer.encode(row["prompt"], row["rejected"])
        assert item["chosen_mask"][-1] == 1 and sum(item["chosen_mask"]) == 1
    # A tokenizer without a chat template: the role's "role: content" lines, the same on both sides.
    scorer.tokenizer.chat_template = None
    plain = RewardPairDataset(rows[:1], scorer.tokenizer)[0]
    assert plain["chosen_ids"] == scorer.encode("12+9=", "21")
    assert (
        scorer.tokenizer.decode(plain["chosen_ids"], skip_special_tokens=True) == "user: 12+9=\nassistant: 21"
    )
    # The trainer's rewards (both sides in one right-padded batch) are the role's scores.
    items = [data[0], data[1]]
    scorer.tokenizer = trainer.tokenizer
    rewards = pair_rewards(scorer.model, items, pad_token_id=scorer.tokenizer.pad_token_id)
    scores = scorer.score(
        [r["prompt"] for r in rows] * 2, [r["chosen"] for r in rows] + [r["rejected"] for r in rows]
    )
    assert rewards.T.flatten().tolist() == pytest.approx(scores, abs=reward_tol(model_dir, scores))


def test_batch_loss_and_micro_batching(tiny):
    from tearless.models.loading import load_tokenizer
    from tearless.models.value import load_reward_model

    model_dir, root = tiny
    tok = load_tokenizer(model_dir)
    data = RewardPairDataset(
        [json.loads(line) for line in (root / "pairs.jsonl").read_text().splitlines()[:6]], tok
    )
    items = [data[i] for i in range(6)]
    assert [it["margin"] for it in items] == [1.0, 0.0, 0.5, 1.0, 0.0, 0.5]
    grads, results = [], []
    for micro in (None, 4):
        torch.manual_seed(0)  # the same new head
        model = load_reward_model(model_dir, pad_token_id=tok.pad_token_id)
        results.append(
            reward_step(
                model,
                items,
                pad_token_id=tok.pad_token_id,
                micro_batch_size=micro,
                center_rewards_coefficient=0.1,
            )
        )
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    with torch.no_grad():
        rewards = pair_rewards(model, items, pad_token_id=tok.pad_token_id)
    margin = torch.tensor([it["margin"] for it in items])
    loss, _ = bradley_terry_loss(rewards[:, 0], rewards[:, 1], margin=margin, center_rewards_coefficient=0.1)
    # One batch of all pairs against the trainer's batches: each reward to reward_tol; the loss's slope
    # in each reward is at most (1 + 2·0.1·|r_c + r_r|)/P, P = 6, rewards below 1.
    tol = reward_tol(model_dir, rewards)
    for got in results:
        assert got["loss"] == pytest.approx(loss.item(), abs=12 * 1.4 / 6 * tol)
        assert got["rewards/margins"] == pytest.approx(
            (rewards[:, 0] - rewards[:, 1]).mean().item(), abs=2 * tol
        )
    tokens = sum(len(it["chosen_ids"]) + len(it["rejected_ids"]) for it in items)
    atol = sum_tol(gradient_terms(model.config, tokens), float(grads[0].abs().max()), safety=2)
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=atol)


def test_validation_without_a_micro_batch_size_forwards_64_pairs_at_a_time(tiny, tmp_path):
    model_dir, root = tiny
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{a}+1=", "chosen": str(a + 1), "rejected": str(a)}) + "\n"
                           for a in range(70)))  # fmt: skip
    args = [f"model.path={model_dir}", f"data.train_files={root / 'pairs.jsonl'}", f"data.val_files={val}",
            f"trainer.default_local_dir={tmp_path / 'run'}"]  # fmt: skip
    trainer = RewardModelTrainer(load_config(None, args, schema=RMConfig), log=lambda _: None)
    assert trainer.cfg.data.micro_batch_size_per_gpu is None  # training: all of a step's pairs at once
    rows: list[int] = []
    trainer.model.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    metrics = trainer.validate()
    # 70 held-out pairs, both sides of each in one forward: 64 pairs (128 rows), then 6 (12 rows).
    assert rows == [128, 12]
    correct = metrics["val/rewards/accuracies"] * 70  # a count of pairs
    assert correct == pytest.approx(round(correct))


def overrides(tiny, run_dir, *extra: str) -> list[str]:
    model, root = tiny
    return [
        f"model.path={model}",
        f"data.train_files={root / 'pairs.jsonl'}",
        f"data.val_files={root / 'pairs.jsonl'}",
        "data.train_batch_size=8",
        "data.micro_batch_size_per_gpu=4",
        "optim.lr=3e-3",
        "trainer.total_epochs=2",
        "trainer.save_freq=2",
        "trainer.logger=[jsonl]",
        "trainer.num_threads=1",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def test_resume_after_sigkill_is_bit_identical(tiny, tmp_path):
    def run(run_dir, fault=None):
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "OMP_NUM_THREADS": "1"}
        env.pop("TEARLESS_FAULT", None)
        if fault:
            env["TEARLESS_FAULT"] = fault
        args = overrides(tiny, run_dir, "algorithm.center_rewards_coefficient=0.01")
        return subprocess.run(
            [sys.executable, "-m", "tearless", "rm", *args], env=env, capture_output=True, text=True
        )

    full = run(tmp_path / "full")
    assert full.returncode == 0, full.stderr[-2000:]
    killed = run(tmp_path / "run", fault="update:4")
    # Killed at the start of step 4 by SIGKILL: step 3 logged, checkpoint 2 the newest.
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r] == [
        1,
        2,
        3,
    ]
    assert sorted(p.name for p in (tmp_path / "run").glob("global_step_*")) == ["global_step_2"]
    resumed = run(tmp_path / "run")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"reward_model.model.path={tmp_path / 'run' / 'global_step_6' / 'reward_model'}" in resumed.stdout
    # Exactly: the same thread count, and the checkpoint restores weights, optimizer, schedule and RNGs
    # bit for bit, so the replayed steps do the same operations on the same numbers.
    a, b = (
        weights(tmp_path / "full" / "global_step_6" / "reward_model"),
        weights(tmp_path / "run" / "global_step_6" / "reward_model"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    full_metrics = [r for r in read_metrics(tmp_path / "full" / "metrics.jsonl") if "train/loss" in r]
    run_metrics = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in run_metrics] == [1, 2, 3, 4, 5, 6]
    for x, y in zip(full_metrics, run_metrics, strict=True):
        assert x["train/loss"] == y["train/loss"] and x["rewards/accuracies"] == y["rewards/accuracies"]


def test_lora_merges_into_a_plain_model_and_resumes(tiny, tmp_path):
    args = overrides(tiny, tmp_path / "run", "model.lora_rank=4", "optim.lr=1e-2")
    trainer = RewardModelTrainer(load_config(None, args, schema=RMConfig), log=lambda _: None)
    summary = trainer.fit()
    assert summary["after"]["val/rewards/accuracies"] > summary["before"]["val/rewards/accuracies"]
    final = tmp_path / "run" / "global_step_6"
    assert sorted(p.name for p in final.iterdir() if p.is_dir()) == ["lora_adapter", "reward_model"]
    # The merged plain model scores as the adapters on the base did (W + (α/r)·BA against W x + (α/r)·B A x:
    # rounding of a reordered product).
    scorer = RewardModelScorer(str(final / "reward_model"))
    assert not any("lora" in k for k in weights(final / "reward_model"))
    items = [trainer.val_set[i] for i in range(len(trainer.val_set))]
    trainer.model.eval()
    with torch.no_grad():
        live = pair_rewards(trainer.model, items, pad_token_id=trainer.tokenizer.pad_token_id)
        merged = pair_rewards(scorer.model, items, pad_token_id=trainer.tokenizer.pad_token_id)
    torch.testing.assert_close(merged, live, rtol=0, atol=reward_tol(tiny[0], live))
    expected = weights(final / "reward_model")
    shutil.rmtree(final)
    again = RewardModelTrainer(load_config(None, args, schema=RMConfig), log=lambda _: None)
    assert again.start_step == 4
    again.fit()
    resumed = weights(final / "reward_model")
    assert all(torch.equal(expected[k], resumed[k]) for k in expected)


@pytest.fixture(scope="module")
def embedded_rm(task, tmp_path_factory):
    """A reward model trained from the embedded task's warm-up model on the pairs ``tearless dpo`` makes
    from its answers, 16 per prompt (here 257 training and 67 held-out pairs; the counts depend on the
    warm-up model, so on the machine's kernels)."""
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.tasks.preferences import prepare_pairs

    root = tmp_path_factory.mktemp("embedded-rm")
    spec = TaskSpec(**task.info["spec"])
    pairs = prepare_pairs(spec, task, root, samples_per_prompt=16, log=lambda _: None)
    args = [
        f"model.path={task.model_dir}",
        f"data.train_files={pairs.train_file}",
        f"data.val_files={pairs.val_file}",
        "trainer.total_epochs=8",
        "trainer.logger=[jsonl]",
        f"trainer.default_local_dir={root / 'run'}",
    ]
    summary = RewardModelTrainer(load_config(None, args, schema=RMConfig), log=lambda _: None).fit()
    return {**summary, "train_pairs": pairs.info["train_pairs"]}


def test_a_run_on_the_embedded_task_raises_held_out_pair_accuracy(embedded_rm):
    # Measured with trainer.seed 1-8 (the head's initialisation and the shuffling) on ~67 held-out pairs:
    # accuracy 0.45 → 0.63, 0.51 → 0.67, 0.51 → 0.73, 0.61 → 0.73, 0.49 → 0.58, 0.46 → 0.66, 0.43 → 0.72,
    # 0.45 → 0.70 (gains 0.09 to 0.28); the mean margin from ~0 to 0.44-0.92. With 4 answers per prompt
    # (154/40 pairs) the same runs ended between 0.45 and 0.73, and one CI machine's warm-up model moved
    # seed 1's starting accuracy from 0.35 to 0.45: hence bounds, not the numbers of one machine.
    before, after = embedded_rm["before"], embedded_rm["after"]
    assert 0.25 <= before["val/rewards/accuracies"] <= 0.75  # an untrained head: near chance
    assert abs(before["val/rewards/margins"]) < 0.1
    assert after["val/rewards/accuracies"] >= max(0.55, before["val/rewards/accuracies"] + 0.05)
    assert after["val/rewards/margins"] > before["val/rewards/margins"] + 0.3
    # 16 pairs per step; the loader drops an incomplete last batch
    assert embedded_rm["steps"] == 8 * (embedded_rm["train_pairs"] // 16)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_grpo_and_ppo_runs_score_with_the_trained_model(embedded_rm, overrides, tmp_path, estimator):
    from transformers import AutoModelForSequenceClassification

    from tearless import train
    from tearless.models.loading import load_tokenizer

    path = embedded_rm["reward_model"]
    run_dir = tmp_path / "grpo"
    extra = (
        "reward_model.enable=true",
        f"reward_model.model.path={path}",
        f"algorithm.adv_estimator={estimator}",
        "trainer.total_training_steps=1",
    )
    train(None, overrides(run_dir, *extra, "trainer.val_before_train=false"), log=lambda _: None)
    samples = read_records(run_dir / "rollouts.jsonl.gz")
    assert samples
    tok = load_tokenizer(path, "reward_model.model.path")
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    for rec in samples:
        # The role's score is the trained model's reward of prompt + response, rendered as it was trained.
        assert rec["reward_extra"] == {"rm_score": rec["score"]}
        ids = tok(rec["prompt"] + rec["response"] + "<|end|>", add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            reward = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert rec["score"] == pytest.approx(reward, abs=reward_tol(path, [reward]))
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if "critic/score/mean" in r]
    assert len(steps) == 1 and math.isfinite(steps[0]["critic/score/mean"])
    assert ("critic/vf_loss" in steps[0]) == (estimator == "gae")  # PPO's critic trained on these rewards


def test_bad_pair_files_get_one_line(tiny, tmp_path, capsys):
    model = tiny[0]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "1+1=", "chosen": "2"}) + "\n")
    args = [f"model.path={model}", f"data.train_files={bad}", f"trainer.default_local_dir={tmp_path / 'r'}"]
    assert main(["rm", *args]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"{bad}: row 0 (line 1): missing column 'rejected'" in err
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(
        json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": 1.0})
        + "\n"
        + json.dumps({"prompt": "1+2=", "chosen": "3", "rejected": "4"})
        + "\n"
    )
    assert main(["rm", *args[:1], f"data.train_files={mixed}", *args[2:]]) == 1
    err = capsys.readouterr().err
    assert f"{mixed}: row 1 (line 2): column 'margin' is None" in err and len(err.strip().splitlines()) == 1
    from tearless.models.loading import load_tokenizer

    tok, row = load_tokenizer(model), {"prompt": "12+9=", "chosen": "21", "rejected": "1"}
    # <|user|> 1 2 + 9 = <|end|> <|assistant|> 2 1 <|end|>: 11 tokens.
    with pytest.raises(DataError, match=r"row 0 \(chosen\): 11 tokens, longer than data.max_length=8"):
        RewardPairDataset([row], tok, max_length=8)
    # left keeps the end, as reward_model.max_length does when the role scores.
    cut = RewardPairDataset([row], tok, max_length=8, truncation="left")[0]["chosen_ids"]
    assert tok.decode(cut) == "+9=<|end|><|assistant|>21<|end|>"  # the last 8 of the 11


def test_cli_config_show_help_and_errors(capsys):
    assert main(["config", "show", "rm", "algorithm.center_rewards_coefficient=0.01"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("data.train_files = None")
    assert "algorithm.center_rewards_coefficient = 0.01\n    c of TRL's RewardConfig" in out
    assert main(["rm", "--help"]) == 0
    assert "usage: tearless rm" in capsys.readouterr().out
    assert main(["rm", "algorithm.center_rewards_coefficient=abc"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "algorithm.center_rewards_coefficient" in err
    assert main(["rm", "data.truncation=middle"]) == 2
    assert "data.truncation: 'middle' is not one of error, left" in capsys.readouterr().err
    assert main(["rm", "data.val_files=x.jsonl"]) == 2
    assert "data.val_files: is set but data.train_files is null" in capsys.readouterr().err
