"""CPU mixed precision (``fsdp_config.param_dtype=bfloat16``): bf16 matmuls under autocast, float32
master weights, optimizer state, log-softmax and losses; detection of the hardware and its fallback."""

from __future__ import annotations

import copy

import pytest
import torch

from tearless.models import precision
from tearless.models.logprobs import response_logprobs
from tearless.models.precision import autocast_for, compute_dtype, set_compute_dtype
from tearless.models.value import response_values
from tearless.workers.optim import make_optimizer
from tests.models.test_packing import batch
from tests.tolerances import log_softmax_tol, unit_roundoff

NATIVE = precision.cpu_has_native_bf16()
needs_bf16 = pytest.mark.skipif(not NATIVE, reason="this CPU has no AVX-512 BF16 / AMX: bf16 falls back")
KEY = "actor_rollout_ref.actor.fsdp_config.param_dtype"


def tiny(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def bf16_logit_tol(config, logit_bound: float) -> float:
    """|z_bf16 − z_fp32| for one logit. Autocast rounds each matmul's two inputs to bf16 (relative
    error u = 2⁻⁸ each) and accumulates the products in float32, so one matmul's output is off by at
    most 2u·Σ|x_i w_i|; a logit passes through 4 such matmuls per decoder layer in sequence (q/k/v →
    o_proj, gate/up → down_proj) and the LM head, the errors adding. Σ|x_i w_i| is bounded by
    ``logit_bound`` (the random-init tiny model's logits and hidden sums stay below 1; float32's own
    rounding is 2¹⁶ times smaller and left out)."""
    depth = 4 * config.num_hidden_layers + 1
    return depth * 2 * unit_roundoff(torch.bfloat16) * logit_bound


def test_detection_fallback_warns_naming_the_key(monkeypatch):
    # Runs on every CPU: without the instructions, bf16 is refused with a warning and float32 is used.
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match=rf"{KEY}=bfloat16: .*AVX-512 BF16 nor AMX.*100x slower.*float32"):
        assert compute_dtype("bfloat16", "cpu", KEY) == torch.float32
    with pytest.warns(UserWarning, match=rf"{KEY}=float16: float16 has no fast matmul on CPU"):
        assert compute_dtype("float16", "cpu", KEY) == torch.float32
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert compute_dtype("bf16", "cpu", KEY) == torch.bfloat16
    # Defaults: float32 on CPU (the behaviour before mixed precision existed), bfloat16 on GPU.
    assert compute_dtype(None, "cpu", KEY) == torch.float32
    assert compute_dtype(None, "cuda", KEY) == torch.bfloat16
    assert compute_dtype("float32", "cpu", KEY) == torch.float32


def test_detection_reads_the_cpu_flags(monkeypatch, tmp_path):
    # Without torch's probe, the /proc/cpuinfo flags decide.
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    precision.cpu_has_native_bf16.cache_clear()
    try:
        flags = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
        expected = any(f" {flag}" in flags for flag in precision.NATIVE_BF16_FLAGS)
        assert precision.cpu_has_native_bf16() == expected
    finally:
        precision.cpu_has_native_bf16.cache_clear()


@needs_bf16
def test_autocast_computes_linear_layers_in_bf16_and_log_probs_in_fp32():
    model = set_compute_dtype(tiny(), torch.bfloat16)
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61)
    lp, ent = response_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, with_entropy=True, share_prompts=False
    )
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert lp.dtype == ent.dtype == torch.float32
    # The log-softmax is float32 on the upcast bf16 logits: the same logits through a float32 log-softmax
    # agree to float32 rounding (a bf16 log-softmax would be off by ~2⁻⁸·|log p| ≈ 0.02).
    with torch.no_grad(), autocast_for(model):
        from tearless.models.logprobs import _plain_logits

        logits = _plain_logits(model, prompt_ids, prompt_mask, response_ids, response_mask).float()
    ref = torch.log_softmax(logits, -1).gather(-1, response_ids[..., None]).squeeze(-1)
    mask = response_mask.bool()
    torch.testing.assert_close(lp[mask], ref[mask], atol=log_softmax_tol(61, 1.0), rtol=0)


