"""Compute copies (``fsdp_config.compute_copies``): bf16 weights swapped in for the passes, float32
masters everywhere else, gradients summed in float32, one cast per optimizer step."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tearless.models.copies import attach, copies_for, hold_in, refresh_after
from tearless.models.logprobs import response_logprobs
from tests.models.test_packing import batch
from tests.models.test_packing import tiny as tiny_float64


def tiny():
    """test_packing's tiny Llama (grouped-query attention, tied embeddings) in float32."""
    return tiny_float64("sdpa").float()


def loss_of(model, seed):
    prompt_ids, prompt_mask, response_ids, response_mask = batch(61, seed=seed)
    lp, _ = response_logprobs(
        model, prompt_ids, prompt_mask, response_ids, response_mask, share_prompts=False
    )
    return (lp * response_mask).sum()


class WeightCasts(TorchDispatchMode):
    """Counts casts whose input is one of ``tensors`` (by storage)."""

    def __init__(self, tensors):
        super().__init__()
        self.ptrs = {t.data_ptr() for t in tensors}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_passes_compute_from_bf16_copies_and_the_masters_stay_the_modules_parameters():
    model = tiny()
    masters = list(model.parameters())
    attach(model, torch.bfloat16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with copies_for(model), copies_for(model):  # nested regions keep the swap until the outer ends
        inside = list(model.parameters())
        assert all(p.dtype == torch.bfloat16 for p in inside)
        # The tied LM head and embedding share one copy, as they share one master.
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert all(torch.equal(c, m.to(torch.bfloat16)) for c, m in zip(inside, masters, strict=True))
    assert [id(p) for p in model.parameters()] == [id(p) for p in masters]


def test_gradients_sum_into_the_float32_masters_exactly_and_a_step_refreshes_the_copies():
    model, reference = tiny(), hold_in(tiny(), torch.bfloat16)  # the same weights held in bf16
    attach(model, torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    refresh_after(optimizer, model)
    with copies_for(model):
        for seed in (3, 5):  # two micro-batches
            loss_of(model, seed).backward()
            assert all(c.grad is None for c in model.tearless_copies.copies)  # folded at once
    # Each master's gradient is the two micro-batches' bf16 gradients summed in float32, bit for bit.
    grads = []
    for seed in (3, 5):
        loss_of(reference, seed).backward()
        grads.append([p.grad.float() for p in reference.parameters()])
        for p in reference.parameters():
            p.grad = None
    for p, a, b in zip(model.parameters(), *grads, strict=True):
        assert torch.equal(p.grad, a + b), p.shape
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    for p, old in zip(model.parameters(), before, strict=True):
        assert p.dtype == torch.float32 and torch.equal(p, old - 0.5 * p.grad)
    with copies_for(model):
        copies = list(model.parameters())
    assert all(torch.equal(c, m.to(torch.bfloat16)) for c, m in zip(copies, model.parameters(), strict=True))


def test_a_pass_casts_no_weight_where_autocast_casts_every_one():
    from tearless.models.precision import set_compute_dtype

    autocast_model = set_compute_dtype(tiny(), torch.bfloat16)
    with WeightCasts(list(autocast_model.parameters())) as casts:
        loss_of(autocast_model, 3).backward()
    assert casts.count >= 2 * 7  # every linear layer of both blocks (q, k, v, o, gate, up, down)
    model = tiny()
    attach(model, torch.bfloat16)
    with copies_for(model):
        with WeightCasts(list(model.parameters()) + list(model.tearless_copies.masters)) as casts:
            loss_of(model, 3).backward()
    assert casts.count == 0


def test_a_lora_model_trains_float32_adapter_masters_from_bf16_copies():
    from tearless.models.lora import add_lora

    model = add_lora(tiny(), rank=4, alpha=8, target_modules="all-linear")
    attach(model, torch.bfloat16)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # outside the passes: the masters
    with copies_for(model):
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        loss_of(model, 3).backward()
        with model.disable_adapter():  # the LoRA reference: the base alone
            reference = loss_of(model, 3).detach()
    assert all((p.grad is not None) == (n in trained) for n, p in model.named_parameters())
    assert all(p.grad.dtype == torch.float32 for n, p in model.named_parameters() if n in trained)
    # The adapters' B starts at zero, so the policy equals the reference before any step.
    with copies_for(model):
        assert torch.equal(loss_of(model, 3).detach(), reference)
