"""The memory estimate printed at start (tearless.models.memory), against cases worked by hand."""

from __future__ import annotations

import json

import pytest
from transformers import Qwen2Config

from tearless.config import ConfigError, load_config
from tearless.config.memory import announce_memory, check_memory, run_estimate
from tearless.models.memory import GIB, ModelShape, activation_bytes_per_token, estimate

QWEN_05B = ModelShape(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936, tied=True)


def test_a_tiny_shape_by_hand():
    # h = 4, L = 1, 2 heads of 2 (q width 4), 1 KV head (k = 2), i = 8, V = 10, untied head.
    s = ModelShape(hidden=4, layers=1, heads=2, kv_heads=1, intermediate=8, vocab=10, tied=False)
    assert s.kv_width == 2
    # embeddings and head 2·10·4 = 80; q, o 2·4·4 = 32; k, v 2·4·2 = 16; gate, up, down 3·4·8 = 96;
    # two norms 8; final norm 4: 80 + 152 + 4.
    assert s.parameters == 236
    # LoRA r = 1: q, o (4 + 4)·2 = 16; k, v (4 + 2)·2 = 12; gate, up, down (4 + 8)·3 = 36.
    assert s.lora_parameters(1) == 64
    # float32 compute: 2·4·4 (norm inputs) + 4·(6·4 + 4·2 + 4·8) = 32 + 256 = 288 per layer; logits
    # 4·10 and their float32 working copy 4·10.
    assert activation_bytes_per_token(s, compute_bytes=4, chunked=False) == 288 + 80
    assert activation_bytes_per_token(s, compute_bytes=4, chunked=True) == 288 + 40
    # checkpointing keeps each block's float32 input (4·4) and recomputes one block (288).
    assert activation_bytes_per_token(s, compute_bytes=4, chunked=True, checkpointing=True) == 16 + 288 + 40
    e = estimate(s, world=2, compute_bytes=4, micro_tokens=10, rollout_tokens=6, chunked=False)
    # sharded over 2: 4·236/2 = 472, gradients 472, AdamW 8·236/2 = 944; KV 2·1·2·4 = 16 B per token.
    assert (e.parameters, e.gradients, e.optimizer, e.kv_per_token) == (472, 472, 944, 16)
    # peak: 472 + 944 + max(472 + 368·10, 16·6) = 5,568.
    assert e.activations == 3680 and e.kv_cache == 96 and e.peak == 5568
    lora = estimate(
        s, lora_rank=1, compute_bytes=4, micro_tokens=1, rollout_tokens=1, chunked=True, reference=True
    )
    # LoRA: the base's 236 weights and the 64 adapter weights on top, 4·300; gradients and moments of
    # the adapters only; the reference is the adapters-off actor (no second copy).
    assert (lora.parameters, lora.gradients, lora.optimizer, lora.reference) == (1200, 256, 512, 0)
    off = estimate(s, compute_bytes=4, micro_tokens=1, rollout_tokens=1, chunked=True, optimizer_offload=True)
    assert off.optimizer == 0 and off.parameters == 944
    # A distillation teacher of the same shape: its float32 weights, 4·236/2 = 472, on top of the
    # peak above (LoRA's adapters-off trick does not apply: it is another model); none when offloaded.
    kw = dict(world=2, compute_bytes=4, micro_tokens=10, rollout_tokens=6, chunked=False, teacher=s)
    taught = estimate(s, **kw)
    assert taught.teacher == 472 and taught.peak == 5568 + 472
    assert "teacher 0.00" in taught.line("x") and estimate(s, **kw, teacher_offload=True).teacher == 0


