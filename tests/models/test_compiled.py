"""``use_torch_compile``: the decoder layers compiled for the log-prob pass and the update only.

A compiled layer runs the same maths with its float operations fused and reordered, so its log-probs
and gradients agree with the eager ones within float rounding (the float64 model's bounds of
test_packing); calls with a KV cache and calls outside the pass run the eager forward itself.
"""

from __future__ import annotations

import pytest
import torch

from tearless.models import compiled
from tearless.models.compiled import compile_layers, compiled_for
from tearless.models.logprobs import response_logprobs
from tests.models.test_models import float64_model_tols
from tests.models.test_packing import batch, tiny


def spy_compile(mp: pytest.MonkeyPatch) -> list[bool]:
    """``torch.compile`` spied on through ``mp``: each call of a compiled forward appends whether
    gradients were enabled."""
    calls: list[bool] = []
    real = torch.compile

    def spy(fn, **kw):
        inner = real(fn, **kw)

        def counted(*args, **kwargs):
            calls.append(torch.is_grad_enabled())
            return inner(*args, **kwargs)

        return counted

    mp.setattr(compiled.torch, "compile", spy)
    return calls


@pytest.fixture
def spied(monkeypatch):
    return spy_compile(monkeypatch)


def run(model, share_prompts, remove_padding):
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61)
    weight = torch.randn(response_ids.shape, generator=torch.Generator().manual_seed(4))
    lp, _ = response_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=0.7,
        share_prompts=share_prompts, remove_padding=remove_padding,
    )  # fmt: skip
    grads = torch.autograd.grad((lp * weight * response_mask).sum(), list(model.parameters()))
    return lp.detach(), grads, response_mask.bool()


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_compiled_layers_give_the_eager_log_probs_and_gradients(spied, remove_padding):
    eager_model, model = tiny("sdpa"), tiny("sdpa")
    compile_layers(model)
    eager, eager_grads, mask = run(eager_model, False, remove_padding)
    got, grads, _ = run(model, False, remove_padding)
    # Every layer ran compiled, in this pass and only in it.
    assert len(spied) == model.config.num_hidden_layers
    lp_atol, grad_rtol = float64_model_tols(model.config, temperature=0.7, n_tokens=int(mask.sum()))
    torch.testing.assert_close(got[mask], eager[mask], atol=lp_atol, rtol=0)
    assert got[~mask].eq(0).all()
    for a, b in zip(eager_grads, grads, strict=True):
        torch.testing.assert_close(b, a, atol=grad_rtol * float(a.abs().max()), rtol=0)
    assert sum(float(g.abs().sum()) for g in grads) > 0


def test_calls_with_a_kv_cache_and_calls_outside_the_pass_run_eager(spied):
    eager_model, model = tiny("sdpa"), tiny("sdpa")
    compile_layers(model)
    layers = model.model.layers
    # The shared-prompt pass forwards the prompts into a cache and the responses against it: every
    # call carries the cache, so the eager forward runs and the numbers are the eager model's, bit for bit.
    eager, _, _ = run(eager_model, True, False)
    got, _, _ = run(model, True, False)
    assert spied == [] and torch.equal(got, eager)
    # Outside the pass (the decode loop, a user's own forward) the layers hold their class's forward.
    assert all("forward" not in layer.__dict__ for layer in layers)
    with compiled_for(model), compiled_for(model):  # nested passes keep the swap until the outer ends
        assert all("forward" in layer.__dict__ for layer in layers)
    assert all("forward" not in layer.__dict__ for layer in layers)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, eager_model(ids).logits)
    assert spied == []