@needs_bf16
@pytest.mark.parametrize(
    "path",
    [
        dict(share_prompts=False),
        dict(share_prompts=True),
        dict(remove_padding=True),
        dict(remove_padding=True, fused_kernels=True),
    ],
    ids=["plain", "shared-prompts", "packed", "packed-chunked"],
)
def test_bf16_log_probs_and_gradients_close_to_fp32(path):
    fp32 = tiny()
    bf16 = set_compute_dtype(copy.deepcopy(fp32), torch.bfloat16)
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61)
    weight = torch.randn(response_ids.shape, generator=torch.Generator().manual_seed(4))

    def run(model):
        lp, _ = response_logprobs(
            model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=0.7,
            with_entropy="grad", **path,
        )  # fmt: skip
        loss = (lp * weight * response_mask).sum()
        return lp.detach(), loss, torch.autograd.grad(loss, list(model.parameters()))

    lp32, _, grads32 = run(fp32)
    lp16, loss16, grads16 = run(bf16)
    mask = response_mask.bool()
    # log p = z_y − lse(z) moves by at most twice the logits' error (temperature 0.7 scales them).
    tol = 2 * bf16_logit_tol(fp32.config, 1.0 / 0.7) + log_softmax_tol(61, 1.0 / 0.7)
    diff = (lp16 - lp32)[mask].abs().max()
    assert 0 < diff <= tol  # bf16 really ran (not bit-equal) and stayed within its rounding
    assert lp16.dtype == loss16.dtype == torch.float32
    # Gradients reach the float32 master weights in float32, in the fp32 gradients' direction.
    assert all(g.dtype == torch.float32 for g in grads16)
    flat16, flat32 = torch.cat([g.flatten() for g in grads16]), torch.cat([g.flatten() for g in grads32])
    assert torch.nn.functional.cosine_similarity(flat16, flat32, dim=0) > 0.99


@needs_bf16
def test_update_keeps_fp32_master_weights_and_optimizer_state():
    from types import SimpleNamespace

    model = set_compute_dtype(tiny(), torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    optim = SimpleNamespace(
        lr=1e-3, weight_decay=0.0, betas=[0.9, 0.999], lr_warmup_steps=0, lr_warmup_steps_ratio=0.0,
        lr_scheduler_type="constant", min_lr_ratio=0.0, num_cycles=0.5,
    )  # fmt: skip
    optimizer, _ = make_optimizer(list(model.parameters()), optim, total_steps=1)
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61)
    lp, _ = response_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, remove_padding=True
    )
    (-(lp * response_mask).sum()).backward()
    optimizer.step()
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    states = [s for s in optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)


@needs_bf16
@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_critic_values_in_bf16_close_to_fp32(remove_padding):
    from transformers import LlamaForTokenClassification

    config = tiny().config
    config.num_labels, config.classifier_dropout = 1, 0.0  # as load_value_model: no dropout
    torch.manual_seed(0)
    fp32 = LlamaForTokenClassification(config)
    bf16 = set_compute_dtype(copy.deepcopy(fp32), torch.bfloat16)
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61)
    v32 = response_values(
        fp32, prompt_ids, prompt_mask, response_ids, response_mask, remove_padding=remove_padding
    )
    v16 = response_values(
        bf16, prompt_ids, prompt_mask, response_ids, response_mask, remove_padding=remove_padding
    )
    mask = response_mask.bool()
    assert v16.dtype == torch.float32
    diff = (v16 - v32)[mask].abs().max()
    assert 0 < diff <= bf16_logit_tol(config, 1.0)


@needs_bf16
def test_rollout_samples_under_bf16_and_its_log_probs_match_the_trainers():
    # The rollout's own log-probs under bf16 vs the trainer's bf16 recomputation: both bf16, another
    # batch layout (KV cache, shared rows): within twice the bf16 log-prob tolerance of fp32.
    from tearless.rollout.hf import HFRollout

    model = tiny()
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    engine = HFRollout(model, eos_token_ids=[2], pad_token_id=0, compute_dtype=torch.bfloat16)
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    out = engine.generate(prompts, n=2, max_new_tokens=6, keys=[1, 2])
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}
    set_compute_dtype(model, torch.bfloat16)
    lp, _ = response_logprobs(
        model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, share_prompts=False
    )
    mask = out.response_mask.bool()
    tol = 2 * (2 * bf16_logit_tol(model.config, 1.0) + log_softmax_tol(61, 1.0))
    assert (lp - out.log_probs)[mask].abs().max() <= tol