def test_qwen25_05b_by_hand():
    # Embeddings 151,936·896 = 136,134,656 (tied); per layer 2·896·896 + 2·896·128 + 3·896·4,864 + 2·896
    # = 14,911,232, ×24 = 357,869,568; final norm 896. 494,005,120, the published 494,032,768 less
    # the q/k/v biases (24·(896 + 2·128) = 27,648).
    assert QWEN_05B.parameters == 494_005_120
    # bf16 compute: 2·896·4 + 2·(6·896 + 4·128 + 4·4,864) = 57,856 B per layer, ×24 = 1,388,544;
    # bf16 logits 2·151,936 = 303,872 (chunked: no float32 copy).
    assert activation_bytes_per_token(QWEN_05B, compute_bytes=2, chunked=True) == 1_692_416
    # KV: 2·24·128·2 = 12,288 B per token.
    e = estimate(QWEN_05B, compute_bytes=2, micro_tokens=16384, rollout_tokens=256 * 1536, chunked=True)
    assert e.kv_per_token == 12_288
    # peak = 4N + 8N + max(4N + 1,692,416·16,384, 12,288·393,216) = 7,904,081,920 + 27,728,543,744
    # = 35,632,625,664 B.
    assert e.peak == 12 * 494_005_120 + 4 * 494_005_120 + 1_692_416 * 16384
    assert e.peak == 35_632_625_664 and e.peak / GIB == pytest.approx(33.19, abs=0.01)


def test_from_a_transformers_config_and_a_run_config():
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
    )  # fmt: skip
    assert ModelShape.from_config(config) == QWEN_05B
    cfg = load_config(
        None,
        ["data.max_prompt_length=512", "data.max_response_length=1024", "data.train_batch_size=32",
         "actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.rollout.n=8"],
        device="cuda",
        notify=lambda _: None,
    )  # fmt: skip
    e = run_estimate(cfg, config, "cuda")
    # CUDA defaults: a 16,384-token micro-batch, bf16, chunked logits; the rollout caches 32·8 = 256
    # sequences of 512 + 1,024 tokens: the case above.
    assert (e.micro_tokens, e.rollout_tokens) == (16384, 256 * 1536)
    assert (
        e.peak
        == estimate(QWEN_05B, compute_bytes=2, micro_tokens=16384, rollout_tokens=393216, chunked=True).peak
    )
    # On CPU an unset entropy_from_logits_with_chunking does not chunk: the float32 copy (4V) is counted.
    cpu = run_estimate(cfg, config, "cpu")
    assert cpu.activation_per_token == activation_bytes_per_token(QWEN_05B, compute_bytes=4, chunked=False)


