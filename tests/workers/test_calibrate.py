"""``param_dtype=auto``: the measured choice between float32 and bf16 autocast (workers/calibrate.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig

from tearless.models.precision import compute_dtype
from tearless.workers.calibrate import (
    _PROBES,
    PHASES,
    PROBE_DEPTHS,
    PROBE_PAIRS,
    SPEEDUP_TO_SWITCH,
    StepShape,
    choose_cpu_dtype,
    phase_seconds,
    probe_seconds,
    step_seconds,
)


def llama(layers: int = 30) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=256,
    )  # fmt: skip


def linear_timer(fp32: tuple[float, float], bf16: tuple[float, float], decode: float = 1.0):
    """A probe whose every phase takes head + depth · layer seconds, (head, layer) per dtype, the decode
    phase ``decode`` times the others; records the calls."""
    calls = []

    def timer(config, dtype, phase, step):
        calls.append((config.num_hidden_layers, dtype, phase))
        head, layer = fp32 if dtype == torch.float32 else bf16
        return (head + config.num_hidden_layers * layer) * (decode if phase == "decode" else 1.0)

    return timer, calls


def refuse(config, dtype, phase, step):
    raise AssertionError("the probe ran although nothing needed measuring")


def test_no_native_bf16_gives_float32_without_measuring(tmp_path):
    choice = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=False, timer=refuse)
    assert choice.dtype == "float32" and choice.float32_s is None
    assert "no native bf16" in choice.line("k")
    assert not (tmp_path / "precision").exists()


def test_extrapolation_is_exact_for_a_linear_cost():
    # t(L) = head + L·layer; from depths 1 and 8: fp32 2 + 30·0.5 = 17, bf16 1.5 + 30·0.25 = 9.
    timer, calls = linear_timer((2.0, 0.5), (1.5, 0.25))
    phases = phase_seconds(llama(30), timer, StepShape())
    for phase in PHASES:
        assert phases[torch.float32][phase] == pytest.approx(17.0, rel=1e-12)
        assert phases[torch.bfloat16][phase] == pytest.approx(9.0, rel=1e-12)
    # per depth and phase: one warm-up per dtype, then PROBE_PAIRS alternations: fp32, bf16, fp32, …
    assert len(calls) == len(PROBE_DEPTHS) * len(PHASES) * 2 * (1 + PROBE_PAIRS)
    first = [dtype for depth, dtype, phase in calls if depth == PROBE_DEPTHS[0] and phase == "update"]
    assert first == [torch.float32, torch.bfloat16] * (1 + PROBE_PAIRS)
    # a model shallower than the second probe depth is probed at its own depth: no extrapolation
    timer, calls = linear_timer((2.0, 0.5), (1.5, 0.25))
    shallow = phase_seconds(llama(3), timer, StepShape())
    assert {depth for depth, _, _ in calls} == {1, 3}
    assert shallow[torch.float32]["update"] == pytest.approx(3.5, rel=1e-12)


def test_a_step_is_decoding_plus_the_update_worked_by_hand():
    # 8 prompts of <= 100 tokens, n = 8, <= 50 response tokens, 2 epochs; probe: update u = 0.5 s for
    # 2 x 128 tokens, prefill p = 1 s, 1 + 8 tokens t = 3 s -> s = (3 - 1) / 8 = 0.25 s a token.
    step = StepShape(prompts=8, n=8, prompt_tokens=100, response_tokens=50, ppo_epochs=2)
    assert step.rows == 64 and step.probe_prompts() == 8  # 64 rows fit one probe round
    phases = {"update": 0.5, "prefill": 1.0, "decode": 3.0}
    # decoding: 1 round x (1 + 50 x 0.25) = 13.5; update: 2 x 0.5 x (8·100 + 64·50) / 256 = 15.625
    assert step_seconds(phases, step) == pytest.approx(13.5 + 15.625, rel=1e-12)
    # 32 prompts x 8 samples: the probe samples 8 prompts (64 rows), decoding takes 4 such rounds
    wide = StepShape(prompts=32, n=8, prompt_tokens=100, response_tokens=50, ppo_epochs=1)
    assert wide.probe_prompts() == 8
    assert step_seconds(phases, wide) == pytest.approx(4 * 13.5 + 0.5 * (3200 + 12800) / 256, rel=1e-12)
    # n larger than the probe's rows: one prompt, all its samples
    assert StepShape(prompts=4, n=128).probe_prompts() == 1


def test_measured_choice_is_cached_per_machine_model_and_step(tmp_path):
    timer, _ = linear_timer((2.0, 0.5), (1.5, 0.25))  # every phase 17 / 9 = 1.89x
    choice = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=2, native=True, timer=timer)
    assert choice.dtype == "bfloat16"
    assert choice.float32_s / choice.bfloat16_s == pytest.approx(17 / 9, rel=1e-5)
    line = choice.line("actor_rollout_ref.actor")
    assert line.startswith(
        "precision: fsdp_config.param_dtype=auto -> bfloat16 for actor_rollout_ref.actor ("
    )
    assert "(1.89x: decoding 1.89x, update 1.89x" in line and "\n" not in line
    (cached,) = (tmp_path / "precision").glob("*.json")
    assert json.loads(cached.read_text())["choice"]["dtype"] == "bfloat16"
    again = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=2, native=True, timer=refuse)
    assert again.dtype == "bfloat16" and str(cached) in again.reason
    # another thread count, another shape or another step is another key: measured afresh
    slow, _ = linear_timer((2.0, 0.5), (2.0, 0.49))  # 17 / 16.7 = 1.02x < 1.10x
    assert (
        choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=slow).dtype == "float32"
    )
    deeper = choose_cpu_dtype(llama(40), cache_dir=tmp_path, threads=2, native=True, timer=slow)
    assert deeper.dtype == "float32"
    longer = choose_cpu_dtype(
        llama(), cache_dir=tmp_path, threads=2, native=True, timer=slow, step=StepShape(response_tokens=512)
    )
    assert longer.dtype == "float32"
    assert len(list((tmp_path / "precision").glob("*.json"))) == 4


def test_a_faster_update_does_not_outweigh_slower_decoding(tmp_path):
    # Issue 47's CPU: the update gains in bf16, decoding loses, and decoding is most of the step.
    # Update/prefill phases 1.2x faster in bf16, the decode phase 2x slower than fp32's: the step loses.
    def timer(config, dtype, phase, step):
        base = 1.0 + 0.1 * config.num_hidden_layers
        if phase == "decode":
            return base * (3.0 if dtype == torch.float32 else 6.0)
        return base if dtype == torch.float32 else base / 1.2

    choice = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=timer)
    assert choice.dtype == "float32"
    assert "update 1.20x" in choice.reason and choice.float32_s < choice.bfloat16_s


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


def test_the_real_probe_times_an_update_and_decoding(tmp_path):
    """The probe on a real (tiny) Llama: positive finite times, decoding 9 tokens costs more than
    decoding 1, and the choice follows the threshold; the run's global RNG comes out as it went in and
    no probe model is kept."""
    config = llama(3)
    step = StepShape(prompts=2, n=2, prompt_tokens=16, response_tokens=16)
    assert probe_seconds(config, torch.float32, "update", step) > 0
    assert probe_seconds(config, torch.float32, "prefill", step) > 0
    torch.manual_seed(123)
    choice = choose_cpu_dtype(
        config, cache_dir=tmp_path, threads=torch.get_num_threads(), native=True, step=step
    )
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
