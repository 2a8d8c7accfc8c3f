r"""A model's weights as a plain Hugging Face model has them, from any placement: for checkpoints, for a
vLLM engine and for rollout workers.

:func:`hf_weights` walks the model's state one tensor at a time, gathering FSDP2 shards
(``full_tensor``, an all-gather: every rank of the mesh walks in the same order) and merging LoRA
adapters, :math:`W + \frac{\alpha}{r} B A`, without touching the live weights (merging in place and
back would leave rounding drift in :math:`W`). Names are those of the plain model
(``model.layers.0.self_attn.q_proj.weight``), which ``from_pretrained`` and vLLM's ``load_weights``
take. :func:`save_model` writes a ``save_pretrained`` directory from them (rank 0 writes, the other
ranks only join the gathers); a LoRA actor's directory holds its adapter, as peft writes it.
"""

from __future__ import annotations

import copy
import os
import weakref
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tearless.distributed.fsdp import full_tensor, local_tensor
from tearless.models.copies import holds_frozen
from tearless.models.loading import quiet_transformers
from tearless.models.lora import is_lora


def _lora_delta(module: torch.nn.Module) -> torch.Tensor:
    r""":math:`\Delta W = \sum_a s_a B_a A_a` of a peft LoRA linear layer (its active adapters)."""
    delta = 0
    for name in module.active_adapters:
        a = full_tensor(module.lora_A[name].weight)
        b = full_tensor(module.lora_B[name].weight)
        d = (b @ a) * module.scaling[name]
        delta = delta + (d.T if getattr(module, "fan_in_fan_out", False) else d)
    return delta


def _storage_key(value: torch.Tensor) -> tuple:
    """What makes two state entries one tensor (tied): the same storage, offset, shape and strides
    (of the local shard, for FSDP2's DTensors; the full shape). The storage by its identity, not its
    address: an empty local shard (a parameter with fewer rows than ranks) has address 0 whatever
    tensor it is, so two of one shape would look tied on that rank alone, which would then skip a
    gather the other ranks wait in; a tie is one storage on every rank."""
    local = local_tensor(value)
    storage = StorageWeakRef(local.untyped_storage())
    return (storage, local.storage_offset(), local.stride(), tuple(value.shape))


def _gathered(
    state: dict[str, torch.Tensor], dtype: torch.dtype | None = None, uncast: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of a state dict, each storage gathered (and cast to ``dtype``, but for the
    names in ``uncast``) once: tied weights (an LM head sharing the embedding) come back as the same
    tensor, as ``save_pretrained`` expects of them. Only a tied storage's tensor is kept for its next
    name; the others are the caller's to free."""
    keys = {n: _storage_key(v) for n, v in state.items()}
    tied = {k for k, count in Counter(keys.values()).items() if count > 1}
    seen: dict[tuple, torch.Tensor] = {}
    for name, value in state.items():
        key = keys[name]
        if key in seen:
            yield name, seen[key]
            continue
        t = full_tensor(value).detach()
        t = t if dtype is None or name in uncast else t.to(dtype)
        if key in tied:
            seen[key] = t
        yield name, t


@torch.no_grad()
def hf_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None, *, merged: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every entry of the plain model's state dict, optionally cast: a LoRA model's
    base weights W plus (α/r)·B A (``merged``), or its frozen base W alone (an engine that serves the
    adapter itself)."""
    if not is_lora(model):
        yield from _gathered(model.state_dict(), dtype)
        return
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    # A module peft trains whole (a reward model's head: modules_to_save) holds its frozen original
    # and its trained copy; the plain model's weight is the trained copy.
    trained = f".modules_to_save.{model.active_adapter}."
    state = {
        k.replace(trained, "."): v
        for k, v in base.state_dict().items()
        if ".lora_" not in k
        and ".original_module." not in k
        and (".modules_to_save." not in k or trained in k)
    }
    suffix = ".base_layer.weight"
    merges = frozenset(k for k in state if merged and k.endswith(suffix) and k[: -len(suffix)] in layers)
    for key, t in _gathered(state, dtype, merges):
        if key in merges:  # W + (α/r)·B A, in the adapters' float32 when W is held in bf16
            delta = _lora_delta(layers[key[: -len(suffix)]])
            t = t.to(torch.promote_types(t.dtype, delta.dtype)) + delta
            t = t if dtype is None else t.to(dtype)
        yield key.replace(".base_layer.", "."), t


@torch.no_grad()
def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full trained parameters by their names in ``model`` (a LoRA model's adapters only)."""
    return {n: full_tensor(p).detach() for n, p in model.named_parameters() if p.requires_grad}


def save_model(
    model: torch.nn.Module, directory: str | os.PathLike, *, write: bool, merged: bool = False
) -> None:
    """Write ``model`` as a ``save_pretrained`` directory: its adapter (LoRA, unless ``merged``) or the
    whole plain model. Every rank of a sharded model calls it; only ranks with ``write`` write."""
    directory = Path(directory)
    if is_lora(model) and not merged:
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        adapter = get_peft_model_state_dict(model, state_dict=trainable_weights(model))
        if write:
            directory.mkdir(parents=True, exist_ok=True)
            tensors = {k: v.contiguous().cpu() for k, v in adapter.items()}
            save_file(tensors, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
            model.peft_config[model.active_adapter].save_pretrained(str(directory))
        return
    state: dict[str, torch.Tensor] = {}
    on_cpu: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
    # A LoRA base held in bf16 (compute copies) is saved merged in float32, as a float32 base is.
    dtype = torch.float32 if holds_frozen(model) else None
    for name, t in hf_weights(model, dtype):
        if write:  # one CPU copy per tensor, so tied weights stay one storage
            # hf_weights frees an untied tensor once it is yielded (a later one may take its id), so
            # a copy is reused only for the tensor it was made from, which a tied name gets again
            held = on_cpu.get(id(t))
            if held is None or held[0]() is not t:
                held = on_cpu[id(t)] = (weakref.ref(t), t.cpu())
            state[name] = held[1]
    if write:
        plain = model.get_base_model() if is_lora(model) else model
        with quiet_transformers():
            plain.save_pretrained(directory, state_dict=state)
            if dtype is not None:  # save_pretrained wrote model.dtype (the held base's) as the config's
                config = copy.deepcopy(plain.config)
                config.dtype = str(dtype).removeprefix("torch.")
                config.save_pretrained(directory)
