"""The asynchronous loop (async_training): k = 0 is the synchronous run, stale samples are
corrected and dropped as computed by hand, and resume never trains on an in-flight sample."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from tearless import train
from tearless.config import load_config
from tearless.run.tracking import read_metrics
from tearless.trainers.rl import RLTrainer
from tearless.trainers.source import Call, fresh_groups, response_versions, staleness_metrics
from tests.conftest import search_r1_overrides
from tests.tolerances import logprob_tol

QUIET = {"log": lambda _: None}
FAST = ("trainer.val_before_train=false", "data.val_max_samples=4", "trainer.num_threads=1")
FAST += ("actor_rollout_ref.rollout.val_kwargs.do_sample=false",)


def test_fresh_groups_and_the_staleness_histogram():
    # Policy at version 5, max staleness 2, three groups of two rows, matched by uid (group c's rows
    # apart, so position would group them wrongly). Versions per row:
    #   group a: 5, 5 (staleness 0, 0)  kept
    #   group b: 3, 4 (2, 1)            kept
    #   group c: 4, 2 (1, 3)            dropped whole: one sample is 3 > 2 behind
    versions = torch.tensor([5, 4, 5, 3, 4, 2])
    uids = ["a", "c", "a", "b", "b", "c"]
    kept, staleness = fresh_groups(versions, uids, 5, 2)
    assert kept.tolist() == [0, 2, 3, 4] and staleness.tolist() == [0, 1, 0, 2, 1, 3]
    m = staleness_metrics(staleness[kept], 2, 6, 2)
    assert m["async/staleness_mean"] == pytest.approx((0 + 0 + 2 + 1) / 4)
    assert m["async/staleness_max"] == 2
    assert [m[f"async/staleness_count/{s}"] for s in range(3)] == [2, 1, 1]
    assert m["async/dropped"] == 2 and m["async/dropped_frac"] == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="newer"):
        fresh_groups(torch.tensor([6, 6]), ["a", "a"], 5, 2)


@pytest.mark.slow
def test_a_responses_version_is_its_oldest_tokens_and_partial_ones_are_counted():
    # Three responses of up to 4 tokens (mask 1 1 1 0 / 1 1 1 1 / 1 1 0 0) and their tokens' versions:
    #   row 0: 3 3 4 .  continued under version 4 after two tokens: version 3, partial, 1 resumed token
    #   row 1: 4 4 4 4  one version throughout
    #   row 2: 2 3 . .  (padding holds 0, which must not count as the oldest)
    # -> versions 3, 4, 2; 2 of 3 responses partial; resumed tokens 1 + 1 of 9.
    versions = torch.tensor([[3, 3, 4, 0], [4, 4, 4, 4], [2, 3, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    oldest, metrics = response_versions(versions, mask)
    assert oldest.tolist() == [3, 4, 2]
    assert metrics == {"async/partial_frac": 2 / 3, "async/resumed_token_frac": 2 / 9}


# Dynamic sampling and ReMax take their extra generation calls from the same source in both loops.
DAPO_REMAX = ("algorithm.filter_groups.enable=true", "algorithm.adv_estimator=remax")


@pytest.mark.parametrize("extra", [(), DAPO_REMAX], ids=["grpo", "dapo-remax"])
def test_max_staleness_zero_is_the_synchronous_run(overrides, tmp_path, extra):
    steps = ("trainer.total_training_steps=3", *FAST, *extra)
    train(None, overrides(tmp_path / "sync", *steps), **QUIET)
    async_keys = ("async_training.enable=true", "async_training.max_staleness=0")
    train(None, overrides(tmp_path / "async", *steps, *async_keys), **QUIET)
    ws = load_file(tmp_path / "sync" / "global_step_3" / "actor" / "model.safetensors")
    wa = load_file(tmp_path / "async" / "global_step_3" / "actor" / "model.safetensors")
    assert all(ws[k].equal(wa[k]) for k in ws)
    ms, ma = (
        read_metrics(tmp_path / "sync" / "metrics.jsonl"),
        read_metrics(tmp_path / "async" / "metrics.jsonl"),
    )
    for s, a in zip(ms, ma, strict=True):
        assert a["async/staleness_max"] == 0 and a["async/dropped"] == 0
        assert a["actor/pg_loss"] == s["actor/pg_loss"] and a["critic/score/mean"] == s["critic/score/mean"]


def test_an_injected_stale_batch_is_weighted_and_dropped_as_computed_by_hand(overrides, task, tmp_path):
    """Step 3 of a one-step-off run (policy version 2) trains on a batch handed in with known
    behaviour log-probs and versions: four prompts × n = 4 responses, each group's behaviour
    log-probs the trainer's π_old minus a known shift δ per token. TIS clips to [½, 2]; masked IS
    rejects token ratios outside [0.3, 2.5]."""
    keys = (
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
        "algorithm.rollout_correction.rollout_is_threshold=2.0",
        "algorithm.rollout_correction.rollout_is_threshold_lower=0.5",
        "algorithm.rollout_correction.rollout_rs=token",
        "algorithm.rollout_correction.rollout_rs_threshold=2.5",
        "algorithm.rollout_correction.rollout_rs_threshold_lower=0.3",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=4",
    )
    trainer = RLTrainer(load_config(None, overrides(tmp_path, *FAST, *keys)), **QUIET)
    try:
        for step in (1, 2):
            m = trainer.train_step(step)
            # step 1 trains on version 0 samples at version 0; step 2 on version 0 samples at version 1
            assert m["async/staleness_max"] == step - 1 and m["async/dropped"] == 0
        assert trainer.policy_version == 2
        queued = trainer.source.queue[0]
        assert queued.step == 3 and queued.version == 1  # submitted at step 2, before its update
        rollout = trainer.workers.wait_generate(queued.pending)
        proximal, _ = trainer.workers.compute_log_prob("actor", rollout.tensors())
        # δ per group: ln 3 (ratio 3, truncated to 2), −ln 4 (ratio ¼, raised to ½), 0 (ratio 1), 0
        shift = torch.tensor([math.log(3), -math.log(4), 0.0, 0.0]).repeat_interleave(4)[:, None]
        rollout.out.log_probs = torch.where(rollout.out.response_mask.bool(), proximal - shift, 0.0)
        # versions: groups 0-2 at version 1 (staleness 1 ≤ 1), group 3 at version 0 (staleness 2 > 1)
        versions = torch.tensor([1, 1, 1, 0]).repeat_interleave(4)
        trainer.source.queue[0] = Call(step=3, version=0, prompts=[], rollout=rollout, versions=versions)
        m = trainer.train_step(3)
        # Step 4's batch handed in entirely at version 0 (staleness 3 > 1): every group is dropped and
        # the step regenerates its own prompts with the current weights.
        queued = trainer.source.queue[0]
        zeros = torch.zeros(16, dtype=torch.long)
        stale = Call(step=4, version=0, prompts=queued.prompts, rollout=rollout, versions=zeros)
        trainer.workers.wait_generate(queued.pending)
        trainer.source.queue[0] = stale
        m4 = trainer.train_step(4)
    finally:
        trainer.workers.close()
    assert m["async/dropped"] == 4 and m["async/dropped_frac"] == 0.25
    assert m4["async/dropped"] == 16 and m4["async/dropped_frac"] == 1.0 and "actor/pg_loss" in m4
    assert m["async/staleness_count/1"] == 12 and m["async/staleness_count/0"] == 0
    tokens = rollout.out.response_mask.sum(-1)
    t0, t1, t2 = (float(tokens[4 * g : 4 * g + 4].sum()) for g in range(3))
    # weights 2 on group 0's tokens, ½ on group 1's, 1 (up to the forward's rounding) on group 2's
    tol = math.expm1(logprob_tol(AutoConfig.from_pretrained(task.model_dir)))
    expected = (2 * t0 + 0.5 * t1 + t2) / (t0 + t1 + t2)
    assert m["rollout_corr/is_weight_mean"] == pytest.approx(expected, abs=tol)
    assert m["rollout_corr/is_clip_frac"] == pytest.approx(t0 / (t0 + t1 + t2))
    assert m["rollout_corr/is_clip_frac_low"] == pytest.approx(t1 / (t0 + t1 + t2))
    # masked IS, band [0.3, 2.5]: group 0's ratio 3 and group 1's ¼ leave it, group 2's 1 stays
    assert m["rollout_corr/rs_masked_frac"] == pytest.approx((t0 + t1) / (t0 + t1 + t2))
    assert m["rollout_corr/rs_seq_masked_frac"] == pytest.approx(8 / 12)


@pytest.mark.slow
def test_resume_regenerates_the_in_flight_batch(overrides, tmp_path):
    keys = ("async_training.enable=true", "async_training.max_staleness=1", "trainer.save_freq=2", *FAST)
    train(None, overrides(tmp_path / "a", "trainer.total_training_steps=4", *keys), **QUIET)
    state = torch.load(tmp_path / "a" / "global_step_2" / "trainer_state.pt", weights_only=True)
    # Three prompt batches were drawn by the end of step 2 (step 3's was in flight): two are saved.
    assert state["batches_consumed"] == 2 and state["policy_version"] == 2
    full = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["async/staleness_max"] for r in full] == [0, 1, 1, 1]
    # Resume from step 2: step 3's prompts are drawn again and generated with the restored weights.
    import shutil

    shutil.rmtree(tmp_path / "a" / "global_step_4")
    train(None, overrides(tmp_path / "a", "trainer.total_training_steps=4", *keys), **QUIET)
    resumed = read_metrics(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert resumed[2]["async/staleness_max"] == 0  # regenerated, not the old in-flight samples
    assert resumed[3]["async/staleness_max"] == 1


@pytest.mark.slow
def test_gae_with_bypass_mode_clips_around_the_stale_behaviour_policy(overrides, tmp_path):
    """PPO with a critic, one-step-off, π_old taken from the rollout (bypass_mode): at step 1 the
    behaviour policy is the current one (ratio 1 up to the engine's rounding); at step 2 the samples
    come from the weights before step 1's update, so the PPO ratio moves away from 1."""
    keys = (
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "algorithm.adv_estimator=gae",
        "algorithm.rollout_correction.bypass_mode=true",
        "trainer.total_training_steps=2",
        *FAST,
    )
    train(None, overrides(tmp_path, *keys), **QUIET)
    first, second = read_metrics(tmp_path / "metrics.jsonl")
    assert (first["async/staleness_max"], second["async/staleness_max"]) == (0, 1)
    assert "critic/vf_explained_var" in second and "rollout_corr/kl" not in second
    assert abs(second["actor/ppo_kl"]) > 100 * abs(first["actor/ppo_kl"]) + 1e-7


@pytest.mark.slow
def test_multi_turn_tool_use_runs_one_step_off(tmp_path):
    """The Search-R1 agent loop generates inside the asynchronous generation calls: tools are called,
    the second step trains on first-version trajectories with their behaviour log-probs."""
    from tearless.trainers.records import read_records

    keys = search_r1_overrides(
        tmp_path / "cache",
        tmp_path / "run",
        "trainer.num_rollout_samples=16",
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
        *FAST,
    )
    train(None, keys, preset="search_r1", **QUIET)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["async/staleness_max"] for r in records] == [0, 1]
    assert all("rollout_corr/is_weight_mean" in r for r in records)
    assert any(rec["tool_calls"] for rec in read_records(tmp_path / "run" / "rollouts.jsonl.gz"))