def test_config_keys_validate_and_take_verls_spelling():
    from tearless.config import ConfigError, load_config

    cfg = load_config(None, ["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"])
    assert cfg.actor_rollout_ref.actor.fsdp_config.param_dtype == "bf16"
    assert cfg.critic.model.fsdp_config.param_dtype is None  # null: float32 on CPU, bfloat16 on GPU
    with pytest.raises(ConfigError, match=r"critic\.model\.fsdp_config\.param_dtype: 'int8' is not one of"):
        load_config(None, ["critic.model.fsdp_config.param_dtype=int8"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.dtype: 'half' is not one of"):
        load_config(None, ["actor_rollout_ref.rollout.dtype=half"])
    with pytest.raises(ConfigError, match=r"mixed_precision\.reduce_dtype'=bf16 .*float32"):
        load_config(None, ["actor_rollout_ref.ref.fsdp_config.mixed_precision.reduce_dtype=bf16"])


def test_rollout_in_bf16_against_an_fp32_trainer_logs_the_mismatch(overrides, task, tmp_path):
    # rollout.dtype=bfloat16 with the actor in float32: the trainer recomputes π_old even on-policy
    # and logs rollout_corr/*. Without native bf16 the rollout falls back to float32 (a warning):
    # no mismatch, no recomputation.
    from transformers import AutoConfig

    from tearless import train
    from tearless.run.tracking import read_metrics
    from tests.tolerances import logprob_tol

    extra = ["trainer.total_training_steps=1", "trainer.val_before_train=false", "data.val_max_samples=4"]
    extra += ["actor_rollout_ref.rollout.val_kwargs.do_sample=false", "trainer.num_threads=1"]
    extra += ["actor_rollout_ref.rollout.dtype=bfloat16"]
    if NATIVE:
        train(None, overrides(tmp_path, *extra), log=lambda _: None)
    else:
        with pytest.warns(UserWarning, match="actor_rollout_ref.rollout.dtype=bfloat16"):
            train(None, overrides(tmp_path, *extra), log=lambda _: None)
    (m,) = read_metrics(tmp_path / "metrics.jsonl")
    if not NATIVE:
        assert "rollout_corr/kl" not in m
        return
    config = AutoConfig.from_pretrained(task.model_dir)
    # Larger than two float32 passes can differ (the mismatch is bf16's), smaller than bf16's bound
    # on the warmed-up model's logits (|z| ≤ 12).
    assert logprob_tol(config) < m["rollout_corr/max_abs_log_ratio"]
    bf16_lp = 2 * bf16_logit_tol(config, 12.0) + log_softmax_tol(config.vocab_size, 12.0)
    assert m["rollout_corr/max_abs_log_ratio"] <= bf16_lp
    assert 0 <= m["rollout_corr/k3_kl"] <= bf16_lp**2


def _casts(run) -> int:
    """The dtype conversions (aten::_to_copy) that ``run()`` dispatches."""
    from torch.profiler import profile

    with profile() as prof:
        run()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def test_a_forward_only_pass_in_bf16_casts_each_weight_once_per_autocast_region():
    # 10 calls of Linear(64, 64) under bf16 autocast: each call casts its input (10 casts); the weight
    # and the bias are cast once for the region under forward_only (12 in all), but again at every
    # call under inference_mode, where autocast keeps no cast (30), as the decode loop did.
    lin, x = torch.nn.Linear(64, 64), torch.randn(4, 64)

    def ten_calls(mode):
        def run():
            with mode, torch.autocast("cpu", dtype=torch.bfloat16):
                for _ in range(10):
                    lin(x)

        return run

    assert _casts(ten_calls(precision.forward_only("cpu", torch.bfloat16))) == 12
    assert _casts(ten_calls(torch.inference_mode())) == 30
    assert isinstance(precision.forward_only("cpu", torch.float32), torch.inference_mode)
    assert isinstance(precision.forward_only("cuda", torch.bfloat16), torch.inference_mode)


def test_weights_changed_inside_a_region_are_used_once_the_cast_cache_is_cleared():
    # What the decode loop does when a partial rollout loads new weights mid-generation.
    lin, x = torch.nn.Linear(8, 8, bias=False), torch.randn(2, 8)
    with precision.forward_only("cpu", torch.bfloat16), torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)
        lin.weight.mul_(2.0)  # in place: the cached bf16 cast still holds the old weights
        stale = lin(x)
        torch.clear_autocast_cache()
        fresh = lin(x)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = lin(x)  # a new region: the doubled weights, cast afresh
    assert torch.equal(fresh, expected)
    assert not torch.equal(stale, expected)
