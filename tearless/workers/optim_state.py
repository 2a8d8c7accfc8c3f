"""Optimizer state in one format for every placement and world size: safetensors shards and a JSON index.

``optim/<role>/`` of a checkpoint holds, for each rank r of the W that saved it, ``rank{r}.safetensors``
with that rank's slice of every per-parameter state tensor (AdamW's ``exp_avg`` and ``exp_avg_sq``)
under ``<parameter name>/<state key>``, and ``index.json`` with each parameter's global shape and
which rows each file holds, the scalar state (AdamW's ``step``) and the optimizer's hyper-parameters
(learning rate, betas, …). A single process saves one shard with everything.

FSDP2 shards a parameter along dim 0 the way ``torch.chunk`` does (rank r holds rows
[r·c, min((r+1)·c, N)) with c = ⌈N/W⌉), so the rows any rank of any world size needs are known
without communication, and loading reads just those rows of the files that hold them
(``safe_open(...).get_slice``). Nothing here is pickled: loading never runs code, unlike
``torch.distributed.checkpoint``'s pickled ``.metadata``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from tearless.distributed.fsdp import local_tensor

INDEX = "index.json"
FORMAT = 1


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows [start, stop) of a dim-0 ``torch.chunk`` shard (empty at the tail when N < W·c)."""
    chunk = math.ceil(rows / world) if rows else 0
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def _layout(p: torch.Tensor) -> tuple[int, int]:
    """(rank, world) of a parameter's dim-0 shard: its mesh coordinates, or (0, 1) when unsharded."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return p.device_mesh.get_local_rank(), p.device_mesh.size()
    return 0, 1


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters an optimizer of ``model`` holds, by name, in ``model.parameters()`` order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def save_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | os.PathLike
) -> None:
    """Write this rank's shard (and, on rank 0 of the parameters' mesh, the index) under ``directory``.

    Every rank of a sharded model calls it; no collective is needed.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    named = trainable(model)
    rank, world = _layout(named[0][1]) if named else (0, 1)
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, Any] = {"format": FORMAT, "world_size": world, "params": {}, "scalars": {}}
    for name, p in named:
        state = optimizer.state.get(p, {})
        entry = {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch."), "keys": []}
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{name}/{key}"] = local_tensor(value).detach().to("cpu").contiguous()
                entry["keys"].append(key)
            else:
                index["scalars"].setdefault(name, {})[key] = float(value)
        index["params"][name] = entry
    save_file(tensors, str(directory / f"rank{rank}.safetensors"))
    if rank == 0:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        index["param_groups"] = json.loads(json.dumps(groups, default=float))
        (directory / INDEX).write_text(json.dumps(index, indent=1))


def load_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | os.PathLike
) -> None:
    """Restore the optimizer of ``model`` (any placement, any world size) from ``directory``."""
    from safetensors import safe_open

    directory = Path(directory)
    if not (directory / INDEX).is_file():
        raise FileNotFoundError(
            f"{directory}: no {INDEX}; this checkpoint has no optimizer state in tearless's format (it was "
            "written by an older tearless, or is incomplete). Start a new run from its actor/ weights "
            "with actor_rollout_ref.model.path and trainer.resume_mode=disable"
        )
    index = json.loads((directory / INDEX).read_text())
    saved_world = int(index["world_size"])
    named = trainable(model)
    missing = sorted({n for n, _ in named} - set(index["params"]))
    if missing:
        raise ValueError(
            f"{directory}: no optimizer state for {len(missing)} trained parameters ({missing[0]}, …): the "
            "checkpoint belongs to another model or LoRA setting; resume with the model it was saved from"
        )
    files = {r: safe_open(str(directory / f"rank{r}.safetensors"), "pt") for r in range(saved_world)}
    params = [p for _, p in named]
    state: dict[int, dict[str, Any]] = {}
    for i, (name, p) in enumerate(named):
        entry = index["params"][name]
        if list(p.shape) != entry["shape"]:
            raise ValueError(
                f"{directory}: {name} has shape {entry['shape']} in the checkpoint, {list(p.shape)} here"
            )
        rank, world = _layout(p)
        start, stop = shard_rows(p.shape[0] if p.dim() else 1, rank, world)
        values: dict[str, Any] = dict(index["scalars"].get(name, {}))
        for key in entry["keys"]:
            values[key] = _to_like(
                p, _read_rows(files, f"{name}/{key}", entry["shape"], saved_world, start, stop)
            )
        if "step" in values:
            values["step"] = torch.tensor(values["step"], dtype=torch.float32)
        state[i] = values
    groups = index["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"{directory}: {len(groups)} optimizer parameter groups saved, {len(optimizer.param_groups)} here"
        )
    current = optimizer.state_dict()
    new_groups = []
    for saved, group in zip(groups, current["param_groups"], strict=True):
        saved = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
        new_groups.append({**group, **saved, "params": group["params"]})
    order = [i for g in current["param_groups"] for i in g["params"]]
    if order != list(range(len(params))):
        raise ValueError("the optimizer's parameters are not model.parameters() in order")
    optimizer.load_state_dict({"state": state, "param_groups": new_groups})


def _read_rows(
    files: dict, name: str, shape: list[int], saved_world: int, start: int, stop: int
) -> torch.Tensor:
    """Rows [start, stop) of the saved tensor ``name``, assembled from the shards that hold them."""
    rows = shape[0] if shape else 1
    pieces = []
    for r in range(saved_world):
        a, b = shard_rows(rows, r, saved_world)
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            pieces.append(files[r].get_slice(name)[lo - a : hi - a])
    if not pieces:
        return torch.empty((0, *shape[1:]))
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def _to_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` rows as a state tensor of parameter ``p``: a DTensor with ``p``'s sharding, or plain."""
    from torch.distributed.tensor import DTensor

    local = local.to(device=local_tensor(p).device)
    if isinstance(p, DTensor):
        return DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
    return local
