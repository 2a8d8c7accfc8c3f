"""Compute copies (``fsdp_config.compute_copies``): bf16 weights swapped in for the passes, float32
masters everywhere else, gradients summed in float32, one cast per optimizer step."""

from __future__ import annotations

import json

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


def lora_pair():
    """The same LoRA model (B drawn, so the adapters change the output) with copies twice: its frozen
    base with float32 masters beside the copies, and held in bf16 (``hold_frozen``)."""
    from tearless.models.lora import add_lora

    models = []
    for hold in (False, True):
        torch.manual_seed(0)
        model = add_lora(tiny(), rank=4, alpha=8, target_modules="all-linear")
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.1)
        attach(model, torch.bfloat16, hold_frozen=hold)
        models.append(model)
    return models


def held_bytes(model):
    """The bytes of ``model``'s parameters and of its copies (each storage once)."""
    copies = {id(c): c for *_, c in model.tearless_copies.slots}
    return sum(p.numel() * p.element_size() for p in [*model.parameters(), *copies.values()])


def test_a_lora_base_held_in_bf16_computes_bit_for_bit_what_its_copies_do_in_a_third_of_the_bytes():
    both, held = lora_pair()
    frozen = [p for p in held.parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(p.dtype == torch.float32 for p in held.parameters() if p.requires_grad)
    # Bytes: base 4 + 2 (master and copy) -> 2; the adapters 4 + 2 either way.
    base = sum(p.numel() for p in frozen)
    adapters = sum(p.numel() for p in held.parameters() if p.requires_grad)
    assert held_bytes(both) == 6 * (base + adapters) and held_bytes(held) == 2 * base + 6 * adapters
    for model in (both, held):
        with copies_for(model):
            model.loss = loss_of(model, 3)
            model.loss.backward()
            with model.disable_adapter():
                model.reference = loss_of(model, 3).detach()
    assert torch.equal(both.loss, held.loss) and torch.equal(both.reference, held.reference)
    assert not torch.equal(held.loss, held.reference)  # the drawn adapters matter
    for a, b in zip(both.parameters(), held.parameters(), strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


def test_a_held_base_merges_in_float32_and_exports_float32_with_its_tie_and_the_guard_forwards_it(tmp_path):
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file

    from tearless.models.weights import _lora_delta, hf_weights, save_model
    from tearless.run.guards import logits_finite

    both, held = lora_pair()
    base = held.get_base_model()
    for dtype in (torch.bfloat16, torch.float32, None):
        a, b = dict(hf_weights(both, dtype)), dict(hf_weights(held, dtype))
        assert a.keys() == b.keys()
        merges = 0
        for k, t in b.items():
            module = base.get_submodule(k.rpartition(".")[0])
            if isinstance(module, LoraLayer) and k.endswith(".weight"):
                # W held in bf16, plus the float32 (α/r)·B A, cast once to the engine's dtype (float32
                # when none is asked: the adapters' dtype).
                exact = module.base_layer.weight.float() + _lora_delta(module)
                assert torch.equal(t, exact if dtype is None else exact.to(dtype)), k
                merges += 1
            else:  # the rest of the base: W's bf16 rounding
                assert torch.equal(t, a[k].to(torch.bfloat16).to(dtype or torch.bfloat16)), k
        assert merges == 2 * 7  # every linear layer of both blocks
    save_model(held, tmp_path / "merged", write=True, merged=True)
    saved = load_file(tmp_path / "merged" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert "lm_head.weight" not in saved  # still tied to the embedding
    # and its config says so: transformers loads a model in its config's dtype by default
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == "float32"
    # The bad-step guard forwards through the copies: what the engine samples from.
    seen = []
    lora_a = base.model.layers[0].mlp.up_proj.lora_A["default"]
    hook = lora_a.register_forward_hook(lambda m, *_: seen.append(m.weight.dtype))
    assert logits_finite(held, torch.tensor([[1, 2, 3]])) and seen == [torch.bfloat16]
    hook.remove()


def test_a_save_from_an_accelerator_writes_each_name_its_own_weights(tmp_path, monkeypatch):
    """hf_weights frees an untied tensor once it is yielded, so a later one may take its id; the CPU
    copies save_model makes (here in tensor objects made beforehand, as no CPU ``.cpu()`` does) must
    not be reused by id alone, or ten weights of the tiny model were written as one."""
    from safetensors.torch import load_file

    from tearless.models.weights import hf_weights, save_model

    pool = [torch.empty(0) for _ in range(100)]

    def copied(self, *args, **kwargs):
        out = pool.pop()
        out.data = self.clone()
        return out

    _, held = lora_pair()
    for model, merged in ((tiny(), False), (held, True)):
        expected = {k: v.clone() for k, v in hf_weights(model, torch.float32)}
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "cpu", copied)
            save_model(model, tmp_path / str(merged), write=True, merged=merged)
        saved = load_file(tmp_path / str(merged) / "model.safetensors")
        assert saved.keys() == expected.keys() - {"lm_head.weight"}  # still tied to the embedding
        assert all(torch.equal(t, expected[k]) for k, t in saved.items())


def test_tearless_evals_frozen_actor_is_held_in_bf16_only_when_its_engine_samples_in_bf16(monkeypatch):
    """``tearless eval`` builds the actor frozen for the built-in engine alone; the trainer's actor with
    copies samples from its float32 masters when rollout.dtype=float32, so eval's must stay float32
    (it was held in bf16, and its numbers were no longer ``trainer.val_only``'s)."""
    from tearless.config import load_config
    from tearless.models import precision
    from tearless.workers.build import ModelBuilder
    from tearless.workers.spec import RankSpec

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    arr = "actor_rollout_ref"
    keys = [f"{arr}.actor.fsdp_config.param_dtype=bfloat16", f"{arr}.actor.fsdp_config.compute_copies=true"]
    for rollout, held in (("float32", torch.float32), ("bfloat16", torch.bfloat16), (None, torch.bfloat16)):
        extra = [] if rollout is None else [f"{arr}.rollout.dtype={rollout}"]
        cfg = load_config(None, [*keys, *extra], notify=lambda _: None)
        spec = RankSpec(cfg, roles=(), rollout=True, model_path="unused", total_steps=0, device="cpu")
        model = tiny().requires_grad_(False)
        ModelBuilder(spec, 0, 1, None, torch.device("cpu")).reduce(model, "actor")
        assert {p.dtype for p in model.parameters()} == {held}, rollout
        assert getattr(model, "tearless_compute_dtype", None) is None  # no autocast: as the trainer's


def test_only_tied_entries_share_a_cast_and_views_of_one_storage_are_not_tied():
    from tearless.models.weights import _gathered

    w, rows = torch.randn(4, 3), torch.randn(4, 3)
    state = {"embed": w, "head": w, "top": rows[:2], "bottom": rows[2:]}  # same shape, other offsets
    out = dict(_gathered(state, torch.bfloat16))
    assert out["embed"] is out["head"] and out["embed"].dtype == torch.bfloat16
    assert torch.equal(out["top"], rows[:2].to(torch.bfloat16))
    assert torch.equal(out["bottom"], rows[2:].to(torch.bfloat16))


def test_empty_shards_are_tied_by_their_storage_not_its_address():
    # A parameter with fewer rows than ranks has an empty shard on some rank, whose storage address
    # is 0 for every such shard: keyed by address, two of one shape would be "tied" on that rank
    # only, and it would skip a gather the other ranks wait in. Plain empty tensors stand for them;
    # a state dict's entries for one tied parameter are views of one storage (detach()).
    from tearless.models.weights import _gathered, _storage_key

    a, b = torch.empty(0, 3), torch.empty(0, 3)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    assert _storage_key(a) != _storage_key(b) and _storage_key(a) == _storage_key(a.detach())
    out = list(_gathered({"a": a, "b": b, "a_again": a.detach()}))
    assert [name for name, _ in out] == ["a", "b", "a_again"]
    assert out[2][1] is out[0][1] and out[1][1] is not out[0][1]  # one storage stays one tensor