def test_a_colocated_critic_by_hand_and_from_a_ppo_config():
    from tearless.models.memory import critic_part

    # The tiny shape's value model: the embedding once (10·4 = 40), the 152 of the block and the final
    # norm's 4: N_c = 196; float32 4N_c + AdamW 8N_c = 2,352 held, gradients 4N_c = 784. Activations
    # per token: the block's 288 and a one-wide head, 4·1 (chunked).
    s = ModelShape(hidden=4, layers=1, heads=2, kv_heads=1, intermediate=8, vocab=10, tied=False)
    part = critic_part(s, compute_bytes=4, micro_tokens=10)
    assert part == {"critic": 2352, "critic_gradients": 784, "critic_activations": 2920}
    e = estimate(s, compute_bytes=4, micro_tokens=10, rollout_tokens=6, chunked=False, critic=part)
    # state: the actor's weights and AdamW 4·236 + 8·236 = 2,832, the critic's 2,352, and the larger of
    # the two gradients (each role's are freed once its update is done): the actor's 4·236 = 944.
    assert e.state == 2832 + 2352 + 944
    # peak: the actor's weights and AdamW 2,832, the critic's 2,352, then the largest of the actor's
    # update (944 + 368·10), the critic's (784 + 2,920) and the KV cache (16·6).
    assert e.peak == 2832 + 2352 + max(944 + 3680, 784 + 2920, 96)
    # On a CPU an update keeps its gradients to the next one: both roles' are held through every phase.
    kept = estimate(
        s,
        compute_bytes=4,
        micro_tokens=10,
        rollout_tokens=6,
        chunked=False,
        critic=part,
        frees_gradients=False,
    )
    assert kept.state == 2832 + 2352 + 944 + 784
    assert kept.peak == kept.state + max(3680, 2920, 96)
    assert "critic 0.00 (+ activations 0.00 in its update)" in e.line("x")
    # A state over the card names the critic's offload keys too; a critic update over it, its own.
    refusal = r"critic 0\.0\) but .*param_offload=true \(critic\.model\.fsdp_config's too\)"
    with pytest.raises(ConfigError, match=refusal):
        check_memory(e, e.state - 1, "GPU")
    big = estimate(s, compute_bytes=4, micro_tokens=10, rollout_tokens=6, chunked=False,
                   critic=critic_part(s, compute_bytes=4, micro_tokens=1000))  # fmt: skip
    warning = check_memory(big, big.state + 10_000, "GPU")
    assert warning is not None and "the critic's activations up to" in warning
    assert "critic.model.enable_gradient_checkpointing=true" in warning
    # Offloads, copies and sharding as the actor's.
    sharded = critic_part(s, world=2, compute_bytes=4, micro_tokens=10, optimizer_offload=True, copy_bytes=2)
    assert (sharded["critic"], sharded["critic_gradients"]) == (6 * 196 // 2, 4 * 196 // 2)
    # From a config: PPO (GAE) trains a critic of the actor's shape on the actor's GPU; it is counted
    # with its own micro-batches, and not when it has a pool of its own.
    config = Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
    )  # fmt: skip
    ppo = ["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=false"]
    ppo.append("critic.ppo_micro_batch_size_per_gpu=2")
    cfg = load_config(None, ppo, device="cuda", notify=lambda _: None)
    e = run_estimate(cfg, config, "cuda")
    assert e.critic == 12 * QWEN_05B.parameters and e.critic_gradients == 4 * QWEN_05B.parameters
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    per_token = critic_part(QWEN_05B, compute_bytes=2, micro_tokens=1)["critic_activations"]
    assert e.critic_activations == 2 * seq * per_token
    assert e.frees_gradients and not run_estimate(load_config(None, ppo), config, "cpu").frees_gradients
    grpo = run_estimate(load_config(None, [], device="cuda", notify=lambda _: None), config, "cuda")
    assert grpo.critic == grpo.critic_gradients == grpo.critic_activations == 0
    apart = [*ppo, "trainer.placement=ray", "trainer.n_gpus_per_node=2", "trainer.colocate=false"]
    own_pool = load_config(None, apart, device="cuda", notify=lambda _: None)
    assert run_estimate(own_pool, config, "cuda").critic == 0
    # One GPU a pool (world 1): the critic still has its own, as a separate reference and teacher do.
    kl = "actor_rollout_ref.actor.use_kl_loss=true"
    one = [*apart[:-2], "trainer.n_gpus_per_node=1", "trainer.colocate=false"]
    e = run_estimate(load_config(None, [*one, kl], device="cuda", notify=lambda _: None), config, "cuda")
    assert (e.critic, e.reference) == (0, 0)
    colocated = load_config(None, [*one[:-1], kl], device="cuda", notify=lambda _: None)
    e = run_estimate(colocated, config, "cuda")
    assert (e.critic, e.reference) == (12 * QWEN_05B.parameters, 4 * QWEN_05B.parameters)
    distill = ["algorithm.adv_estimator=on_policy_distill", "actor_rollout_ref.teacher.model.path=/t"]
    for extra, teacher in (([], 4 * QWEN_05B.parameters), (["trainer.colocate=false"], 0)):
        keys = [*distill, "trainer.placement=ray", "trainer.n_gpus_per_node=1", *extra]
        cfg = load_config(None, keys, device="cuda", notify=lambda _: None)
        assert run_estimate(cfg, config, "cuda", config).teacher == teacher
    # A critic budget under one sequence: a longer row is a micro-batch of its own, priced at its length.
    short = [*ppo[:1], "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=50"]
    e = run_estimate(load_config(None, short, device="cuda", notify=lambda _: None), config, "cuda")
    assert e.critic_activations == seq * per_token


