"""The vLLM engine on the embedded task's tiny model: only where vLLM and a CUDA GPU are available.

vLLM cannot be installed on the CPU machines this project is developed and tested on, so these tests
are skipped there (the reason is printed with ``pytest -ra``); they have not been run in CI.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM needs a CUDA GPU and a torch build matching its wheel")
if not torch.cuda.is_available():
    pytest.skip("vLLM rollout needs a CUDA GPU", allow_module_level=True)

from tearless.models.loading import load_causal_lm, load_tokenizer
from tearless.models.logprobs import response_logprobs
from tearless.models.weights import hf_weights
from tearless.rollout.correction import rollout_correction
from tearless.rollout.hf import HFRollout
from tearless.rollout.seeds import prompt_keys
from tearless.rollout.vllm import VLLMRollout

pytestmark = pytest.mark.slow


def rollout_cfg(**kw):
    base = dict(
        gpu_memory_utilization=0.2,
        tensor_model_parallel_size=1,
        free_cache_engine=True,
        weight_sync_timeout_s=120.0,
    )
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def setup(task):
    tok = load_tokenizer(task.model_dir)
    model = load_causal_lm(task.model_dir).cuda()
    engine = VLLMRollout(
        str(task.model_dir),
        rollout_cfg(),
        dtype="float32",
        eos_token_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
        seed=0,
    )
    prompts = [tok("12+34=")["input_ids"], tok("5+7=")["input_ids"], tok("40+2=")["input_ids"]]
    return tok, model, engine, prompts


def test_samples_with_log_probs_close_to_the_trainers(setup):
    _, model, engine, prompts = setup
    out = engine.generate(prompts, n=4, max_new_tokens=8, keys=prompt_keys(0, 0, 0, len(prompts)))
    assert out.response_ids.shape[0] == 12 and out.prompt_ids.shape[0] == 12
    assert bool((out.response_mask.sum(-1) > 0).all())
    with torch.no_grad():
        lp, _ = response_logprobs(model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask)
    _, metrics = rollout_correction(lp.cpu(), out.log_probs, out.response_mask, level="token")
    assert metrics["rollout_corr/max_abs_log_ratio"] < 0.05, metrics
    assert engine.asleep  # the engine released its memory after generating


def test_same_keys_draw_the_same_responses_in_any_batch(setup):
    # Placement invariance: each prompt is one request seeded from its key.
    _, _, engine, prompts = setup
    keys = prompt_keys(3, 1, 0, len(prompts))
    together = engine.generate(prompts, n=2, max_new_tokens=8, keys=keys)
    alone = engine.generate(prompts[1:2], n=2, max_new_tokens=8, keys=keys[1:2])
    assert together.response_ids[2:4, : alone.response_ids.shape[1]].tolist() == alone.response_ids.tolist()


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
