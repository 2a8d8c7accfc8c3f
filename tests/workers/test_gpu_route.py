"""Guards of the GPU's update route that hold on a CPU (issue 41): the config takes the CUDA defaults
(:mod:`tearless.devices`) while the rank runs here, so the same code a GPU runs is counted.

- one forward per micro-batch (packed, token-budgeted), where the CPU's route runs a prompt forward
  and a forward per length bucket;
- the host reads of the update (``Tensor.item``, ``tolist``, ``cpu``, ``bool()``, ``int()``,
  ``float()``: each a device sync on a GPU when the tensor lives there) are bounded, and the loss and
  metric code reads nothing per micro-batch: the metrics once per update, the step-or-skip flag once
  per optimizer step.
"""

from __future__ import annotations

import collections
import contextlib
import traceback
from pathlib import Path

import pytest
import torch

import tearless.workers.schedule as schedule
from tests.workers.test_actor import build_batch

READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")
PACKAGE = str(Path(schedule.__file__).resolve().parents[1])


@pytest.fixture(scope="module")
def model_and_batch(task):
    return build_batch(task.model_dir)


@contextlib.contextmanager
def host_reads():
    """Count reads of tensor values into Python, by the tearless module that made them (the first
    frame inside the package; ``other`` for a library such as transformers)."""
    seen: collections.Counter = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            frames = traceback.extract_stack()[:-1]
            inside = [f.filename for f in reversed(frames) if f.filename.startswith(PACKAGE)]
            seen[Path(inside[0]).relative_to(PACKAGE).as_posix() if inside else "other"] += 1
            return original(self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def run_update(local_workers, model, td, device, monkeypatch, *extra):
    """The trainer's update of ``td`` with ``device``'s config defaults: (forwards of the model,
    micro-batches per optimizer step, host reads by module)."""
    import copy

    model = copy.deepcopy(model)
    workers = local_workers(
        "data.max_prompt_length=24",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # two optimizer steps
        *extra,
        models={"actor": model},
        config_device=device,
    )
    forwards, micro = [], []
    real = schedule.micro_batches
    monkeypatch.setattr(
        schedule, "micro_batches", lambda *a, **k: (lambda c: micro.append(len(c)) or c)(real(*a, **k))
    )
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with host_reads() as reads:
        workers.update_policy(td.clone())
    hook.remove()
    return len(forwards), micro, reads


def test_the_cuda_defaults_make_one_forward_per_micro_batch(local_workers, model_and_batch, monkeypatch):
    model, td = model_and_batch
    for budget in (16384, 100):  # veRL's default budget (a step in one pass), and 4 passes per step
        forwards, micro, _ = run_update(
            local_workers,
            model,
            td,
            "cuda",
            monkeypatch,
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        )
        assert forwards == sum(micro)
        assert micro == ([1, 1] if budget == 16384 else [4, 4])
    # The CPU's route over the same batch: a shared prompt forward beside the response forwards.
    forwards, micro, _ = run_update(local_workers, model, td, "cpu", monkeypatch)
    assert micro == [1, 1] and forwards > sum(micro)


def test_host_reads_of_the_update_are_bounded_and_none_per_micro_batch_in_the_loss(
    local_workers, model_and_batch, monkeypatch
):
    model, td = model_and_batch
    counts = {}
    for budget in (16384, 100):
        _, micro, reads = run_update(
            local_workers,
            model,
            td,
            "cuda",
            monkeypatch,
            f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        )
        counts[sum(micro)] = reads
    one, four = counts[2], counts[8]  # 1 and 4 micro-batches per optimizer step, 2 steps
    # The schedule, the actor's loss and the algorithms (their tensors live on the GPU there): the
    # same reads whatever the number of micro-batches. They are: the plan's token counts (host data),
    # one step-or-skip flag per optimizer step, and the metrics once at the end.
    loss_side = ("workers/", "algos/")
    assert {k: v for k, v in four.items() if k.startswith(loss_side)} == {
        k: v for k, v in one.items() if k.startswith(loss_side)
    }
    assert sum(v for k, v in four.items() if k.startswith(loss_side)) <= 16
    # Per micro-batch, the log-prob pass reads the batch's masks on the host before they are copied to
    # the device (the packing layout: at most 2 checks, 2 layout flags and 1 length per pass, twice
    # when identical rows are forwarded once), and transformers reads the packed positions once.
    per_micro = (sum(four.values()) - sum(one.values())) / (8 - 2)
    assert per_micro <= 6 + 1
    assert sum(four.values()) <= 16 + 7 * 8
