"""A vision-language policy on the Ray placement: the vlm_count task's tiny Idefics3 trained by GRPO on
2 CPU workers (FSDP2 over gloo: the language model's decoder layers and the vision encoder's layers
sharded) against the same run in one process.

Sampling is keyed by each sample's identity (:mod:`tearless.rollout.seeds`), so both runs draw the same
responses; the workers' share of the batch carries each row's pixels into the actor's, the reference's
and the update's forwards. Tolerances as in tests/distributed/test_ray_fsdp.py (sharding reorders float
sums, tests/tolerances.py), with the vision tower's and the connector's dot products added to the chain
behind a logit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tearless import train
from tearless.models.loading import load_causal_lm
from tearless.run.tracking import read_metrics
from tests.distributed.test_ray_fsdp import ray_session, rollouts  # noqa: F401 (the Ray session)
from tests.tolerances import (
    eps,
    forward_terms,
    kl_of_equal_policies,
    module_terms,
    sum_tol,
)
from tests.trainers.test_vlm import qwen_files, vlm_logprob_tol, vlm_overrides

# Every test in test_ray_fsdp's Ray session, whose workers import the tests' modules (length_score).
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

TOWER = "model.vision_model."
# The update's logged numbers compared between the placements (a KL loss: the reference pass too).
COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")
PROMPTS, N, RESPONSE = 4, 4, 4  # vlm_overrides' step: 16 responses of at most 4 tokens


def vlm_run(vlm_task, run_dir, *extra: str) -> list[str]:
    """test_vlm's two GRPO steps (4 prompts × 4 responses of at most 4 tokens, a KL loss), every
    response recorded, one thread per process."""
    return vlm_overrides(
        vlm_task,
        run_dir,
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "algorithm.rollout_correction.rollout_is=token",  # logs the engine's against the pass's log-probs
        "actor_rollout_ref.model.share_prompt_forward=false",  # sharded ranks never share prompts
        "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
        "trainer.val_before_train=false",
        "data.val_max_samples=4",
        "trainer.num_rollout_samples=64",
        "trainer.num_threads=1",
        "trainer.worker_timeout_s=300",  # a fresh pool on a loaded 2-core machine starts slowly
        *extra,
    )


def length_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The response's length in characters: a reward that varies within every group of the 5-step
    model (whose counts are still all wrong), so that GRPO's advantages and updates are not zero. The
    workers unpickle it: they import this module (the session's PYTHONPATH)."""
    return float(len(solution_str))


@pytest.fixture(scope="module")
def runs(vlm_task, tmp_path_factory):
    local = tmp_path_factory.mktemp("vlm-local")
    train(None, vlm_run(vlm_task, local), reward_fn=length_score, log=lambda _: None)
    ray_dir = tmp_path_factory.mktemp("vlm-ray")
    two = ("trainer.placement=ray", "trainer.n_gpus_per_node=2")
    train(None, vlm_run(vlm_task, ray_dir, *two), reward_fn=length_score, log=lambda _: None)
    return local, ray_dir


def chain_terms(model_dir) -> int:
    """The accumulations behind one logit of the task's Idefics3: the vision tower's and the connector's
    dot products, then the language model's (tests/tolerances.py)."""
    model = load_causal_lm(model_dir, meta=True)
    inner = model.model
    return (
        module_terms(inner.vision_model)
        + module_terms(inner.connector)
        + forward_terms(model.config.text_config)
    )


def test_two_grpo_steps_on_two_workers_match_the_single_process_run(runs, vlm_task):
    local, ray_dir = runs
    terms = chain_terms(vlm_task.model_dir)
    logprob = vlm_logprob_tol(vlm_task.model_dir)
    tokens = PROMPTS * N * RESPONSE
    # A logged loss, KL or norm: the gradient's sums (a forward and a backward per token, summed over
    # the step's tokens), terms of both signs, safety 10 (as test_ray_fsdp's loss_rel).
    rel = sum_tol(2 * terms + tokens, 1.0, safety=10)
    a, b = read_metrics(local / "metrics.jsonl"), read_metrics(ray_dir / "metrics.jsonl")
    assert [m["step"] for m in b] == [1, 2]
    ra, rb = rollouts(local), rollouts(ray_dir)
    for step, (ma, mb) in enumerate(zip(a, b, strict=True), start=1):
        assert len(rb[step]) == PROMPTS * N and rb[step] == ra[step], step  # the same samples, scores
        for key in COMPARED:
            assert mb[key] == pytest.approx(ma[key], rel=rel, abs=rel), (step, key)
        # The workers' log-prob pass read the images: it agrees with the engine that sampled with them
        # (an image-blind pass is ~7e-3 off on this model, tests/models/test_vision.py).
        assert mb["rollout_corr/max_abs_log_ratio"] <= logprob, step
    assert b[0]["critic/advantages/max"] > 0.5  # the length reward gave the update a signal
    # Step 1: π_θ = π_ref, a KL of equal policies to rounding; step 2: the update moved π_θ off it.
    zero_kl = kl_of_equal_policies("low_var_kl", logprob)
    assert b[0]["actor/kl_loss"] <= zero_kl < 10 * zero_kl < b[1]["actor/kl_loss"]


