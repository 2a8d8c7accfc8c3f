"""The update schedule, written once for every placement: plan the optimizer steps of an RL step, then
run one rank's share of them.

veRL's update: ``ppo_epochs`` passes over the step's rows, each shuffled (or not) and cut into
mini-batches of ``rows_per_mini`` rows, one optimizer step per mini-batch. A mini-batch's losses are
normalised by its *global* token and sequence counts (``norm``), so that any split of it into
micro-batches, and across ranks, sums to exactly the gradient of the whole mini-batch.

:func:`plan_updates` (in the driver, or in-process) draws the permutation and cuts every mini-batch
into one part per rank, token-balanced with a prompt's responses kept together; every rank runs the
same number of forward/backward passes (``num_micro``), because an FSDP rank all-gathers parameters
in each one, and a rank with fewer real micro-batches (or none) runs padding passes whose loss is
multiplied by zero. :func:`run_plan` is one rank's execution: zero-grad → micro-batches (loss × world
size, since FSDP averages the ranks' gradients) → global gradient-norm clip → finite check agreed by
every rank → step, or skip and count. A single process is the world-size-1 case of the same code.
Per-step facts reach the ranks as plain data (:class:`UpdateFlags`), never as closures: a Ray rank is
another process.

On-policy rows whose advantages are all zero contribute exactly nothing to a loss linear in A_t;
``skip_rows`` leaves them out of the passes (their share of the normalisers kept), and
:func:`skipped_rows_metrics` adds their entropy to the metrics (the sampler's own entropy, or one
the group computed before the update).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict

from tearless.algos import agg_loss
from tearless.devices import device_defaults
from tearless.distributed.fsdp import clip_grad_norm


def attention_mask(td: TensorDict) -> torch.Tensor:
    """The responses' attention mask: ``response_attention_mask`` when the batch has one (multi-turn
    rollouts, where tool output is attended to but masked from the loss), else ``response_mask``."""
    return td["response_attention_mask"] if "response_attention_mask" in td.keys() else td["response_mask"]


def row_tokens(td: TensorDict) -> list[int]:
    """Real (unpadded) prompt + response tokens of each row."""
    return (td["prompt_mask"].sum(-1) + attention_mask(td).sum(-1)).tolist()


def micro_batches(
    td: TensorDict, *, size: int | None = None, token_budget: int | None = None
) -> list[TensorDict]:
    """Split ``td`` into consecutive micro-batches of ``size`` rows, or packed under ``token_budget``
    (a row's tokens: its real prompt + response length)."""
    rows = td.batch_size[0]
    if token_budget is None:
        step = size or rows
        return [td[i : i + step] for i in range(0, rows, step)]
    chunks, start, used = [], 0, 0
    for i, length in enumerate(row_tokens(td)):
        if i > start and used + length > token_budget:
            chunks.append(td[start:i])
            start, used = i, 0
        used += length
    chunks.append(td[start:rows])
    return chunks


def count_micro_batches(tokens: Sequence[int], *, size: int | None, token_budget: int | None) -> int:
    """How many micro-batches :func:`micro_batches` makes of rows with these token counts."""
    if not tokens:
        return 0
    if token_budget is None:
        return math.ceil(len(tokens) / (size or len(tokens)))
    count, used = 1, 0
    for i, length in enumerate(tokens):
        if i > 0 and used + length > token_budget:
            count, used = count + 1, 0
        used += length
    return count


def balanced_partition(
    tokens: Sequence[int], groups: Sequence[Hashable] | None, world: int
) -> list[list[int]]:
    """Split row indices into ``world`` parts of nearly equal token sums, each ``groups`` value on one part.

    Greedy longest-processing-time: units (all rows of one group, or single rows without groups) are
    taken largest first and given to the part with the fewest tokens so far (ties: fewest rows, then
    lowest rank); the makespan is at most 4/3 of the optimum. When there are fewer units than parts,
    groups are broken into single rows. Parts list their rows in original order; a part is empty
    only when there are fewer rows than parts.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    rows = len(tokens)
    units: dict[Hashable, list[int]] = {}
    for i in range(rows):
        units.setdefault(groups[i] if groups is not None else i, []).append(i)
    unit_rows = list(units.values())
    if len(unit_rows) < world:
        unit_rows = [[i] for i in range(rows)]
    unit_rows.sort(key=lambda u: (-sum(tokens[i] for i in u), u[0]))
    parts: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for unit in unit_rows:
        r = min(range(world), key=lambda k: (load[k], len(parts[k]), k))
        parts[r].extend(unit)
        load[r] += sum(tokens[i] for i in unit)
    return [sorted(p) for p in parts]


def mini_batch_norm(
    response_mask: torch.Tensor, loss_scale_factor: float | None = None
) -> dict[str, torch.Tensor | float]:
    """The global normalisers of one mini-batch: its loss-mask tokens, its non-empty sequences and
    ``seq-mean-token-sum-norm``'s constant S (the trainer passes
    :func:`tearless.config.derived.loss_scale_factor`; None falls back to the padded width, which
    changes with the step's longest response)."""
    scale = response_mask.shape[1] if loss_scale_factor is None else loss_scale_factor
    return {
        "global_num_tokens": response_mask.sum().clamp(min=1),
        "global_num_seqs": (response_mask.sum(-1) > 0).sum().clamp(min=1),
        "loss_scale_factor": float(scale),
    }


@dataclass
class MiniBatchPlan:
    """One optimizer step: each rank's rows (indices into the step's batch; a rank with nothing to do
    gets one row of the mini-batch as ``padding``), the global normalisers, the number of passes
    every rank runs, and the rows left out as zero-advantage."""

    rows: list[list[int]]
    padding: list[bool]
    norm: dict[str, torch.Tensor | float]
    num_micro: int
    skipped: list[int]
    size: int


@dataclass
class UpdateSettings:
    """What the schedule needs of an actor or critic config section (inherit-from-actor resolved)."""

    rows_per_mini: int
    epochs: int
    shuffle: bool
    micro_size: int | None
    token_budget: int | None
    grad_clip: float
    prefix: str
    loss_scale_factor: float | None = None

    @classmethod
    def of_section(
        cls, section: Any, rollout_n: int, prefix: str, loss_scale_factor: float | None
    ) -> UpdateSettings:
        """The schedule's view of an actor section, or of the critic's resolved one (the plan's
        ``critic_section``): mini-batches of ``ppo_mini_batch_size × rollout_n`` rows, a token budget
        only with ``use_dynamic_bsz``; ``loss_scale_factor`` is seq-mean-token-sum-norm's constant S."""
        return cls(
            rows_per_mini=section.ppo_mini_batch_size * rollout_n,
            epochs=section.ppo_epochs,
            shuffle=section.shuffle,
            micro_size=section.ppo_micro_batch_size_per_gpu,
            token_budget=section.ppo_max_token_len_per_gpu if section.use_dynamic_bsz else None,
            grad_clip=section.grad_clip,
            prefix=prefix,
            loss_scale_factor=loss_scale_factor,
        )


@dataclass(frozen=True)
class UpdateFlags:
    """The facts of one update that its losses read, plain data sent to every rank with its steps:
    ``detached``, the actor's π_old is its own detached π_θ (on-policy, not bypass mode: the ratio is
    exactly 1); the critic's loss reads none."""

    detached: bool = False


def plan_updates(
    td: TensorDict,
    s: UpdateSettings,
    world: int,
    *,
    generator: torch.Generator | None = None,
    skip_rows: torch.Tensor | None = None,
) -> list[MiniBatchPlan]:
    """The optimizer steps of one RL step over ``td``, each cut into ``world`` parts.

    ``skip_rows`` (B,) marks rows to leave out of the passes (normalisers still count them); a
    mini-batch whose rows are all marked keeps its first row, so that the step happens as it would
    without skipping (with a zero gradient).
    """
    rows = td.batch_size[0]
    tokens = row_tokens(td)
    uids = td["uid_index"].tolist() if "uid_index" in td.keys() else None
    plans = []
    for _ in range(s.epochs):
        order = torch.randperm(rows, generator=generator) if s.shuffle else torch.arange(rows)
        for start in range(0, rows, s.rows_per_mini):
            mini = order[start : start + s.rows_per_mini].tolist()
            size = len(mini)
            norm = mini_batch_norm(td["response_mask"][mini], s.loss_scale_factor)
            skipped: list[int] = []
            if skip_rows is not None:
                skipped = [i for i in mini if bool(skip_rows[i])]
                kept = [i for i in mini if not bool(skip_rows[i])] or mini[:1]
                skipped = [i for i in skipped if i not in kept]
                mini = kept
            local = balanced_partition(
                [tokens[i] for i in mini], [uids[i] for i in mini] if uids is not None else None, world
            )
            parts = [[mini[j] for j in part] for part in local]
            padding = [not p for p in parts]
            parts = [p or mini[:1] for p in parts]
            num_micro = max(
                count_micro_batches([tokens[i] for i in p], size=s.micro_size, token_budget=s.token_budget)
                for p, pad in zip(parts, padding, strict=True)
                if not pad
            )
            plans.append(MiniBatchPlan(parts, padding, norm, num_micro, skipped, size))
    return plans


def rank_steps(plans: list[MiniBatchPlan], rank: int) -> tuple[list[int], list[tuple]]:
    """Rank ``rank``'s rows of the step (sorted batch indices) and, per optimizer step, its rows as
    positions in that list, whether they are padding, the normalisers and the pass count."""
    rows = sorted({i for p in plans for i in p.rows[rank]})
    local = {g: j for j, g in enumerate(rows)}
    return rows, [([local[i] for i in p.rows[rank]], p.padding[rank], p.norm, p.num_micro) for p in plans]


def skipped_rows_metrics(
    td: TensorDict,
    plans: list[MiniBatchPlan],
    loss_agg_mode: str,
    entropies: list[torch.Tensor | None],
) -> dict[str, float]:
    """What the zero-advantage rows left out of the passes add to the actor's metrics, averaged over
    optimizer steps as :func:`run_plan` averages: the share of each mini-batch skipped, and the
    skipped rows' part of ``actor/entropy`` (normalised by their mini-batch's global counts).
    ``entropies[j]`` is plan ``j``'s skipped rows' (b, R) entropies, or None when there are none to
    report."""
    share, entropy, known = 0.0, 0.0, True
    for p, values in zip(plans, entropies, strict=True):
        share += len(p.skipped) / p.size
        if p.skipped:
            if values is None:
                known = False
                continue
            idle = td[p.skipped]
            entropy += float(agg_loss(values, idle["response_mask"], loss_agg_mode, **p.norm))
    count = max(1, len(plans))
    metrics = {"actor/zero_adv_rows_skipped": share / count}
    if known and any(p.skipped for p in plans):
        metrics["actor/entropy"] = entropy / count
    return metrics


def rank_work(td: TensorDict, plans: list[MiniBatchPlan], world: int) -> list[tuple[TensorDict, list[tuple]]]:
    """Each rank's rows of the step and its steps (:func:`rank_steps`), what :func:`run_plan` runs."""
    work = []
    for r in range(world):
        rows, steps = rank_steps(plans, r)
        work.append((td[rows], steps))
    return work


def combined_metrics(results: list[tuple[dict, dict]], metrics: dict[str, float]) -> dict[str, float]:
    """The update's metrics from every rank's :func:`run_plan` result: ``metrics`` (the skipped rows'),
    plus the additive ones summed over ranks, then the shared ones from rank 0."""
    out: dict[str, float] = defaultdict(float, metrics)
    for additive, _ in results:
        for k, v in additive.items():
            out[k] += v
    out.update(results[0][1])
    return dict(out)


def pad_micro_batches(chunks: list[TensorDict], count: int) -> list[TensorDict]:
    """``chunks`` followed by one-row padding chunks up to ``count``."""
    return chunks + [chunks[0][:1]] * (count - len(chunks))


def all_ranks_agree(flag: bool, world: int) -> bool:
    """True only if ``flag`` is True on every rank of the default process group (a collective)."""
    if world == 1:
        return flag
    import torch.distributed as dist

    value = torch.tensor([1 if flag else 0])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def run_plan(
    role,
    td: TensorDict,
    steps: list[tuple],
    flags: UpdateFlags,
    *,
    world: int = 1,
) -> tuple[dict[str, float], dict[str, float]]:
    """Run one rank's share (:func:`rank_steps`) of the planned optimizer steps on its rows ``td``.

    ``role`` (an :class:`~tearless.workers.actor.Actor` or :class:`~tearless.workers.critic.Critic`)
    holds ``model``, ``params``, ``optimizer``, ``scheduler``, ``skipped_steps`` and its ``settings``;
    ``role.micro_loss(mb, norm, flags)`` returns a micro-batch's globally normalised loss and metrics.
    A step is skipped (parameters, moments and step count untouched; ``skipped_steps`` + 1) when any
    rank's loss or the global gradient norm is not finite: a NaN loss can come with a finite gradient
    from a term that does not reach the parameters. Where the device frees gradients after an update
    (:attr:`~tearless.devices.DeviceDefaults.free_gradients`: on a GPU) they are freed once the last
    step is done. The scheduler steps once per call. Returns (metrics
    that add up over ranks, averaged over steps; metrics equal on every rank).
    """
    s = role.settings
    role.model.train()
    # Metrics stay on the device, summed in float64 (as Python floats would be, to the same bits), and
    # are read once at the end: a read inside the micro-batch loop would stall a GPU every pass.
    sums: dict[str, torch.Tensor] = {}
    grad_norms: torch.Tensor | None = None
    for rows, padding, norm, num_micro in steps:
        mini = td[rows]
        role.optimizer.zero_grad(set_to_none=True)
        size = None if s.token_budget else s.micro_size
        chunks = micro_batches(mini, size=size, token_budget=s.token_budget)
        real = 0 if padding else len(chunks)
        finite = None
        for i, mb in enumerate(pad_micro_batches(chunks, num_micro)):
            loss, metrics = role.micro_loss(mb, norm, flags)
            if i < real:
                ok = torch.isfinite(loss.detach())
                finite = ok if finite is None else finite & ok
                for k, v in metrics.items():
                    v = torch.as_tensor(v).detach().to(torch.float64)
                    sums[k] = sums[k] + v if k in sums else torch.zeros_like(v) + v
            (loss * (world if i < real else 0.0)).backward()
        grad_norm = clip_grad_norm(role.params, s.grad_clip)
        # One read per optimizer step: the step-or-skip decision.
        if world == 1:
            step = bool(torch.isfinite(grad_norm) if finite is None else finite & torch.isfinite(grad_norm))
        else:
            step = all_ranks_agree(finite is None or bool(finite), world) and bool(torch.isfinite(grad_norm))
        if step:
            role.optimizer.step()
        else:
            role.skipped_steps += 1
            role.optimizer.zero_grad(set_to_none=True)  # nothing non-finite is left for a later step
        norm64 = grad_norm.detach().to(torch.float64)
        grad_norms = norm64 if grad_norms is None else grad_norms + norm64
    if role.params and device_defaults(role.params[0].device.type).free_gradients:
        # through the rollout and the other role's update they would hold 4 bytes a trained parameter
        # that nothing reads (the memory estimate counts one role's at a time where they are freed)
        role.optimizer.zero_grad(set_to_none=True)
    count = max(1, len(steps))
    shared = {
        f"{s.prefix}/grad_norm": (0.0 if grad_norms is None else float(grad_norms)) / count,
        # The rate these steps used, before the schedule moves.
        f"{s.prefix}/lr": role.optimizer.param_groups[0]["lr"],
    }
    role.scheduler.step()
    shared[f"{s.prefix}/skipped_steps"] = float(role.skipped_steps)
    shared[f"{s.prefix}/num_optimizer_steps"] = float(len(steps))
    return {k: float(v) / count for k, v in sums.items()}, shared
