"""The weight checksum's arithmetic (:mod:`tearless.rollout.weight_checksum`), with tensor-parallel
shards laid out as vLLM lays them (column-parallel rows per fused part, row-parallel column slices,
replicated heads and norms). The engine side through vLLM's own workers runs in CI's vLLM tier
(``tests/trainers/test_vllm_train.py``)."""

from __future__ import annotations

import pytest
import torch

from tearless.rollout.weight_checksum import COLUMNS, Held, check, columns, recorded, sample, trainer_names

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
OFFSET = 3


def test_columns_are_strided_distinct_and_rotate_with_the_load_counter():
    assert columns(10, 4, 0) == [0, 2, 4, 6]
    assert columns(10, 4, 3) == [3, 5, 7, 9]
    assert columns(10, 4, 9) == [9, 1, 3, 5]  # wraps around
    assert columns(3, 8, 1) == [1, 2, 0]  # fewer columns than the sample: every one
    # Over K / m successive loads every column is sampled.
    assert set().union(*(columns(64, 8, v) for v in range(8))) == set(range(64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_applied_to_one_hot_inputs_returns_the_columns_exactly(dtype):
    # What the engine does for a weight repacked into a kernel's layout: W e_j = W[:, j], bit for bit,
    # since every product but one is a product with zero.
    torch.manual_seed(0)
    w = torch.randn(96, 200).to(dtype)
    picked = columns(200, COLUMNS, OFFSET)
    ones = torch.zeros(len(picked), 200, dtype=dtype)
    ones[range(len(picked)), picked] = 1
    assert torch.equal(torch.nn.functional.linear(ones, w).T, w[:, picked])


def test_trainer_names_of_fused_and_plain_tensors():
    assert trainer_names("model.layers.0.self_attn.qkv_proj.weight", PACKED) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
    ]
    assert trainer_names("model.norm.weight", PACKED) == ["model.norm.weight"]


def model(kv_rows: int = 8) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    hidden = 16
    return {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, hidden),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(kv_rows, hidden),
        "model.layers.0.self_attn.v_proj.weight": torch.randn(kv_rows, hidden),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(hidden, 16),
        "model.norm.weight": torch.randn(hidden),
    }


def sent_of(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    sent: dict[str, torch.Tensor] = {}
    assert list(recorded(weights.items(), sent, OFFSET)) == list(weights.items())  # passed on unchanged
    return sent


def engine(weights: dict[str, torch.Tensor], tp: int) -> list[dict[str, Held]]:
    """Each worker's report, sharded as vLLM shards: q, k, v rows split over the workers (k and v
    replicated when they have fewer rows than workers × 4, as heads of 4 rows), o_proj's columns
    split, the norm replicated."""
    q, k, v = (weights[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    o = weights["model.layers.0.self_attn.o_proj.weight"]
    norm = weights["model.norm.weight"]
    cols = columns(16, COLUMNS, OFFSET)

    def rows(t: torch.Tensor, r: int) -> torch.Tensor:
        heads = t.shape[0] // 4
        if heads >= tp:
            return t.chunk(tp)[r]
        return t.chunk(heads)[r * heads // tp]  # a head held by several workers

    workers = []
    for r in range(tp):
        qkv = [rows(q, r), rows(k, r), rows(v, r)]
        width = 16 // tp
        sliced = torch.zeros(16, len(cols))
        for i, j in enumerate(cols):
            if r * width <= j < (r + 1) * width:
                sliced[:, i] = o[:, j]
        workers.append(
            {
                "model.layers.0.self_attn.qkv_proj.weight": Held(
                    torch.cat(qkv)[:, cols], [t.shape[0] for t in qkv]
                ),
                "model.layers.0.self_attn.o_proj.weight": Held(sliced, [16], input_sharded=tp > 1),
                "model.norm.weight": Held(norm.clone(), [16]),
                "model.layers.0.self_attn.rotary.inv_freq": Held(torch.ones(4), [4]),  # nothing sent: skipped
            }
        )
    return workers


@pytest.mark.parametrize(("tp", "kv_rows"), [(1, 8), (2, 8), (4, 16), (4, 8)])
def test_shards_laid_out_as_vllm_lays_them_pass(tp, kv_rows):
    weights = model(kv_rows)
    reason, checked = check(engine(weights, tp), sent_of(weights), PACKED)
    assert reason is None
    assert checked == 5  # q, k, v, o, norm


def test_one_value_off_in_one_worker_names_the_tensor_and_the_worker():
    weights = model()
    workers = engine(weights, 2)
    # Worker 1 holds q rows 8-15 first in its qkv shard; its row 2 is q's row 10.
    workers[1]["model.layers.0.self_attn.qkv_proj.weight"].values[2, 5] += 2**-20
    reason, _ = check(workers, sent_of(weights), PACKED)
    assert reason is not None
    assert "model.layers.0.self_attn.q_proj.weight (as model.layers.0.self_attn.qkv_proj.weight)" in reason
    assert "1 of 128 sampled values" in reason and "row 10" in reason and "worker 1" in reason


def test_a_row_parallel_slice_off_in_one_worker_names_that_worker():
    weights = model()
    workers = engine(weights, 2)
    o = workers[1]["model.layers.0.self_attn.o_proj.weight"].values
    o[o != 0] *= 2  # worker 1's columns of o_proj
    reason, _ = check(workers, sent_of(weights), PACKED)
    assert "o_proj.weight differs" in reason and "worker 1" in reason


def test_replicas_that_disagree_are_named():
    weights = model()
    workers = engine(weights, 2)
    workers[1]["model.norm.weight"].values[0] += 1
    reason, _ = check(workers, sent_of(weights), PACKED)
    assert reason == (
        "the engine's model.norm.weight differs between tensor-parallel workers 0 and 1, which hold the "
        "same rows"
    )


def test_stale_weights_are_caught_at_the_smallest_step():
    # The engine kept the previous weights while the trainer sent ones moved by one float32 ulp in
    # every entry (the smallest optimizer step there is).
    weights = model()
    moved = {n: torch.nextafter(t, torch.full_like(t, float("inf"))) for n, t in weights.items()}
    reason, _ = check(engine(weights, 2), sent_of(moved), PACKED)
    assert reason is not None and "differs from what the trainer sent" in reason


def test_a_tensor_of_another_shape_is_refused_by_its_rows():
    weights = model()
    sent = sent_of(weights)
    name = "model.layers.0.self_attn.o_proj.weight"
    sent[name] = sample(weights[name].T[:4], 0)
    reason, _ = check(engine(weights, 1), sent, PACKED)
    assert reason == (
        "the engine's model.layers.0.self_attn.o_proj.weight holds 16 rows of part 0 over its workers where "
        "the trainer sent 4"
    )