def test_compute_copies_add_two_bytes_per_parameter_and_halve_the_reference():
    # fsdp_config.compute_copies=true, KL loss (a separate reference), one GPU, bf16: the actor holds
    # its float32 masters (4N) and bf16 copies (2N); the reference its parameters in bf16 (2N, not 4N).
    n, arr = QWEN_05B.parameters, "actor_rollout_ref"
    keys = [f"{arr}.actor.use_kl_loss=true", f"{arr}.actor.fsdp_config.compute_copies=true"]
    config = Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
    )  # fmt: skip
    on = run_estimate(load_config(None, keys, device="cuda", notify=lambda _: None), config, "cuda")
    off = run_estimate(load_config(None, keys[:1], device="cuda", notify=lambda _: None), config, "cuda")
    assert (off.parameters, off.reference) == (4 * n, 4 * n)
    assert (on.parameters, on.reference) == (6 * n, 2 * n)
    assert on.state == off.state  # +2N for the copies, -2N for the reference
    # Copies are bf16 only, per role: an explicit float32 actor or reference makes none.
    f32 = [
        *keys,
        f"{arr}.actor.fsdp_config.param_dtype=float32",
        f"{arr}.ref.fsdp_config.param_dtype=float32",
    ]
    est = run_estimate(load_config(None, f32, device="cuda", notify=lambda _: None), config, "cuda")
    assert (est.parameters, est.reference) == (4 * n, 4 * n)
    # The teacher by its own key: held in bf16 unless its compute_copies says otherwise.
    teach = [*keys, f"{arr}.teacher.model.path=/t", "algorithm.adv_estimator=on_policy_distill"]
    for own, expect in ((None, 2), ("false", 4)):
        extra = [] if own is None else [f"{arr}.teacher.fsdp_config.compute_copies={own}"]
        cfg = load_config(None, [*teach, *extra], device="cuda", notify=lambda _: None)
        assert run_estimate(cfg, config, "cuda", config).teacher == expect * n
    # LoRA: the reference is the adapters-off actor, and the frozen base is held in bf16 when the engine
    # samples in bf16 (the CUDA default): 2 bytes a base parameter, 4 + 2 for the T adapter parameters
    # on top of it; a float32 engine keeps the float32 base beside its copies (6 bytes a parameter).
    lora = [*keys, f"{arr}.model.lora_rank=8"]
    t = QWEN_05B.lora_parameters(8)
    for extra, expect in (([], 2 * n + 6 * t), ([f"{arr}.rollout.dtype=float32"], 6 * (n + t))):
        cfg = load_config(None, [*lora, *extra], device="cuda", notify=lambda _: None)
        est = run_estimate(cfg, config, "cuda")
        assert (est.parameters, est.reference, est.gradients) == (expect, 0, 4 * t)
    # Sharded models use FSDP2's mixed precision: no copies, a float32 reference shard.
    two = [*keys, "trainer.placement=ray", "trainer.n_gpus_per_node=2"]
    sharded = run_estimate(load_config(None, two, device="cuda", notify=lambda _: None), config, "cuda")
    assert (sharded.parameters, sharded.reference) == (4 * n // 2, 4 * n // 2)


def test_offloads_on_one_gpu_shard_the_models_and_hold_no_optimizer_state():
    # Any role's offload on one GPU makes FSDP2 shard every model over a one-rank group: they compute
    # through its mixed precision, so compute_copies adds no copy and a LoRA base stays float32. With
    # the parameters offloaded, their gradients and AdamW's state are in CPU memory too.
    n, arr = QWEN_05B.parameters, "actor_rollout_ref"
    config = Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
    )  # fmt: skip
    t = QWEN_05B.lora_parameters(8)
    lora = [f"{arr}.model.lora_rank=8", f"{arr}.actor.fsdp_config.compute_copies=true"]
    for offload in (
        f"{arr}.actor.fsdp_config.optimizer_offload=true",
        "critic.model.fsdp_config.param_offload=true",
    ):
        cfg = load_config(
            None, [*lora, offload, "algorithm.adv_estimator=gae"], device="cuda", notify=lambda _: None
        )
        assert run_estimate(cfg, config, "cuda").parameters == 4 * (n + t)
    cfg = load_config(None, lora, device="cuda", notify=lambda _: None)
    assert run_estimate(cfg, config, "cuda").parameters == 2 * n + 6 * t  # unsharded: the base in bf16
    offloaded = [f"{arr}.actor.fsdp_config.param_offload=true", "algorithm.adv_estimator=gae"]
    offloaded.append("critic.model.fsdp_config.param_offload=true")
    e = run_estimate(load_config(None, offloaded, device="cuda", notify=lambda _: None), config, "cuda")
    assert (e.parameters, e.gradients, e.optimizer, e.critic, e.critic_gradients) == (0, 0, 0, 0, 0)
    assert e.state == 0


