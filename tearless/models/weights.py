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

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from tearless.distributed.fsdp import full_tensor, local_tensor
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


def _gathered(state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of a state dict, each storage gathered once: tied weights (an LM head
    sharing the embedding) come back as the same tensor, as ``save_pretrained`` expects of them."""
    seen: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    for name, value in state.items():
        key = (local_tensor(value).untyped_storage().data_ptr(), tuple(value.shape))
        if key not in seen:
            seen[key] = full_tensor(value).detach()
        yield name, seen[key]


@torch.no_grad()
def hf_weights(
    model: torch.nn.Module, dtype: torch.dtype | None = None, *, merged: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of every entry of the plain model's state dict, optionally cast: a LoRA model's
    base weights W plus (α/r)·B A (``merged``), or its frozen base W alone (an engine that serves the
    adapter itself)."""
    if not is_lora(model):
        for name, t in _gathered(model.state_dict()):
            yield name, t if dtype is None else t.to(dtype)
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
    for key, t in _gathered(state):
        owner, _, leaf = key.rpartition(".base_layer.")
        if merged and leaf == "weight" and owner in layers:
            t = t + _lora_delta(layers[owner]).to(t.dtype)
        yield key.replace(".base_layer.", "."), t if dtype is None else t.to(dtype)


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
    state, on_cpu = {}, {}
    for name, t in hf_weights(model):
        if write:  # one CPU copy per tensor, so tied weights stay one storage
            state[name] = on_cpu.setdefault(id(t), t.cpu())
    if write:
        plain = model.get_base_model() if is_lora(model) else model
        with quiet_transformers():
            plain.save_pretrained(directory, state_dict=state)
