"""``fsdp_config.param_dtype=auto``: float32 or bf16, chosen by measuring this CPU once.

Whether bf16 autocast pays on a CPU depends on the CPU, the model and the run: with AMX or AVX-512
BF16 a large matmul runs ~2.5× faster in bf16, but every autocast region casts its activations (and
weights), a small model's step is cast-bound, and decoding (most of a step on a real model) runs
matmuls of one token per row. Issue 47 measured an EPYC with AVX-512 BF16 whose update gained in
bf16 while the whole step of SmolLM2-135M lost 11%, because the probe timed only the update. Without
those instructions bf16 is emulated and always slower. So ``auto`` resolves:

- on GPU: bfloat16 (as everywhere in veRL);
- on a CPU without native bf16 (:func:`~tearless.models.precision.cpu_has_native_bf16` false):
  float32, nothing measured;
- on a CPU with it: the dtype of the cheaper *step*, timed on the model's own shapes and the run's
  own batch (:class:`StepShape`). The probe builds the model's architecture (random weights) at two
  depths, d₁ = 1 and d₂ = min(8, L) decoder layers (8 layers cost about what the LM head of a
  small model does, so their difference stands above the timing noise), and times, in CPU seconds, in
  each dtype

  - the update: one forward + backward of a packed batch (``PROBE_ROWS`` × ``PROBE_TOKENS`` tokens,
    the loss a mean of float32 log-softmax over the vocabulary, as the trainer computes it), u;
  - decoding: the built-in engine sampling n responses for each of the step's prompts (at most
    ``DECODE_ROWS`` rows in all, :meth:`StepShape.probe_prompts`), once 1 token (the prefill, p) and
    once 1 + ``DECODE_TOKENS`` tokens (t), so one decode step costs s = (t − p) / ``DECODE_TOKENS``;

  each extrapolated linearly in depth to the model's L layers,

      t(L) = t(d₁) + (L − d₁) · (t(d₂) − t(d₁)) / (d₂ − d₁),

  so the LM head and the log-softmax over the vocabulary count once and the decoder layers L times.
  A step of B prompts of P tokens, each sampled n times up to T tokens, then costs, per dtype,

      step = ⌈B / B_probe⌉ · (p + T · s) + ppo_epochs · u · (B·P + B·n·T) / (PROBE_ROWS · PROBE_TOKENS)

  (a group's prompt is forwarded once in the update, as ``share_prompt_forward`` does).

  Each (dtype, phase, depth) runs once to warm up, then ``PROBE_PAIRS`` times alternating the dtypes;
  the medians are used. bf16 is chosen when step₃₂ / step₁₆ ≥ :data:`SPEEDUP_TO_SWITCH` (a 10%
  margin: the probe's own noise on a shared machine), and the line says so with the measured ratios.
  The result is cached under ``<cache>/precision/`` by CPU model and flags, torch version, thread
  count, the model's shape, the step's shape and how bf16 was computed, so the probe (seconds) runs
  once per machine, model and batch shape.

The bf16 candidate is timed as the run would compute it. By default that is autocast over the float32
weights. A run whose actor would hold compute copies (``fsdp_config.compute_copies``,
:mod:`tearless.models.copies`; ``copies`` here) computes bf16 from bf16 copies of float32 masters
instead: no weight cast at any forward, the whole forward (residual stream included) in bf16. Then the
probe gives its float32 model the run's copies (:func:`~tearless.models.copies.attach`, made once,
dropped with the model) and times the bf16 candidate with them swapped in and no autocast: u is the
forward + backward from the copies, each bf16 gradient added to its master's float32 one (as the run
does), the loss still a float32 log-softmax; decoding samples from the copies. The copies' refresh after
each optimizer step (one fused cast of every trained parameter, ``torch._foreach_copy_``) is a phase of
its own, r, extrapolated in depth like the others and counted once per optimizer step,

    step₁₆ += ppo_epochs · k · r

(k optimizer steps an epoch, :attr:`StepShape.refreshes`: ``train_batch_size / ppo_mini_batch_size``
for a fully trained model; 0 for a LoRA actor, whose copies of its adapters alone cost next to
nothing to refresh, and for a frozen role's group, which holds its parameters in bf16 and refreshes
nothing);

the float32 candidate holds no copies (r = 0) and is timed as without them.

Decoding counts only where it computes in the dtype being chosen: the built-in engine sampling the
actor's own weights (hybrid placement) with ``rollout.dtype`` unset. With ``rollout.dtype`` set, or an
engine holding its own weights (vLLM, rollout nodes), or a group of roles without the actor (a critic
or a teacher read from another model), decoding costs the same whichever dtype is chosen, so it is
neither timed nor counted (:attr:`StepShape.decodes` false): the choice is the update's, and the line
says so.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tearless.cachedir import default_cache_dir
from tearless.config import Config
from tearless.config.derived import world_size
from tearless.config.plan import RunPlan, role_key
from tearless.models.copies import ComputeCopies, attach
from tearless.models.precision import NATIVE_BF16_FLAGS, autocast, compute_dtype, cpu_has_native_bf16
from tearless.rollout.hf import HFRollout

SPEEDUP_TO_SWITCH = 1.10
PROBE_ROWS, PROBE_TOKENS, PROBE_PAIRS = 2, 128, 3
DECODE_ROWS, DECODE_PROMPT_MAX, DECODE_TOKENS = 64, 256, 8
PROBE_DEPTHS = (1, 8)  # the second capped at the model's depth
PHASES = ("update", "prefill", "decode")
COPIES_PHASES = (*PHASES, "refresh")  # with compute copies: their refresh after an optimizer step
# The config fields that decide a step's cost (a model's shape, not its weights).
SHAPE_FIELDS = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "tie_word_embeddings",
)  # fmt: skip


@dataclass(frozen=True)
class StepShape:
    """What one RL step computes: ``prompts`` prompts of up to ``prompt_tokens`` tokens, each sampled
    ``n`` times (``rollout.n``) up to ``response_tokens`` tokens, and ``ppo_epochs`` update passes of
    ``refreshes`` refreshes of the whole model's copies each; its decoding counted only when it
    ``decodes`` in the dtype being chosen."""

    prompts: int = 8
    n: int = 8
    prompt_tokens: int = 128
    response_tokens: int = 128
    ppo_epochs: int = 1
    refreshes: int = 1  # whole-model copies refreshes per epoch (one per optimizer step)
    decodes: bool = True  # whether decoding computes in the dtype chosen (module docstring)

    @property
    def rows(self) -> int:
        return self.prompts * self.n

    def key(self) -> dict[str, Any]:
        """The step's part of the cache key: its fields, those added later left out at their defaults
        (so the choices cached before them stay valid)."""
        return {
            k: v
            for k, v in asdict(self).items()
            if not (k in ("refreshes", "decodes") and v == getattr(StepShape, k))
        }

    def phases(self, copies: bool) -> tuple[str, ...]:
        """The probe phases that price this step: the update, decoding (prefill and decode) when it
        ``decodes``, the copies' refresh with ``copies``."""
        return tuple(
            p for p in (COPIES_PHASES if copies else PHASES) if self.decodes or p not in ("prefill", "decode")
        )

    def probe_prompts(self) -> int:
        """The prompts the decoding probe samples ``n`` times each: the step's, at most
        :data:`DECODE_ROWS` rows in all (one prompt at least)."""
        return max(1, min(self.prompts, DECODE_ROWS // self.n))


@dataclass(frozen=True)
class PrecisionChoice:
    """The resolved dtype (``"float32"`` or ``"bfloat16"``), why, and the probe's estimated seconds
    of one step in each dtype (None when nothing was measured)."""

    dtype: str
    reason: str
    float32_s: float | None = None
    bfloat16_s: float | None = None

    def line(self, sections: str) -> str:
        """The one line the trainer prints at start for the config sections (``actor_rollout_ref.actor``,
        …) whose ``fsdp_config.param_dtype`` was ``auto``."""
        return f"precision: fsdp_config.param_dtype=auto -> {self.dtype} for {sections} ({self.reason})"


def cpu_identity() -> dict[str, Any]:
    """What makes one CPU's timings another's: its model name, its bf16 flags, torch's version."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    wanted = (*NATIVE_BF16_FLAGS, "avx512f", "avx2")
    return {"cpu": name, "flags": sorted(f for f in flags if f in wanted), "torch": torch.__version__}


def model_shape(config: Any) -> dict[str, Any]:
    """The cost-deciding fields of a transformers config (its ``text_config`` for a multimodal one)."""
    config = getattr(config, "text_config", None) or config
    return {f: getattr(config, f, None) for f in SHAPE_FIELDS}


Timer = Callable[[Any, torch.dtype, str, StepShape, bool], float]
"""``timer(config, dtype, phase, step, copies) -> seconds``: one probe run of ``phase`` (:data:`PHASES`,
:data:`COPIES_PHASES` when ``copies``: a reduced ``dtype`` computed from compute copies)."""


def choose_cpu_dtype(
    config: Any,
    *,
    cache_dir: str | Path,
    threads: int,
    step: StepShape | None = None,
    native: bool | None = None,
    timer: Timer | None = None,
    copies: bool = False,
) -> PrecisionChoice:
    """Resolve ``param_dtype=auto`` on CPU for a model of transformers config ``config`` whose RL step
    has the shape ``step`` (default :class:`StepShape`), its bf16 computed from compute copies when
    ``copies`` (else under autocast; module docstring).

    ``native`` overrides :func:`cpu_has_native_bf16` and ``timer`` the probe runs (both for tests);
    ``threads`` is the run's torch thread count (part of the cache key).
    """
    if not (cpu_has_native_bf16() if native is None else native):
        return PrecisionChoice(
            "float32",
            f"this CPU has no native bf16 (no {' or '.join(NATIVE_BF16_FLAGS)} flag): bf16 would be emulated",
        )
    step = step or StepShape()
    key = {**cpu_identity(), "threads": threads, "shape": model_shape(config), "step": step.key()}
    if copies:  # an autocast key stays as it was, so the choices cached before copies stay valid
        key["bf16"] = "compute copies"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    path = Path(cache_dir).expanduser() / "precision" / f"{digest}.json"
    try:
        cached = json.loads(path.read_text())
        return PrecisionChoice(
            **{**cached["choice"], "reason": cached["choice"]["reason"] + f"; cached in {path}"}
        )
    except (OSError, ValueError, KeyError, TypeError):
        pass
    # The probe seeds its random model and may draw dropout masks: the run's global RNG streams must
    # come out as they went in (a first run that measures and a later one that reads the cache draw
    # the same numbers), and its model must not outlive the measurement.
    with torch.random.fork_rng(devices=[]):
        try:
            phases = phase_seconds(config, timer or probe_seconds, step, copies)
        finally:
            _PROBES.clear()
    fp32, bf16 = (step_seconds(phases[dtype], step) for dtype in (torch.float32, torch.bfloat16))
    speedup = fp32 / bf16
    dtype = "bfloat16" if speedup >= SPEEDUP_TO_SWITCH else "float32"
    update32, update16 = (_update_seconds(phases[d], step) for d in (torch.float32, torch.bfloat16))
    if step.decodes:
        decode32, decode16 = (_decode_seconds(phases[d], step) for d in (torch.float32, torch.bfloat16))
        parts = f"decoding {decode32 / decode16:.2f}x, update {update32 / update16:.2f}x"
    else:
        parts = f"update {update32 / update16:.2f}x; decoding not counted: it runs in its engine's own dtype"
    choice = PrecisionChoice(
        dtype,
        f"measured on this CPU: a step of {step.prompts}x{step.n} samples of <= {step.prompt_tokens}+"
        f"{step.response_tokens} tokens ~{fp32:.3g} CPU-s in float32, ~{bf16:.3g} in bf16 "
        f"{'compute copies' if copies else 'autocast'} ({speedup:.2f}x: {parts}; "
        f"bf16 from {SPEEDUP_TO_SWITCH}x)",
        round(fp32, 6),
        round(bf16, 6),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "choice": asdict(choice)}, indent=1, default=str))
    tmp.replace(path)  # atomic: a crash mid-write leaves no half file for the next run to read
    return choice


def step_seconds(phases: dict[str, float], step: StepShape) -> float:
    """The estimated seconds of one step of shape ``step`` from one dtype's full-depth phase times
    (module docstring): decoding (when the step ``decodes``) plus ``ppo_epochs`` updates (with the
    copies' refresh after each optimizer step, when the phases hold one)."""
    return (_decode_seconds(phases, step) if step.decodes else 0.0) + _update_seconds(phases, step)


def _decode_seconds(phases: dict[str, float], step: StepShape) -> float:
    per_token = max(phases["decode"] - phases["prefill"], 0.0) / DECODE_TOKENS
    rounds = math.ceil(step.prompts / step.probe_prompts())
    return rounds * (phases["prefill"] + step.response_tokens * per_token)


def _update_seconds(phases: dict[str, float], step: StepShape) -> float:
    # a group's prompt is forwarded once (share_prompt_forward), each response once
    tokens = step.prompts * step.prompt_tokens + step.rows * step.response_tokens
    update = phases["update"] * tokens / (PROBE_ROWS * PROBE_TOKENS)
    return step.ppo_epochs * (update + step.refreshes * phases.get("refresh", 0.0))


def phase_seconds(
    config: Any, timer: Timer, step: StepShape, copies: bool = False
) -> dict[torch.dtype, dict[str, float]]:
    """Per dtype, the seconds of each probe phase that prices ``step`` (:meth:`StepShape.phases`: bf16
    from compute copies, with their refresh, when ``copies``) for the full-depth model, extrapolated
    from the two probe depths (module docstring); the timings alternate the dtypes, medians of
    :data:`PROBE_PAIRS`. Decoding samples like ``step`` (:meth:`StepShape.probe_prompts`)."""
    text = getattr(config, "text_config", None) or config
    depth = int(text.num_hidden_layers)
    depths = sorted({min(d, depth) for d in PROBE_DEPTHS})
    dtypes = (torch.float32, torch.bfloat16)
    phases = step.phases(copies)
    medians: dict[tuple[torch.dtype, str, int], float] = {}
    for d in depths:
        probe = _with_depth(config, d)
        for phase in phases:
            runs: dict[torch.dtype, list[float]] = {dtype: [] for dtype in dtypes}
            for dtype in runs:
                timer(probe, dtype, phase, step, copies)  # warm-up: allocations, oneDNN kernel selection
            for _ in range(PROBE_PAIRS):
                for dtype in runs:
                    runs[dtype].append(timer(probe, dtype, phase, step, copies))
            for dtype, times in runs.items():
                medians[dtype, phase, d] = statistics.median(times)
    d1, d2 = depths[0], depths[-1]
    out: dict[torch.dtype, dict[str, float]] = {}
    for dtype in dtypes:
        out[dtype] = {}
        for phase in phases:
            per_layer = (medians[dtype, phase, d2] - medians[dtype, phase, d1]) / max(d2 - d1, 1)
            out[dtype][phase] = max(medians[dtype, phase, d1] + (depth - d1) * per_layer, 1e-9)
    return out


def _with_depth(config: Any, depth: int) -> Any:
    probe = config.__class__.from_dict(config.to_dict())
    text = getattr(probe, "text_config", None) or probe
    text.num_hidden_layers = depth
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types)[:depth]
    return probe


def probe_seconds(
    config: Any, dtype: torch.dtype, phase: str, step: StepShape, copies: bool = False
) -> float:
    """CPU seconds (the process's, every thread: what the run pays whatever else the machine runs)
    of one probe run of ``phase`` on a random-weight model of ``config`` computing in ``dtype``: for
    bf16 under autocast, or from the model's bf16 compute copies (no autocast) when ``copies``.
    ``"update"``: one forward + backward of ``PROBE_ROWS × PROBE_TOKENS`` random tokens.
    ``"prefill"`` and ``"decode"``: the built-in engine sampling 1 and 1 + ``DECODE_TOKENS`` tokens,
    ``step.n`` samples of each of :meth:`StepShape.probe_prompts` random prompts of
    ``step.prompt_tokens`` tokens (at most ``DECODE_PROMPT_MAX``; no EOS can end them).
    ``"refresh"``: the copies' refresh after an optimizer step (0 for float32, which holds none). The
    model (and its copies, made at the first call that computes from them) is built once per config
    and kept for the next call (:func:`choose_cpu_dtype` drops it when done)."""
    from transformers import AutoModelForCausalLM  # heavy; only a native-bf16 CPU gets here

    key = config.to_json_string()
    model = _PROBES.get(key)
    if model is None:
        _PROBES.clear()  # one probe model at a time: memory stays one model's (and its copies')
        torch.manual_seed(0)
        # from a copy: from_config writes the dtype into the config it is given, which would change
        # the key and build the model again at the next call
        model = _PROBES[key] = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    held = _copies(model, dtype) if copies and dtype != torch.float32 else None
    if phase == "refresh":
        if held is None:
            return 0.0
        start = time.process_time()
        held.refresh()
        return time.process_time() - start
    text = getattr(config, "text_config", None) or config
    generator = torch.Generator().manual_seed(0)
    model.zero_grad(set_to_none=True)  # the masters' gradients, when the copies are swapped in below
    # the copies in the modules' slots for the pass, as the run's update and hybrid engine have them
    with held.active() if held is not None else contextlib.nullcontext():
        if phase == "update":
            ids = torch.randint(0, text.vocab_size, (PROBE_ROWS, PROBE_TOKENS), generator=generator)
            start = time.process_time()
            with autocast("cpu", dtype if held is None else None):  # copies compute bf16 as they are
                logits = model(input_ids=ids).logits
            loss = -logits.float().log_softmax(-1).mean()
            loss.backward()
            return time.process_time() - start
        engine = HFRollout(
            model, eos_token_ids=[text.vocab_size], pad_token_id=0, compute_dtype=dtype, cuda_graphs=False
        )
        shape = (step.probe_prompts(), min(step.prompt_tokens, DECODE_PROMPT_MAX))
        prompts = torch.randint(1, text.vocab_size, shape, generator=generator).tolist()
        tokens = 1 if phase == "prefill" else 1 + DECODE_TOKENS
        start = time.process_time()
        engine.generate(prompts, n=step.n, max_new_tokens=tokens, keys=list(range(len(prompts))))
        return time.process_time() - start


def _copies(model: torch.nn.Module, dtype: torch.dtype) -> ComputeCopies:
    """``model``'s compute copies in ``dtype``, attached at the first call (the run's, made by
    :func:`~tearless.models.copies.attach`: bf16 parameters, float32 buffers and gradients)."""
    held = getattr(model, "tearless_copies", None)
    return held if held is not None else attach(model, dtype)


_PROBES: dict[str, torch.nn.Module] = {}


def resolve_auto(cfg: Config, plan: RunPlan, *, gpu: bool, log) -> RunPlan:
    """``plan`` with every built role's ``fsdp_config.param_dtype=auto`` (the default for a pretrained
    model) resolved, before any rank is built: bfloat16 on GPU; on CPU the measured choice of
    :func:`choose_cpu_dtype` for the role's model (its weights from the plan's ``files``) and this
    run's step (its batch, prompt and response lengths), once per model. One line per choice; the
    config keeps its ``auto``.

    Roles reading one model share one choice, so one probe: its bf16 is timed from compute copies when
    the group's first built role (the actor, where it is in the group) would hold them were bf16
    chosen: its ``fsdp_config.compute_copies`` (:meth:`Sections.compute_copies`) in a run of one
    process (a sharded model computes under autocast). :meth:`RunPlan.holds_copies` cannot answer it:
    it reads the dtype being chosen here."""
    f = plan.files
    paths = {"actor": f.model_path, "ref": f.model_path, "teacher": f.teacher_path}
    paths["critic"] = f.critic_path or f.model_path
    sections = {
        "actor": "actor_rollout_ref.actor",
        "ref": "actor_rollout_ref.ref",
        "teacher": "actor_rollout_ref.teacher",
        "critic": "critic.model",
    }
    by_path: dict[str, list[str]] = {}
    for role in sections:
        if plan.param_dtype(role) == "auto" and role in plan.roles:  # a role not built stays unresolved
            by_path.setdefault(paths[role], []).append(role)
    choices: dict[str, str] = {}
    for path, roles in by_path.items():
        if gpu:
            choice = PrecisionChoice("bfloat16", "a GPU: bf16 tensor cores")
        else:
            from transformers import AutoConfig  # only a pretrained model's run resolves auto

            copies = plan.sections.compute_copies(roles[0]) and not plan.sharded("cpu", world_size(cfg))
            choice = choose_cpu_dtype(
                AutoConfig.from_pretrained(path),
                cache_dir=default_cache_dir(),
                threads=torch.get_num_threads(),
                step=_step_of(cfg, plan, roles),
                copies=copies,
            )
        choices.update(dict.fromkeys(roles, choice.dtype))
        log(choice.line(", ".join(sections[role] for role in roles)))
    return plan.with_dtypes(choices)


def _step_of(cfg: Config, plan: RunPlan, roles: list[str]) -> StepShape:
    """The step a group of roles reading one model prices: the run's batch and lengths; the epochs of
    its first role's update (the critic's own section for a critic; one pass for a frozen role's
    group, the reference's or teacher's log-probs, priced as an update) and the copies' refreshes
    (module docstring); its decoding counted only for the actor's group sampled by the built-in engine
    from the trained weights with ``rollout.dtype`` unset (the engine then computes in the actor's
    dtype: the one being chosen)."""
    first, prompts = roles[0], cfg.data.train_batch_size
    section = plan.critic_section if first == "critic" else cfg.actor_rollout_ref.actor
    trained = first == "critic" or (first == "actor" and plan.sections.model.lora_rank == 0)
    return StepShape(
        prompts=prompts,
        n=cfg.actor_rollout_ref.rollout.n,
        prompt_tokens=cfg.data.max_prompt_length,
        response_tokens=plan.response_length,
        ppo_epochs=section.ppo_epochs if first in ("actor", "critic") else 1,
        refreshes=max(1, prompts // section.ppo_mini_batch_size) if trained else 0,
        decodes="actor" in roles and not plan.separate_rollout and plan.rollout_dtype_name is None,
    )


def announce_autocast(plan: RunPlan, device: str, log, world_of: Callable[[str], int] = lambda _: 1) -> None:
    """One line naming the roles that compute under bf16 autocast on CPU (it changes speed and
    rounding; on a CPU whose bf16 is slower than float32 the user should know it is on), and one
    naming those that compute from bf16 compute copies (a role of one process, ``world_of(role)``
    its ranks, with ``fsdp_config.compute_copies``). Roles resolved from ``auto`` had their own line
    (:func:`resolve_auto`)."""
    if device != "cpu":
        return
    reduced = [
        r
        for r in plan.roles
        if compute_dtype(plan.param_dtype(r), device, "", warn=False) != torch.float32
        and r not in plan.auto_resolved
    ]
    copies = [role_key(r) for r in reduced if world_of(r) == 1 and plan.holds_copies(r, device)]
    keys = [role_key(r) for r in reduced if role_key(r) not in copies]
    hybrid = not plan.capabilities.holds_own_weights
    if hybrid and plan.hybrid_rollout_dtype(device, warn=False) != torch.float32:
        # the built-in engine samples from the actor's copies when the actor has them
        (copies if role_key("actor") in copies else keys).append("actor_rollout_ref.rollout.dtype")
    if keys:
        log(
            f"bf16 autocast is on ({', '.join(keys)}): matmuls in bfloat16, master weights, optimizer "
            "state and losses in float32; set those keys to float32 to turn it off"
        )
    if copies:
        log(
            f"bf16 compute copies are on ({', '.join(copies)}): the whole forward in bfloat16 from copies "
            "of the float32 master weights, optimizer state and losses in float32; set those keys to "
            "float32 to turn bf16 off, or their compute_copies=false for autocast"
        )
