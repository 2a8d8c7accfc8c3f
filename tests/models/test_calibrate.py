"""``param_dtype=auto``: the measured choice between float32 and bf16 autocast (models/calibrate.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig

from tearless.models.calibrate import (
    _PROBES,
    PROBE_DEPTHS,
    PROBE_PAIRS,
    SPEEDUP_TO_SWITCH,
    choose_cpu_dtype,
    extrapolated_step_seconds,
    probe_step_seconds,
)
from tearless.models.precision import compute_dtype


def llama(layers: int = 30) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=256,
    )  # fmt: skip


def linear_timer(fp32: tuple[float, float], bf16: tuple[float, float]):
    """A probe whose step takes head + depth · layer seconds, (head, layer) per dtype; records calls."""
    calls = []

    def timer(config, dtype):
        calls.append((config.num_hidden_layers, dtype))
        head, layer = fp32 if dtype == torch.float32 else bf16
        return head + config.num_hidden_layers * layer

    return timer, calls


def refuse(config, dtype):
    raise AssertionError("the probe ran although nothing needed measuring")


def test_no_native_bf16_gives_float32_without_measuring(tmp_path):
    choice = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=False, timer=refuse)
    assert choice.dtype == "float32" and choice.float32_s is None
    assert "no native bf16" in choice.line("k")
    assert not (tmp_path / "precision").exists()


def test_extrapolation_is_exact_for_a_linear_cost():
    # t(L) = head + L·layer; from depths 1 and 2: fp32 2 + 30·0.5 = 17, bf16 1.5 + 30·0.25 = 9.
    timer, calls = linear_timer((2.0, 0.5), (1.5, 0.25))
    fp32, bf16 = extrapolated_step_seconds(llama(30), timer)
    assert fp32 == pytest.approx(17.0, rel=1e-12) and bf16 == pytest.approx(9.0, rel=1e-12)
    # one warm-up per (depth, dtype), then PROBE_PAIRS alternations: fp32, bf16, fp32, bf16, …
    assert len(calls) == len(PROBE_DEPTHS) * 2 * (1 + PROBE_PAIRS)
    first_depth = [dtype for depth, dtype in calls if depth == PROBE_DEPTHS[0]]
    assert first_depth == [torch.float32, torch.bfloat16] * (1 + PROBE_PAIRS)


def test_measured_choice_is_cached_per_machine_and_model(tmp_path):
    timer, _ = linear_timer((2.0, 0.5), (1.5, 0.25))  # 17 / 9 = 1.89x
    choice = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=2, native=True, timer=timer)
    assert choice.dtype == "bfloat16"
    assert (choice.float32_s, choice.bfloat16_s) == (17.0, 9.0)
    line = choice.line("actor_rollout_ref.actor")
    assert line.startswith(
        "precision: fsdp_config.param_dtype=auto -> bfloat16 for actor_rollout_ref.actor ("
    )
    assert "1.89x" in line and "\n" not in line
    (cached,) = (tmp_path / "precision").glob("*.json")
    assert json.loads(cached.read_text())["choice"]["dtype"] == "bfloat16"
    again = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=2, native=True, timer=refuse)
    assert again.dtype == "bfloat16" and str(cached) in again.reason
    # another thread count or another shape is another key: measured afresh
    slow, _ = linear_timer((2.0, 0.5), (2.0, 0.49))  # 17 / 16.7 = 1.02x < 1.10x
    assert (
        choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=slow).dtype == "float32"
    )
    deeper = choose_cpu_dtype(llama(40), cache_dir=tmp_path, threads=2, native=True, timer=slow)
    assert deeper.dtype == "float32"
    assert len(list((tmp_path / "precision").glob("*.json"))) == 3


def test_threshold_is_the_switch_point(tmp_path):
    # bf16 1.2x faster at every depth: switches; 1.09x (under SPEEDUP_TO_SWITCH = 1.10): does not.
    assert SPEEDUP_TO_SWITCH == 1.10
    timer, _ = linear_timer((1.2, 0.12), (1.0, 0.1))
    assert (
        choose_cpu_dtype(llama(), cache_dir=tmp_path / "a", threads=1, native=True, timer=timer).dtype
        == "bfloat16"
    )
    timer, _ = linear_timer((1.09, 0.109), (1.0, 0.1))
    assert (
        choose_cpu_dtype(llama(), cache_dir=tmp_path / "b", threads=1, native=True, timer=timer).dtype
        == "float32"
    )


def test_a_corrupt_cache_file_is_measured_again(tmp_path):
    timer, _ = linear_timer((2.0, 0.5), (1.5, 0.25))
    choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=timer)
    (cached,) = (tmp_path / "precision").glob("*.json")
    cached.write_text("{not json")
    timer, calls = linear_timer((2.0, 0.5), (1.5, 0.25))
    assert (
        choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=timer).dtype == "bfloat16"
    )
    assert calls and json.loads(cached.read_text())["choice"]["dtype"] == "bfloat16"


def test_the_real_probe_times_a_forward_and_backward(tmp_path):
    """The probe on a real (tiny) Llama: positive finite times, and the choice follows the threshold;
    the run's global RNG comes out as it went in and no probe model is kept."""
    config = llama(3)
    assert probe_step_seconds(config, torch.float32) > 0
    torch.manual_seed(123)
    choice = choose_cpu_dtype(config, cache_dir=tmp_path, threads=torch.get_num_threads(), native=True)
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(4))
    assert not _PROBES
    fp32, bf16 = choice.float32_s, choice.bfloat16_s
    assert math.isfinite(fp32) and math.isfinite(bf16) and fp32 > 0 and bf16 > 0
    assert choice.dtype == ("bfloat16" if fp32 / bf16 >= SPEEDUP_TO_SWITCH else "float32")


def test_unresolved_auto_is_the_default_dtype():
    assert compute_dtype("auto", "cpu", "k") == torch.float32
    assert compute_dtype("auto", "cuda", "k") == torch.bfloat16
