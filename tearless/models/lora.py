r"""LoRA through ``peft``: adapters on the actor, the reference as the same weights with them off.

A LoRA layer computes :math:`y = W x + \frac{\alpha}{r} B A x` with the base weight :math:`W` frozen
and only :math:`A` (r × in) and :math:`B` (out × r, initialised to zero) trained. The reference policy
of the KL term is :math:`\pi_{W}`, i.e. the actor with the adapters disabled, so no second copy of the
model is held; the optimizer holds moments for the adapters only.

Checkpoints write the adapter (``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
``peft.PeftModel.from_pretrained`` on the base model) and, on request, the merged model
:math:`W + \frac{\alpha}{r} B A` as a plain ``save_pretrained`` directory
(:mod:`tearless.models.weights`, which also feeds merged weights to a separate rollout engine).
"""

from __future__ import annotations

import os
import warnings
from collections import defaultdict
from typing import Any

import torch

from tearless.models.vision import language_lora_targets


def _peft(key: str):
    try:
        import peft
    except ImportError as err:
        # peft itself, or a package peft imports (accelerate): name the one missing
        dependency = err.name if err.name and err.name.split(".")[0] != "peft" else None
        what = f"the peft package, which could not import {dependency}" if dependency else "the peft package"
        raise ImportError(
            f"{key} > 0 needs {what}: pip install 'tearless[lora]' (or pip install peft"
            f"{' ' + dependency if dependency else ''}), or set it to 0 for full fine-tuning"
        ) from None
    return peft


def target_modules_arg(target_modules: Any) -> str | list[str]:
    """``all-linear`` (every linear layer but the output head, peft's meaning) or a list of module names.

    A comma-separated string (``q_proj,v_proj``, as given on a command line) becomes a list.
    """
    if isinstance(target_modules, str):
        if target_modules == "all-linear":
            return target_modules
        return [m.strip() for m in target_modules.split(",") if m.strip()]
    return [str(m) for m in target_modules]


def add_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: Any,
    gradient_checkpointing: bool = False,
    task_type: str = "CAUSAL_LM",
    key: str = "actor_rollout_ref.model",
    language_only: bool = False,
) -> torch.nn.Module:
    """Wrap ``model`` in a peft LoRA model (rank ``rank``, scale ``alpha / rank``, no dropout).

    Every base parameter is frozen; only the adapters require gradients. ``task_type`` ``SEQ_CLS`` (a
    reward model) also trains the new scalar head whole (peft's ``modules_to_save``) and saves it with
    the adapter. ``key`` is the config section named in errors. ``language_only`` (a vision-language
    model) puts the adapters on the language model's layers of those names only
    (:func:`tearless.models.vision.language_lora_targets`).
    """
    peft = _peft(f"{key}.lora_rank")
    targets = target_modules_arg(target_modules)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=language_lora_targets(targets) if language_only else targets,
        lora_dropout=0.0,
        bias="none",
        task_type=task_type,
    )
    try:
        with warnings.catch_warnings():
            # peft's warning on a tied target (by config name); _refuse_tied refuses it (by storage)
            warnings.filterwarnings("ignore", message=r"Model has `tie_word_embeddings=True`")
            wrapped = peft.get_peft_model(model, config)
    except ValueError as err:
        raise ValueError(
            f"{key}.target_modules={target_modules!r}: {err} Use all-linear or names "
            "of the model's linear layers (for Llama/Qwen: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
            "down_proj)"
        ) from None
    _refuse_tied(wrapped, f"{key}.target_modules={target_modules!r}", "target_modules")
    if gradient_checkpointing:
        # With frozen embeddings nothing entering a checkpointed block requires grad, and the
        # recomputed blocks would get no gradient at all.
        wrapped.enable_input_require_grads()
    return wrapped


def load_lora(
    base: torch.nn.Module,
    adapter_dir: str | os.PathLike,
    *,
    gradient_checkpointing: bool = False,
    key: str = "actor_rollout_ref.model",
):
    """The base model with a saved adapter loaded, trainable (to resume a LoRA run)."""
    peft = _peft(f"{key}.lora_rank")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Model has `tie_word_embeddings=True`")  # as add_lora
        model = peft.PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    _refuse_tied(model, f"the LoRA adapter in {adapter_dir}", "the target_modules of a new adapter")
    if gradient_checkpointing:
        model.enable_input_require_grads()
    return model


def tied_lora_layers(model: torch.nn.Module) -> dict[str, list[str]]:
    """Each LoRA layer of a peft ``model`` whose base weight is one tensor with other parameters or
    buffers of the model (a tied LM head and embedding), with those others' names, in the plain model.

    Ties are found by storage, not by the config's ``tie_word_embeddings`` or by names, so any
    architecture and an embedding target are covered; storage identity rather than its address, as
    every tensor of a meta-device skeleton has address 0.
    """
    from peft.tuners.lora import LoraLayer
    from torch.multiprocessing.reductions import StorageWeakRef

    plain = model.get_base_model()
    holders: dict[StorageWeakRef, list[str]] = defaultdict(list)
    tensors = [*plain.named_parameters(remove_duplicate=False), *plain.named_buffers(remove_duplicate=False)]
    for name, t in tensors:
        holders[StorageWeakRef(t.untyped_storage())].append(name.replace(".base_layer.", "."))
    tied = {}
    for name, layer in plain.named_modules():
        if isinstance(layer, LoraLayer):
            storage = StorageWeakRef(layer.get_base_layer().weight.untyped_storage())
            others = [n for n in holders[storage] if not n.startswith(f"{name}.")]
            if others:
                tied[name] = others
    return tied


def _refuse_tied(model: torch.nn.Module, where: str, targets: str) -> None:
    r"""Raise ``ValueError`` (one line: ``where``, the tied layers, the fix: drop them from ``targets``
    or untie) if a LoRA layer's base weight is tied to another (:func:`tied_lora_layers`).

    The adapter would train :math:`W + \Delta W` in that layer while the other keeps :math:`W`; a merged
    save (:math:`W + \Delta W` and :math:`W` under a config that says they are one tensor) and an engine
    that loads one tensor for both would silently hold another policy than the trained one.
    """
    tied = tied_lora_layers(model)
    if not tied:
        return
    layers = ", ".join(tied)
    what = "; ".join(f"{layer}'s weight is tied to {', '.join(others)}" for layer, others in tied.items())
    raise ValueError(
        f"{where}: {what} (one tensor). LoRA there would train {layers} apart from the weight it is tied "
        "to, which a merged save or a rollout engine (one tensor for both) cannot hold: they would serve "
        f"another policy than the trained one. Drop {layers} from {targets}, or untie the weights first "
        "(a copy of the model saved with tie_word_embeddings=false, each weight its own)"
    )


def is_lora(model: torch.nn.Module) -> bool:
    try:
        import peft
    except ImportError:
        return False
    return isinstance(model, peft.PeftModel)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    total = sum(p.numel() for p in model.parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad), total
