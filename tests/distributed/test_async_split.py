"""The asynchronous loop on separate rollout workers (Ray, CPU) samples exactly what the same
schedule samples in one process: the split placement only adds overlap, not another algorithm."""

from __future__ import annotations

import pytest
import torch

from tearless import train
from tearless.run.tracking import read_metrics

pytestmark = pytest.mark.slow


def test_one_step_off_on_a_rollout_worker_matches_one_process(ray_session, overrides, tmp_path):
    common = (
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_training_steps=3",
        "trainer.val_before_train=false",
        "data.val_max_samples=4",
        "trainer.num_threads=1",
        "trainer.worker_timeout_s=120",
    )
    train(None, overrides(tmp_path / "local", *common), log=lambda _: None)
    split = (
        "trainer.placement=ray",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    )
    train(None, overrides(tmp_path / "split", *common, *split), log=lambda _: None)
    local, ray_run = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("local", "split"))
    assert [r["async/staleness_max"] for r in ray_run] == [0, 1, 1]
    for a, b in zip(local, ray_run, strict=True):
        # The rollout worker samples with a broadcast copy of the version-(s−2) weights, the single
        # process with those very weights: the same responses, hence the same scores.
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert a["response_length/mean"] == b["response_length/mean"]
        assert b["timing_s/update_weights"] > 0 and "timing_s/train_idle" in b
        assert a["rollout_corr/is_weight_mean"] == pytest.approx(b["rollout_corr/is_weight_mean"], abs=1e-5)


def test_a_partial_rollout_takes_the_broadcast_between_two_tokens(ray_session, overrides, task, tmp_path):
    """A weight broadcast reaches a rollout worker in the middle of its generation call: the trainer
    only waits for the sending, the worker loads the weights at its next token and labels the
    remaining tokens with their version. The broadcast here carries the unchanged weights relabelled
    as version 5, so the samples must be exactly those of an uninterrupted in-process run (the
    engine test, tests/rollout/test_partial.py, checks the log-probs under different weights); the
    same trainer then runs two one-step-off training steps with partial rollouts."""
    import ray

    from tearless.config import load_config
    from tearless.models.loading import load_causal_lm
    from tearless.rollout.hf import HFRollout
    from tearless.rollout.seeds import prompt_keys
    from tearless.trainers.rl import RLTrainer
    from tests.tolerances import LOGIT_BOUND, logprob_tol

    keys = (
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "async_training.partial_rollout=true",
        "trainer.placement=ray",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "data.val_max_samples=4",
        "trainer.num_threads=1",
        "trainer.worker_timeout_s=120",
        "trainer.total_training_steps=2",
    )
    trainer = RLTrainer(load_config(None, overrides(tmp_path, *keys)), log=lambda _: None)
    try:
        prompts = [p["input_ids"] for p in trainer.loader.batch(0, 0)]
        sampling = dict(n=8, keys=prompt_keys(3, 0, 0, len(prompts)), max_new_tokens=48, temperature=2.0)
        items = [{**p, "input_ids": ids} for p, ids in zip(trainer.loader.batch(0, 0), prompts, strict=True)]
        pending = trainer.workers.submit_generate(items, version=0, top_p=1.0, top_k=-1, **sampling)
        assert trainer.workers.sync_weights(5) == 0.0  # the sending only: no wait for the generation
        refs = [p[0] for p in pending[2]]
        running, _ = ray.wait(refs, timeout=0)
        assert not running, "the broadcast waited for the generation call to finish"
        out = trainer.workers.wait_generate(pending).out
        after = trainer.workers.generate(items[:2], version=0, top_p=1.0, top_k=-1, **sampling).out
        assert trainer.workers.receives == []  # the queued receive call ran (nothing left to take)
        model = load_causal_lm(task.model_dir)
        tok = trainer.tokenizer
        eos = {tok.eos_token_id, model.generation_config.eos_token_id} - {None}  # as the worker's engine
        engine = HFRollout(model, eos_token_ids=sorted(eos), pad_token_id=tok.pad_token_id)
        reference = engine.generate(prompts, version=0, top_p=1.0, top_k=-1, **sampling)
        assert out.response_ids.tolist() == reference.response_ids.tolist()
        atol = logprob_tol(model.config, logit_bound=LOGIT_BOUND / 2.0)
        torch.testing.assert_close(out.log_probs, reference.log_probs, atol=atol, rtol=0)
        mask = out.response_mask.bool()
        versions = out.token_versions
        assert (versions[:, 0] == 0).all()  # the first token comes from the prefill before any poll
        switched = (versions == 5) & mask
        assert switched.any(), "no token was drawn after the broadcast: nothing was interrupted"
        # One switch position for every response still running then (all rows decode in lockstep).
        first = switched.float().argmax(-1)[switched.any(-1)]
        assert first.unique().numel() == 1
        assert ((versions == 0) | (versions == 5)).all()
        assert (after.token_versions[after.response_mask.bool()] == 5).all()  # it held version 5
        trainer.policy_version = 5  # the labels are the driver's counter: continue from 5
        m1, m2 = trainer.train_step(1), trainer.train_step(2)
    finally:
        trainer.workers.close()
    for m in (m1, m2):
        assert 0.0 <= m["async/partial_frac"] <= 1.0 and m["async/dropped"] == 0
        assert "timing_s/weight_swap" in m and "actor/pg_loss" in m
    assert m1["async/staleness_max"] == 0 and trainer.policy_version == 7
