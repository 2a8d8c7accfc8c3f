"""``param_dtype=auto``: the measured choice between float32 and bf16, under autocast or from compute
copies (workers/calibrate.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import LlamaConfig

from tearless.config import load_config
from tearless.config.plan import RunFiles, build_plan
from tearless.models.precision import compute_dtype
from tearless.workers import calibrate
from tearless.workers.calibrate import (
    _PROBES,
    COPIES_PHASES,
    PHASES,
    PROBE_DEPTHS,
    PROBE_PAIRS,
    SPEEDUP_TO_SWITCH,
    PrecisionChoice,
    StepShape,
    choose_cpu_dtype,
    phase_seconds,
    probe_seconds,
    resolve_auto,
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

    def timer(config, dtype, phase, step, copies=False):
        calls.append((config.num_hidden_layers, dtype, phase))
        head, layer = fp32 if dtype == torch.float32 else bf16
        return (head + config.num_hidden_layers * layer) * (decode if phase == "decode" else 1.0)

    return timer, calls


def refuse(config, dtype, phase, step, copies=False):
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
    def timer(config, dtype, phase, step, copies=False):
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


def copies_timer():
    """:func:`linear_timer`'s (2 + 0.5 L, 1.5 + 0.25 L) for every phase, with the refresh of compute copies:
    bf16's like the others, float32's 0 (it holds none, as the real probe); records (dtype, phase, copies)."""
    calls = []
    linear, _ = linear_timer((2.0, 0.5), (1.5, 0.25))

    def timer(config, dtype, phase, step, copies=False):
        calls.append((dtype, phase, copies))
        if phase == "refresh" and dtype == torch.float32:
            return 0.0
        return linear(config, dtype, phase, step)

    return timer, calls


def test_copies_time_bf16_from_compute_copies_with_their_refresh(tmp_path):
    # At L = 30 every phase is 17 s in float32 and 9 in bf16; the refresh 0 and 9. The default step
    # (8 prompts x 8 samples, 128 + 128 tokens, 1 epoch) decodes in one round with no per-token cost
    # (decode = prefill), and its update is (8·128 + 64·128) / 256 = 36 probe updates:
    # float32 17 + 36·17 = 629; bf16 9 + 36·9 + 1 refresh of 9 = 342 (autocast would be 333).
    timer, calls = copies_timer()
    choice = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=timer, copies=True)
    assert choice.float32_s == pytest.approx(629, rel=1e-9)
    assert choice.bfloat16_s == pytest.approx(342, rel=1e-9)
    assert choice.dtype == "bfloat16"
    # per depth: one warm-up and PROBE_PAIRS runs of each dtype for each phase, the refresh included
    assert len(calls) == len(PROBE_DEPTHS) * len(COPIES_PHASES) * 2 * (1 + PROBE_PAIRS)
    assert {phase for _, phase, _ in calls} == {*PHASES, "refresh"}
    assert all(copies for _, _, copies in calls)
    line = choice.line("actor_rollout_ref.actor")
    # 629 / 342 = 1.84, decoding 17 / 9 = 1.89, update 612 / 333 = 1.84
    assert "~629 CPU-s in float32, ~342 in bf16 compute copies (1.84x: decoding 1.89x, update 1.84x" in line
    assert "autocast" not in line
    # without copies: the three phases only, no copies asked for, and the line says autocast
    timer, calls = copies_timer()
    autocast = choose_cpu_dtype(llama(), cache_dir=tmp_path / "a", threads=1, native=True, timer=timer)
    assert autocast.bfloat16_s == pytest.approx(333, rel=1e-9)
    assert {phase for _, phase, _ in calls} == set(PHASES) and not any(c for _, _, c in calls)
    assert "in bf16 autocast (" in autocast.reason


def test_the_copies_refresh_after_every_optimizer_step(tmp_path):
    # copies_timer's step at L = 30 (test above): bf16 9 + 36·9 + one refresh of 9 = 342. With 4
    # mini-batches an epoch the copies refresh 4 times an epoch, 2 epochs: 9 + 2·(36·9 + 4·9) = 729;
    # float32 holds no copies: 17 + 2·36·17 = 1241.
    timer, _ = copies_timer()
    step = StepShape(ppo_epochs=2, refreshes=4)
    choice = choose_cpu_dtype(
        llama(), cache_dir=tmp_path, threads=1, native=True, timer=timer, copies=True, step=step
    )
    assert choice.bfloat16_s == pytest.approx(729, rel=1e-9)
    assert choice.float32_s == pytest.approx(1241, rel=1e-9)
    # under autocast there is nothing to refresh: mini-batches change nothing
    timer, _ = copies_timer()
    autocast = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=timer, step=step)
    assert autocast.bfloat16_s == pytest.approx(9 + 2 * 36 * 9, rel=1e-9)


def test_decoding_in_the_engines_own_dtype_is_neither_timed_nor_counted(tmp_path):
    # Issue 47's CPU again (update 1.2x faster in bf16, decoding 2x slower): where decoding follows
    # the choice the step loses in bf16; where the engine decodes in its own dtype (rollout.dtype set,
    # vLLM) only the update differs, and bf16 wins it by 1.2x.
    calls = []

    def timer(config, dtype, phase, step, copies=False):
        calls.append(phase)
        base = 1.0 + 0.1 * config.num_hidden_layers
        if phase == "decode":
            return base * (3.0 if dtype == torch.float32 else 6.0)
        return base if dtype == torch.float32 else base / 1.2

    step = StepShape(decodes=False)
    assert step.phases(False) == ("update",) and step.phases(True) == ("update", "refresh")
    choice = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=timer, step=step)
    assert set(calls) == {"update"}  # no decoding timed
    # at L = 30 an update is 4 s in float32, 4 / 1.2 in bf16; the step's 36 of them and nothing else
    assert choice.float32_s == pytest.approx(36 * 4.0, rel=1e-9)
    assert choice.bfloat16_s == pytest.approx(36 * 4.0 / 1.2, rel=1e-9)
    assert choice.dtype == "bfloat16"
    assert "(1.20x: update 1.20x; decoding not counted: it runs in its engine's own dtype; bf16 from" in (
        choice.reason
    )
    assert step_seconds({"update": 1.0}, step) == pytest.approx(36.0, rel=1e-12)
    counted = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=timer)
    assert counted.dtype == "float32" and "prefill" in calls  # another key: measured afresh
    assert len(list((tmp_path / "precision").glob("*.json"))) == 2


def test_the_steps_cache_key_keeps_the_choices_cached_before_its_new_fields():
    old = {"prompts": 8, "n": 8, "prompt_tokens": 128, "response_tokens": 128, "ppo_epochs": 1}
    assert StepShape().key() == old
    assert StepShape(refreshes=2, decodes=False).key() == {**old, "refreshes": 2, "decodes": False}


@pytest.fixture
def resolver(tmp_path, monkeypatch):
    """``resolve(*overrides) -> (plan, asks)``: :func:`resolve_auto` on CPU for a config with the actor's
    ``param_dtype=auto`` and those overrides, the policy a 2-layer Llama (a critic's ``critic.model.path``
    and a teacher's a 3-layer one), :func:`choose_cpu_dtype` replaced by a recorder of its keyword
    arguments (one dict per probe asked for) choosing bf16."""
    llama(2).save_pretrained(tmp_path / "policy")
    llama(3).save_pretrained(tmp_path / "critic")
    asks: list[dict] = []

    def choose(config, **kwargs):
        asks.append(kwargs)
        return PrecisionChoice("bfloat16", "measured")

    monkeypatch.setattr(calibrate, "choose_cpu_dtype", choose)

    def resolve(*overrides):
        asks.clear()
        cfg = load_config(None, ["actor_rollout_ref.actor.fsdp_config.param_dtype=auto", *overrides])
        critic = str(tmp_path / "critic") if cfg.critic.model.path else None
        teacher = str(tmp_path / "critic") if cfg.actor_rollout_ref.teacher.model.path else None
        files = RunFiles(str(tmp_path / "policy"), None, None, None, teacher, critic_path=critic)
        return resolve_auto(cfg, build_plan(cfg, files), gpu=False, log=lambda _: None), list(asks)

    return resolve


def test_resolve_auto_prices_the_step_the_run_takes(resolver, tmp_path):
    def resolve(*overrides):
        return [ask["step"] for ask in resolver(*overrides)[1]]

    batch = ("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    (step,) = resolve(*batch, "actor_rollout_ref.actor.ppo_epochs=2")
    assert (step.prompts, step.refreshes, step.ppo_epochs, step.decodes) == (16, 4, 2, True)
    (step,) = resolve(*batch, "actor_rollout_ref.rollout.dtype=float32")
    assert not step.decodes  # the engine decodes in float32 whichever dtype the actor takes
    # a critic read from its own model: its own update's mini-batches, and it decodes nothing
    ppo = ("algorithm.adv_estimator=gae", f"critic.model.path={tmp_path / 'critic'}")
    actor, critic = resolve(
        *batch, *ppo, "critic.ppo_mini_batch_size=8", "critic.model.fsdp_config.param_dtype=auto"
    )
    assert (actor.refreshes, actor.decodes) == (4, True)
    assert (critic.refreshes, critic.decodes) == (2, False)
    # a LoRA actor refreshes only its adapters' copies: not counted
    (step,) = resolve(*batch, "actor_rollout_ref.model.lora_rank=4")
    assert (step.refreshes, step.ppo_epochs, step.decodes) == (0, 1, True)
    # a teacher of its own model: one log-prob pass a step, frozen (no refresh), no decoding
    distill = ("algorithm.adv_estimator=on_policy_distill", "actor_rollout_ref.teacher.model.path=t")
    epochs = "actor_rollout_ref.actor.ppo_epochs=2"
    _, teacher = resolve(*batch, *distill, epochs, "actor_rollout_ref.teacher.fsdp_config.param_dtype=auto")
    assert (teacher.refreshes, teacher.ppo_epochs, teacher.decodes) == (0, 1, False)


def test_the_cache_keeps_autocast_and_copies_choices_apart(tmp_path):
    # bf16 autocast 1.89x faster; bf16 from copies slower than float32 (every phase 17.3 s against 17)
    fast, _ = linear_timer((2.0, 0.5), (1.5, 0.25))
    slow, calls = linear_timer((2.0, 0.5), (2.0, 0.51))
    assert (
        choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=fast).dtype == "bfloat16"
    )
    measured = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=slow, copies=True)
    assert calls and measured.dtype == "float32"  # measured, not the autocast choice read back
    assert len(list((tmp_path / "precision").glob("*.json"))) == 2
    autocast = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=refuse)
    copies = choose_cpu_dtype(llama(), cache_dir=tmp_path, threads=1, native=True, timer=refuse, copies=True)
    assert (autocast.dtype, copies.dtype) == ("bfloat16", "float32")
    assert "bf16 autocast" in autocast.reason and "bf16 compute copies" in copies.reason
    assert "; cached in " in autocast.reason and "; cached in " in copies.reason
    assert autocast.reason.split("; cached in ")[1] != copies.reason.split("; cached in ")[1]


def test_the_real_probe_computes_bf16_from_copies_without_autocast():
    """The probe on a real (tiny) Llama in copies mode: the bf16 update's forward sees bf16 parameters
    (buffers float32) and no autocast, its gradients land on the float32 masters, the refresh recasts
    them; float32 computes from the masters; without copies bf16 runs under autocast."""
    config, step = llama(1), StepShape(prompts=1, n=2, prompt_tokens=4, response_tokens=4)
    _PROBES.clear()
    try:
        assert probe_seconds(config, torch.float32, "update", step, True) > 0
        (model,) = _PROBES.values()
        assert not hasattr(model, "tearless_copies")  # float32 made no copies
        seen = []

        def look(module, args, output):
            params = {p.dtype for p in module.parameters()}
            seen.append((params, torch.is_autocast_enabled("cpu")))

        model.register_forward_hook(look)
        assert probe_seconds(config, torch.bfloat16, "update", step, True) > 0
        assert list(_PROBES.values()) == [model]  # built once, reused
        assert seen[-1] == ({torch.bfloat16}, False)
        assert {b.dtype for b in model.buffers()} == {torch.float32}  # rotary's inv_freq as it was
        copies = model.tearless_copies
        assert all(c.grad is None for c in copies.copies)  # folded into the masters
        assert all(m.dtype == torch.float32 and m.grad.dtype == torch.float32 for m in copies.masters)
        assert probe_seconds(config, torch.float32, "update", step, True) > 0
        assert seen[-1] == ({torch.float32}, False)  # the masters, the copies swapped out
        with torch.no_grad():
            for m in copies.masters:
                m.add_(1.0)
        assert probe_seconds(config, torch.bfloat16, "refresh", step, True) >= 0
        assert all(
            torch.equal(c, m.to(torch.bfloat16)) for c, m in zip(copies.copies, copies.masters, strict=True)
        )
        assert probe_seconds(config, torch.float32, "refresh", step, True) == 0.0  # holds no copies
        assert probe_seconds(config, torch.bfloat16, "prefill", step, True) > 0
        assert seen[-1][0] == {torch.bfloat16}  # decoding from the copies
        _PROBES.clear()
        probe_seconds(config, torch.float32, "update", step)
        (plain,) = _PROBES.values()
        plain.register_forward_hook(look)
        probe_seconds(config, torch.bfloat16, "update", step)
        assert seen[-1] == ({torch.float32}, True) and not hasattr(plain, "tearless_copies")
    finally:
        _PROBES.clear()


def test_resolve_auto_times_copies_when_the_actor_would_hold_them(resolver):
    def asked(*overrides):
        return [ask["copies"] for ask in resolver(*overrides)[1]]

    plan, asks = resolver("actor_rollout_ref.actor.fsdp_config.compute_copies=true")
    assert [ask["copies"] for ask in asks] == [True] and plan.param_dtype("actor") == "bfloat16"
    assert asked() == [False]
    # actor and reference share the model: the actor's key decides, not the reference's own
    kl = ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.fsdp_config.param_dtype=auto")
    assert asked(*kl, "actor_rollout_ref.ref.fsdp_config.compute_copies=true") == [False]
    assert asked(*kl, "actor_rollout_ref.actor.fsdp_config.compute_copies=true") == [True]
    # two worker processes: the model is sharded and computes under autocast whatever the key says
    assert asked("actor_rollout_ref.actor.fsdp_config.compute_copies=true", "trainer.n_gpus_per_node=2") == [
        False
    ]


def test_unresolved_auto_is_the_default_dtype():
    assert compute_dtype("auto", "cpu", "k") == torch.float32
    assert compute_dtype("auto", "cuda", "k") == torch.bfloat16