def test_dynamic_sampling_and_remax_run_one_step_off(overrides, tmp_path):
    """One-step-off with DAPO's dynamic sampling and ReMax's greedy baseline: every trained group (by
    uid, in the rollout records) has n responses whose scores differ, and each response's advantage is
    its score minus one baseline shared by its prompt's responses (ReMax with an outcome reward:
    A = r − b on every token), b itself a score the task gives (0 or 1)."""
    from tearless.trainers.records import read_records

    keys = (
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "algorithm.filter_groups.max_num_gen_batches=4",
        "trainer.total_training_steps=3",
        "trainer.num_rollout_samples=-1",
        "trainer.save_freq=2",
        *DAPO_REMAX,
        *FAST,
    )
    train(None, overrides(tmp_path, *keys), **QUIET)
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [m["async/staleness_max"] for m in metrics] == [0, 1, 1]
    for m in metrics:
        assert 1 <= m["train/num_gen_batches"] <= 4 and 0 < m["train/kept_prompt_ratio"] <= 1
    groups: dict[tuple, list[dict]] = {}
    for r in read_records(tmp_path / "rollouts.jsonl.gz"):
        groups.setdefault((r["step"], r["uid"]), []).append(r)
    assert {step for step, _ in groups} == {1, 2, 3}
    for rows in groups.values():
        assert len(rows) == 4 and len({r["score"] for r in rows}) > 1
        baselines = {round(r["score"] - r["advantage"], 5) for r in rows}
        assert len(baselines) == 1 and baselines <= {0.0, 1.0}
    per_step = [sum(step == s for step, _ in groups) for s in (1, 2, 3)]
    assert all(1 <= k <= 8 for k in per_step)
    # The loader order: step 1's first batch (0), step 2's (1, submitted ahead), step 1's further
    # rounds, then step 3's first batch, in flight at the checkpoint of step 2: a resume starts there.
    state = torch.load(tmp_path / "global_step_2" / "trainer_state.pt", weights_only=True)
    assert state["batches_consumed"] == metrics[0]["train/num_gen_batches"] + 1