def test_only_a_state_that_cannot_fit_is_refused_and_an_activation_bound_over_the_card_warns():
    e = estimate(QWEN_05B, compute_bytes=2, micro_tokens=16384, rollout_tokens=256 * 1536, chunked=True)
    # State: 16 B per parameter (4 weights + 4 gradients + 8 AdamW) · 494,005,120 = 7.36 GiB; the
    # activations' bound 25.8 GiB and the KV cache's 4.5 GiB make the 33.2 GiB peak.
    assert e.state == 16 * 494_005_120 and e.state / GIB == pytest.approx(7.36, abs=0.01)
    assert check_memory(e, 80 * GIB, "GPU") is None  # 33.2 GiB fits an 80 GB card
    # 30 GiB: the state fits; weights + AdamW + gradients + activations (1.84 + 3.68 + 1.84 + 25.8) do
    # not, weights + AdamW + KV (1.84 + 3.68 + 4.5 = 10.0) do: one warning naming the activation keys.
    warning = check_memory(e, 30 * GIB, "GPU")
    assert warning is not None and "\n" not in warning
    assert warning.startswith("warning: the actor's rank may need up to ~33.2 GiB, over this GPU's 30.0 GiB")
    for key in ("ppo_max_token_len_per_gpu", "ppo_micro_batch_size_per_gpu", "enable_gradient_checkpointing"):
        assert key in warning
    assert "rollout.n" not in warning
    # 8 GiB: the state (7.36) still fits; both bounds are over: their keys both named.
    both = check_memory(e, 8 * GIB, "GPU")
    assert both is not None and "rollout.n" in both and "ppo_max_token_len_per_gpu" in both
    # 7 GiB: the state alone cannot fit: refused in one line naming the keys that shrink it.
    with pytest.raises(ConfigError) as err:
        check_memory(e, 7 * GIB, "GPU")
    msg = str(err.value)
    assert "\n" not in msg and "holds ~7.4 GiB of weights, gradients and optimizer state" in msg
    assert "but this GPU has 7.0 GiB" in msg
    for key in ("optimizer_offload", "param_offload", "lora_rank", "n_gpus_per_node"):
        assert key in msg


def test_the_default_run_prints_no_estimate_and_a_pretrained_model_on_cpu_one_line(task, tmp_path):
    cfg = load_config(None, [], device="cpu")
    lines: list[str] = []
    assert announce_memory(cfg, str(task.model_dir), "cpu", lines.append) is not None
    assert lines == []  # the embedded tiny model: the default run's output as it was
    qwen = {
        "model_type": "qwen2", "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "intermediate_size": 4864, "vocab_size": 151936,
        "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    announce_memory(cfg, str(tmp_path), "cpu", lines.append)
    assert len(lines) == 1 and lines[0].startswith(
        "memory estimate (the actor's rank, GiB): parameters 1.84,"
    )