def test_the_tower_is_byte_equal_and_the_language_model_moved_as_in_one_process(runs, vlm_task):
    local, ray_dir = runs
    start = load_file(Path(vlm_task.model_dir) / "model.safetensors")
    wa = load_file(local / "global_step_2" / "actor" / "model.safetensors")
    wb = load_file(ray_dir / "global_step_2" / "actor" / "model.safetensors")
    assert wa.keys() == wb.keys() == start.keys()
    tower = {name for name in start if name.startswith(TOWER)}
    changed = {name for name in start if not start[name].equal(wb[name])}
    assert tower and not changed & tower  # frozen on every rank: no gradient, no optimizer state
    assert any(".text_model.layers." in name for name in changed)
    assert any(".connector." in name for name in changed)
    # The same two AdamW steps, compared tensor by tensor in the L2 norm: 2 ulps of θ per step, plus the
    # gradients' rounding relative to the distance travelled, safety 10 (test_ray_fsdp's
    # assert_same_steps). Not entry by entry: AdamW divides by √v̂ + ε, so an entry whose gradient is
    # within rounding of zero may take another step altogether (up to a flipped sign, 2·lr); one
    # gate_proj entry here came within 4% of the per-entry bound, while over a tensor such entries
    # are a small share (4e-5 of the step's norm measured, the bound 3.6e-3). A lost gradient (the
    # embedding's or the connector's) changes its tensor's step by its whole size.
    terms = 2 * chain_terms(vlm_task.model_dir) + PROMPTS * N * RESPONSE
    for name in start:
        moved = float((wa[name] - start[name]).norm())
        tol = 2 * 2 * eps(wa[name].dtype) * float(wa[name].norm()) + sum_tol(terms, moved, safety=10)
        assert float((wb[name] - wa[name]).norm()) <= tol, name


def test_one_step_off_on_a_rollout_worker_matches_one_process(vlm_task, tmp_path):
    """async k = 1 with a separate rollout worker (the split placement): the training worker broadcasts
    the policy (vision tower included) after every update and the rollout worker samples each batch
    with its images one update behind, exactly what the same schedule samples in one process."""
    common = (
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "trainer.total_training_steps=3",
        "trainer.save_freq=3",
    )
    split = (
        "trainer.placement=ray",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
    )
    for name, extra in (("local", common), ("split", (*common, *split))):
        train(None, vlm_run(vlm_task, tmp_path / name, *extra), reward_fn=length_score, log=lambda _: None)
    local, ray_run = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("local", "split"))
    assert [m["async/staleness_max"] for m in ray_run] == [0, 1, 1]
    logprob = vlm_logprob_tol(vlm_task.model_dir)
    assert ray_run[0]["rollout_corr/max_abs_log_ratio"] <= logprob  # sampled by the weights it trains
    for a, b in zip(local, ray_run, strict=True):
        # The worker samples with a broadcast copy of the weights the single process samples with.
        assert a["critic/score/mean"] == b["critic/score/mean"]
        assert a["response_length/mean"] == b["response_length/mean"]
        assert b["timing_s/update_weights"] > 0
        # One update behind: the pass's log-probs are the newer policy's, the engine's the older's; the
        # training worker is alone (unsharded), so each of the two is the single process's to the
        # log-prob bound, and their largest difference within twice that.
        ratio = a["rollout_corr/max_abs_log_ratio"]
        assert b["rollout_corr/max_abs_log_ratio"] == pytest.approx(ratio, abs=2 * logprob)


def test_a_qwen_vl_policy_on_two_workers_matches_one_process(tmp_path):
    """Qwen2-VL on 2 workers: FSDP2 shards its language layers and its tower's blocks, the merge runs in
    the sharded forward with the M-RoPE positions; the same samples, losses and tower as one process."""
    files = qwen_files(tmp_path, "qwen2_vl")
    two = ("trainer.placement=ray", "trainer.n_gpus_per_node=2")
    for name, extra in (("local", ()), ("ray", two)):
        train(None, vlm_run(files, tmp_path / name, *extra), reward_fn=length_score, log=lambda _: None)
    a, b = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("local", "ray"))
    model = load_causal_lm(files.model_dir, meta=True)
    terms = module_terms(model.model.visual) + forward_terms(model.config.text_config)
    logprob = vlm_logprob_tol(files.model_dir)
    rel = sum_tol(2 * terms + PROMPTS * N * RESPONSE, 1.0, safety=10)
    ra, rb = rollouts(tmp_path / "local"), rollouts(tmp_path / "ray")
    for step, (ma, mb) in enumerate(zip(a, b, strict=True), start=1):
        assert len(rb[step]) == PROMPTS * N and rb[step] == ra[step], step
        for key in COMPARED:
            assert mb[key] == pytest.approx(ma[key], rel=rel, abs=rel), (step, key)
        assert mb["rollout_corr/max_abs_log_ratio"] <= logprob, step
    start = load_file(Path(files.model_dir) / "model.safetensors")
    after = load_file(tmp_path / "ray" / "global_step_2" / "actor" / "model.safetensors")
    # Qwen2-VL's checkpoint names: the tower under visual., the language model's layers under model.layers.
    tower = {name for name in start if name.startswith("visual.")}
    assert tower and all(start[name].equal(after[name]) for name in tower)
    assert any(not start[name].equal(after[name]) for name in start if name.startswith("model.layers."))
