"""FSDP2 for tearless's models: sharding, gradient clipping, state gathering and DCP checkpoints.

``shard_model`` applies ``torch.distributed.fsdp.fully_shard`` to each transformer block and then to
the root, as the FSDP2 docs recommend: a block's parameters are all-gathered just before its forward
and freed after it, so peak memory holds one full block rather than the whole model. Gradients are
reduce-scattered and averaged over the ranks; a rank's loss normalised by *global* token or
sequence counts must therefore be multiplied by the world size (see ``tearless.distributed.worker``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face model: the longest ``nn.ModuleList`` it holds.

    Llama, Qwen2, Mistral, GPT-NeoX (``layers``), GPT-2 (``h``) and their token-classification twins
    all keep their blocks in one ModuleList; a model without any raises, naming its class.
    """
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of transformer blocks for FSDP2 to shard; "
            "use a decoder model with its layers in a ModuleList (Llama, Qwen2, Mistral, GPT-2, …)"
        )
    return list(max(lists, key=len))


def shard_model(
    model: torch.nn.Module,
    mesh,
    *,
    param_offload: bool = False,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """Apply ``fully_shard`` to every transformer block, then to the root; return the same module.

    ``param_offload`` keeps the sharded parameters (and therefore the optimizer's state and step) in
    CPU memory (``CPUOffloadPolicy``). ``param_dtype`` (e.g. ``torch.bfloat16`` on GPU) runs forward
    and backward in that dtype while the sharded master parameters and the gradient reduction stay
    in float32 (``MixedPrecisionPolicy``).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": reshard_after_forward,
        "offload_policy": CPUOffloadPolicy() if param_offload else OffloadPolicy(),
    }
    if param_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in decoder_layers(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm ``max_norm``; return the norm before clipping.

    With sharded (DTensor) gradients each rank holds a slice; ``get_total_norm`` returns a partial
    DTensor whose ``full_tensor()`` reduces the squared sums over the ranks, so every rank clips by
    the same global norm, exactly as ``clip_grad_norm_`` does on an unsharded model.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move every tensor of the optimizer's state (Adam moments, step) to ``device``.

    With ``fsdp_config.optimizer_offload`` the state lives in CPU memory between updates and visits
    the accelerator only for the optimizer step; on a CPU run both devices are the CPU and nothing
    moves.
    """
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != torch.device(device):
                state[key] = value.to(device, non_blocking=True)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters and buffers on CPU, on rank 0 (an empty dict on the other ranks).

    A collective: every rank of the group must call it.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Write the sharded optimizer state with ``torch.distributed.checkpoint`` (each rank its shard).

    DCP stores every tensor with its global shape and each shard's offsets, so :func:`load_optimizer`
    can read it back on a different number of ranks. A collective.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path))


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Read an optimizer state written by :func:`save_optimizer`, resharded to this group's ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if not (Path(path) / ".metadata").is_file():
        raise FileNotFoundError(
            f"{path}: no torch.distributed.checkpoint metadata; this checkpoint was not written by a "
            "trainer.placement=ray run (resume it with the placement that wrote it)"
        )
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
