"""On-policy distillation (algorithm.adv_estimator=on_policy_distill): the teacher role, its config,
the tokenizer check, and a run on the embedded task that moves the student toward its teacher.

The per-token advantage and the reverse-KL metric are hand-worked in tests/algos/test_advantages.py.
"""

from __future__ import annotations

import pytest

from tearless import train
from tearless.cli import main
from tearless.config import ConfigError
from tearless.data import DataError
from tearless.data.prompts import check_same_tokenizer
from tearless.run.tracking import read_metrics

GREEDY = "val-core/arithmetic/acc/greedy"
DISTILL = ("algorithm.adv_estimator=on_policy_distill",)


def teacher_of(trained_run) -> str:
    """The GRPO-trained checkpoint of the session's shared run (tests/conftest.py): a stronger model of
    the same task, with the student's tokenizer."""
    _, run_dir = trained_run
    return str(run_dir / "global_step_12" / "actor")


@pytest.mark.parametrize(
    "extra, match",
    [
        (DISTILL, r"teacher\.model\.path: algorithm\.adv_estimator=on_policy_distill needs a teacher"),
        (
            ("actor_rollout_ref.teacher.model.path=/x",),
            r"teacher\.model\.path: a teacher is only used by .*on_policy_distill \(now grpo\)",
        ),
        (
            (*DISTILL, "actor_rollout_ref.teacher.model.path=/x", "algorithm.distill_reward_coef=-1"),
            r"algorithm\.distill_reward_coef: must be a number >= 0, got -1",
        ),
        (("algorithm.distill_reward_coef=0.5",), r"algorithm\.distill_reward_coef: weighs the task reward"),
        (
            (
                *DISTILL,
                "actor_rollout_ref.teacher.model.path=/x",
                "algorithm.distill_reward_coef=0.5",
                "actor_rollout_ref.rollout.n=1",
            ),
            r"algorithm\.distill_reward_coef: the task reward's GRPO advantage .* needs at least 2",
        ),
    ],
)
def test_bad_distillation_config_names_the_key(overrides, tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        train(None, overrides(tmp_path, *extra), log=lambda _: None)


def other_tokenizer(task, tmp_path):
    """The task's model beside a tokenizer with one more token: a different vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tearless.models.loading import load_tokenizer

    tok = load_tokenizer(task.model_dir)
    tok.add_tokens(["<|think|>"])
    config = AutoConfig.from_pretrained(task.model_dir)
    config.vocab_size = len(tok)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    tok.save_pretrained(tmp_path / "other")
    return str(tmp_path / "other")


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(overrides, task, tmp_path, capsys):
    teacher = other_tokenizer(task, tmp_path)
    args = overrides(tmp_path / "run", *DISTILL, f"actor_rollout_ref.teacher.model.path={teacher}")
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert (
        "actor_rollout_ref.teacher.model.path: the teacher's tokenizer is not the student's (1 of 104 tokens "
        "differ, e.g. '<|think|>': id None for the student, 104 for the teacher)"
    ) in err


def test_special_tokens_are_compared(task):
    from tearless.models.loading import load_tokenizer

    student, teacher = load_tokenizer(task.model_dir), load_tokenizer(task.model_dir)
    check_same_tokenizer(student, teacher, "k")  # the same tokenizer passes
    teacher.eos_token = "!"  # same vocabulary, another EOS: it would end responses elsewhere
    with pytest.raises(DataError, match=r"^k: the teacher's eos_token is '!', the student's '<\|end\|>'"):
        check_same_tokenizer(student, teacher, "k")


def test_the_student_itself_as_teacher_gives_zero_signal(overrides, task, tmp_path):
    # Teacher = student's weights: at step 1 (before any update) the teacher's forward and the
    # sampler's log-probs are the same model's in float32; they differ only by the kernels' rounding
    # (a batched forward vs the KV-cache decode): well under 1e-4 per token on log-probs of size ≤ 10.
    run_dir = tmp_path / "run"
    train(
        None,
        overrides(
            run_dir,
            *DISTILL,
            f"actor_rollout_ref.teacher.model.path={task.model_dir}",
            "trainer.total_training_steps=1",
            "trainer.val_before_train=false",
            "data.val_max_samples=8",
        ),
        log=lambda _: None,
    )
    step = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert abs(step["distill/reverse_kl"]) < 1e-4, step
    assert abs(step["critic/advantages/mean"]) < 1e-4
    assert "timing_s/teacher" in step


@pytest.mark.slow
def test_distillation_moves_the_student_toward_its_teacher(overrides, task, trained_run, tmp_path):
    # The student is the warmed-up model (it drops carries); the teacher is the GRPO-trained run of
    # conftest (held-out greedy 0.45 -> 0.65-0.78). No task reward: only log π_T − log π_S. Measured
    # (seed 1, 10 steps of 16 prompts × 4): reverse KL per token 0.074, 0.010, … and 0.010 over the
    # last three steps; greedy accuracy on 40 held-out prompts 0.475 -> 0.70, the teacher's 0.75.
    teacher_summary, _ = trained_run
    teacher_acc = teacher_summary["after"][GREEDY]
    run_dir = tmp_path / "distill"
    summary = train(
        None,
        overrides(
            run_dir,
            *DISTILL,
            f"actor_rollout_ref.teacher.model.path={teacher_of(trained_run)}",
            "data.train_batch_size=16",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "trainer.total_training_steps=10",
            "trainer.seed=1",
        ),
        log=lambda _: None,
    )
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    kl = [r["distill/reverse_kl"] for r in steps]
    assert len(kl) == 10
    assert sum(kl[-3:]) / 3 < 0.5 * sum(kl[:2]) / 2, kl
    before, after = summary["before"][GREEDY], summary["after"][GREEDY]
    assert before < teacher_acc, (before, teacher_acc)
    assert abs(teacher_acc - after) < abs(teacher_acc - before), (before, after, teacher_acc)
    assert after >= before + 0.1, (before, after, teacher_acc)
