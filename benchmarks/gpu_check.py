"""The GPU check (issue 31): one command that runs tearless's GPU paths on one GPU and says which hold.

    python benchmarks/gpu_check.py                 # on a GPU machine: ≤ 5 minutes on one H100
    python benchmarks/gpu_check.py --dry-run       # the same checks on CPU, tiny sizes (CI runs this)
    python benchmarks/gpu_check.py --tier real     # the real-scale tier (benchmarks/gpu_scale.py)

Each check prints its numbers and a ``PASS``/``FAIL`` line; the last line is
``gpu_check: N passed, M failed`` (exit status 1 when any failed). ``--out DIR`` also writes every
number to ``DIR/gpu_check.json``. No network: the embedded task and a randomly initialised model of
SmolLM2-135M's shape are built on the spot.

The checks:

1. ``grpo_fp32_resume``: the single-process GRPO run on the embedded task in float32, stopped halfway
   by its step budget and resumed from its checkpoint; s/step and peak GPU memory.
2. ``grpo_bf16_packed``: the same run in the GPU default (bf16 autocast over float32 master weights,
   TF32 on) with padding removed (``use_remove_padding``: torch's varlen flash attention on GPU).
3. ``fsdp_offload``: FSDP2 over a one-rank NCCL group through the real ``Rank`` code, with
   ``param_offload``, ``optimizer_offload`` and both: two updates, a checkpoint and a resumed update.
4. ``rank_sharded_logprobs``: the in-process worker group's actor log-probs with its one rank's actor
   sharded (FSDP2 over a one-rank group) against unsharded.
5. ``weight_broadcast``: the split placement's weight-broadcast group at one rank.
6. ``packed_attention``: packed (varlen) against padded attention, forward and backward, on the
   135M-shaped model in bf16.
7. ``decode_loop``: tokens/s of the CPU-style decode loop, the static loop and the static loop with
   its decode step replayed as a CUDA graph, on the 135M-shaped model, 64 sequences; greedy tokens of
   the three compared in float32.
8. ``update_precision``: one actor update (packed log-probs, backward, AdamW) on the 135M-shaped
   model, 64 × (64 + ≤128) tokens, in float32 (TF32) and in bf16 autocast: seconds and peak memory.
9. ``grpo_default_bf16``: the default run's 125 steps in the GPU default precision; greedy held-out
   accuracy before and after (the CPU figure: 0.485 → 0.885).

On a CPU (``--dry-run``, or no GPU) the same code runs with gloo in NCCL's place, no CUDA graphs and
small sizes, so the script cannot rot between the rare sessions that have a GPU.

``--tier real`` runs instead, for each of ``--shapes`` (Qwen2.5-0.5B and 1.5B by default), the
``update_<shape>``, ``decode_<shape>``, ``update_<shape>_compiled`` and ``update_<shape>_copies``
checks of :mod:`gpu_scale` (``--sequences`` rows of a ``--prompt``-token prompt and a
``--response``-token response): s/update, tokens/s, MFU, peak memory beside the start-up estimate
(autocast, with the decoder layers compiled, and from bf16 compute copies); decode tokens/s, its
share of the HBM-bandwidth limit and HF generate's.
Its dry run uses a tiny shape.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import socket
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

RESULTS: list[dict] = []
# Where each check's result is written as soon as it ends (``--out``): a run stopped by the device's time
# limit still returns the checks it finished.
OUT: list[Path] = []


def write_results() -> None:
    for out in OUT:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(RESULTS, indent=1))
        tmp.replace(out / "gpu_check.json")


def check(name: str) -> Callable[[Callable[..., dict]], Callable[..., None]]:
    """Run the wrapped check, print its numbers and PASS/FAIL, and record them."""

    def wrap(fn: Callable[..., dict]) -> Callable[..., None]:
        def run(*args, **kwargs) -> None:
            start = time.perf_counter()
            try:
                numbers = fn(*args, **kwargs)
                ok, why = bool(numbers.pop("ok")), numbers.pop("why", "")
            except Exception as e:  # a failing check is reported, and the next one still runs
                numbers, ok, why = {}, False, f"{type(e).__name__}: {e}"
                traceback.print_exc(limit=6)
            numbers["seconds"] = round(time.perf_counter() - start, 1)
            RESULTS.append({"check": name, "ok": ok, "why": why, **numbers})
            write_results()
            shown = "  ".join(f"{k}={v}" for k, v in numbers.items())
            print(f"{'PASS' if ok else 'FAIL'} {name}: {shown}{'  -- ' + why if why else ''}", flush=True)
            gc.collect()  # a check's model can sit in a reference cycle: freed before the next check's peak
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

        return run

    return wrap


def peak_gib() -> float:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


# ---------------------------------------------------------------------------------------- RL runs
def overrides(task, run_dir: Path, device: str, steps: int, *extra: str) -> list[str]:
    return [
        f"actor_rollout_ref.model.path={task.model_dir}",
        f"data.train_files={task.train_file}",
        f"data.val_files={task.val_file}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.device={device}",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[jsonl]",
        "data.val_max_samples=64",
        "reward_model.num_workers=0",
        *extra,
    ]


def run_rl(args: list[str], log: list[str]) -> dict:
    import tearless

    return tearless.train(overrides=args, log=log.append)


def step_numbers(run_dir: Path, first: int) -> dict:
    from tearless.run.tracking import read_metrics

    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "timing_s/step" in r]
    later = [r["timing_s/step"] for r in records if r["step"] >= first]
    losses = [r.get("actor/pg_loss", 0.0) for r in records]
    return {
        "steps": len(records),
        "s_per_step": round(sorted(later)[len(later) // 2], 3) if later else float("nan"),
        "finite": all(math.isfinite(x) for x in losses),
    }


def accuracy(summary: dict) -> tuple[float, float]:
    """Greedy held-out accuracy before and after a run (NaN where the run did not validate)."""

    def greedy(metrics: dict | None) -> float:
        key = next((k for k in metrics or {} if k.endswith("/acc/greedy")), None)
        return round(metrics[key], 3) if key else float("nan")

    return greedy(summary.get("before")), greedy(summary.get("after"))


@check("grpo_fp32_resume")
def grpo_fp32_resume(task, work: Path, device: str, steps: int) -> dict:
    run_dir = work / "fp32"
    fp32 = ["actor_rollout_ref.actor.fsdp_config.param_dtype=float32", f"trainer.save_freq={steps // 2}"]
    log: list[str] = []
    reset_peak()
    first = run_rl(overrides(task, run_dir, device, steps // 2, *fp32), log)
    second = run_rl(overrides(task, run_dir, device, steps, *fp32), log)  # validates only after
    numbers = step_numbers(run_dir, 2)
    resumed = any("resum" in line.lower() for line in log)
    before, after = accuracy(first)[0], accuracy(second)[1]
    ok = numbers["steps"] == steps and numbers["finite"] and resumed
    return {**numbers, "peak_gib": peak_gib(), "resumed": resumed, "acc_before": before, "acc_after": after,
            "ok": ok}  # fmt: skip


@check("grpo_bf16_packed")
def grpo_bf16_packed(task, work: Path, device: str, steps: int) -> dict:
    run_dir = work / "bf16"
    log: list[str] = []
    reset_peak()
    summary = run_rl(
        overrides(task, run_dir, device, steps, "actor_rollout_ref.model.use_remove_padding=true"), log
    )
    numbers = step_numbers(run_dir, 2)
    before, after = accuracy(summary)
    ok = numbers["steps"] == steps and numbers["finite"]
    return {**numbers, "peak_gib": peak_gib(), "acc_before": before, "acc_after": after, "ok": ok}


@check("fsdp_offload")
def fsdp_offload(task, work: Path, device: str) -> dict:
    done = {}
    for name, flags in {
        "param": ["param_offload=true"],
        "optimizer": ["optimizer_offload=true"],
        "both": ["param_offload=true", "optimizer_offload=true"],
    }.items():
        run_dir = work / f"offload-{name}"
        extra = [f"actor_rollout_ref.actor.fsdp_config.{f}" for f in flags]
        extra += ["trainer.save_freq=2", "trainer.val_before_train=false"]
        log: list[str] = []
        run_rl(overrides(task, run_dir, device, 2, *extra), log)  # two updates and a checkpoint
        run_rl(overrides(task, run_dir, device, 3, *extra), log)  # resumed: optimizer state reloaded
        done[name] = step_numbers(run_dir, 1)["steps"] == 3 and any("resum" in x.lower() for x in log)
    return {**{f"{k}_ok": v for k, v in done.items()}, "ok": all(done.values())}


# ---------------------------------------------------------------------------------------- ranks
def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@check("rank_sharded_logprobs")
def rank_sharded_logprobs(task, device: str) -> dict:
    from tensordict import TensorDict

    from tearless.config import load_config
    from tearless.data import render_prompt
    from tearless.models.loading import load_tokenizer
    from tearless.rollout.hf import left_pad
    from tearless.workers.placement import make_workers
    from tearless.workers.spec import RankSpec

    cfg = load_config(
        None,
        [f"trainer.device={device}", "actor_rollout_ref.actor.fsdp_config.param_dtype=float32",
         "reward_model.num_workers=0"],
        notify=lambda _: None,
    )  # fmt: skip
    tok = load_tokenizer(task.model_dir)
    prompts = [render_prompt(tok, [{"role": "user", "content": q}]) for q in ("1+2=", "47+38=", "7+8=")]
    ids, mask = left_pad(prompts, tok.pad_token_id)
    response = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    td = TensorDict(
        {"prompt_ids": ids, "prompt_mask": mask, "response_ids": response,
         "response_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])},
        batch_size=[3],
    )  # fmt: skip
    out = {}
    for sharded in (False, True):
        # The trainer's in-process group; sharded, its one rank shards the actor over a one-rank group.
        spec = RankSpec(cfg, ("actor",), False, task.model_dir, 1, device, sharded=sharded)
        workers = make_workers(spec, tok.pad_token_id)
        try:
            out[sharded] = workers.compute_log_prob("actor", td)[0]
            kind = type(workers.rank.roles["actor"].model).__name__
        finally:
            workers.close()
    diff = float((out[True] - out[False]).abs().max())
    # Float32 (TF32 matmuls on GPU: ~1e-3 relative) forwards of the same weights: only rounding differs.
    return {
        "max_abs_diff": f"{diff:.2e}",
        "sharded_class": kind,
        "ok": diff < 5e-3 and kind.startswith("FSDP"),
    }


@check("weight_broadcast")
def weight_broadcast(device: str) -> dict:
    from tearless.distributed.weight_sync import WeightBroadcast

    sync = WeightBroadcast(free_address(), 0, 1, device=torch.device(device), timeout_s=60)
    k = sync.announce(7)
    x = torch.arange(12.0, device=device).reshape(3, 4)
    y = sync.broadcast(x.clone())
    return {"announced": sync.announced(), "version": sync.version_of(k),
            "ok": torch.equal(x, y) and sync.announced() == 1 and sync.version_of(k) == 7}  # fmt: skip


# ---------------------------------------------------------------------------------------- kernels
def smol_shaped(device: str, dry: bool, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random Llama of SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 heads / 3 KV heads,
    MLP 1536, 49,152-token vocabulary, tied embeddings); much smaller in a dry run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    size = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)
        if dry
        else dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, vocab_size=49152)
    )
    config = LlamaConfig(
        **size, num_attention_heads=9 if not dry else 4, num_key_value_heads=3 if not dry else 2,
        max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


@check("packed_attention")
def packed_attention(device: str, dry: bool) -> dict:
    from tearless.models import packing
    from tearless.models.logprobs import response_logprobs
    from tearless.models.precision import set_compute_dtype

    model = smol_shaped(device, dry)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    set_compute_dtype(model, dtype)
    g = torch.Generator().manual_seed(1)
    rows, p, r = (16, 64, 128) if not dry else (4, 6, 8)
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab, (rows, p), generator=g)
    prompt_mask = (torch.arange(p)[None] >= torch.randint(0, p // 2, (rows, 1), generator=g)).long()
    response = torch.randint(3, vocab, (rows, r), generator=g)
    lengths = torch.randint(r // 4, r + 1, (rows,), generator=g)
    response_mask = (torch.arange(r)[None] < lengths[:, None]).long()
    out, seconds, calls = {}, {}, {"varlen": 0}
    varlen_causal = packing.varlen_causal

    def counted(*a, **k):  # which kernel the packed forward took
        calls["varlen"] += 1
        return varlen_causal(*a, **k)

    packing.varlen_causal = counted
    for packed in (False, True):
        for _ in range(2):  # the second pass is timed (the first compiles and warms up)
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            lp, _ = response_logprobs(
                model, prompt, prompt_mask, response, response_mask,
                temperature=1.0, remove_padding=packed, share_prompts=False,
            )  # fmt: skip
            (lp * response_mask.to(lp.device)).sum().backward()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds[packed] = time.perf_counter() - start
        out[packed] = lp.detach().float().cpu()
    packing.varlen_causal = varlen_causal
    used_varlen = calls["varlen"] > 0
    diff = float(((out[True] - out[False]) * response_mask).abs().max())
    # bf16 products (unit roundoff 2⁻⁸) through 30 layers in two attention layouts: log-probs of a
    # 49k vocabulary agree to a few hundredths; float32 (dry run) to ~1e-5.
    bound = 0.15 if dtype == torch.bfloat16 else 1e-3
    return {"varlen_kernel": used_varlen, "max_abs_diff": f"{diff:.3g}", "bound": bound,
            "padded_ms": round(1000 * seconds[False], 1), "packed_ms": round(1000 * seconds[True], 1),
            "ok": diff < bound and (used_varlen or device != "cuda")}  # fmt: skip


@check("decode_loop")
def decode_loop(device: str, dry: bool) -> dict:
    from tearless.rollout.hf import HFRollout

    cuda = device == "cuda"
    model = smol_shaped(device, dry)
    g = torch.Generator().manual_seed(2)
    count, length, new = (64, 32, 64) if not dry else (4, 5, 6)
    prompts = [
        torch.randint(3, model.config.vocab_size, (length - i % 7,), generator=g).tolist()
        for i in range(count)
    ]
    engine = HFRollout(
        model, eos_token_ids=[2], pad_token_id=0, compute_dtype=torch.bfloat16 if cuda else None
    )
    variants = {"cpu_loop": (False, False), "static": (True, False), "static_graphs": (True, True)}
    speed, greedy = {}, {}
    for name, (static, graphs) in variants.items():
        engine.static_loop, engine.cuda_graphs = static, graphs
        engine.generate(prompts[:4], n=1, max_new_tokens=4, temperature=1.0, keys=list(range(4)))  # warm-up
        times = []
        for rep in range(3):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = engine.generate(
                prompts, n=1, max_new_tokens=new, temperature=1.0, keys=list(range(rep, rep + count))
            )
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        tokens = int(out.response_mask.sum())
        speed[name] = round(tokens / sorted(times)[1])
    # Greedy tokens in float32 without TF32: the three loops must agree (ties aside, exactly).
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    engine.compute_dtype = None
    for name, (static, graphs) in variants.items():
        engine.static_loop, engine.cuda_graphs = static, graphs
        greedy[name] = engine.generate(prompts, n=1, max_new_tokens=new, do_sample=False).response_ids
    torch.set_float32_matmul_precision(precision)
    ref = greedy["cpu_loop"]
    agree = {k: round(float((v == ref).float().mean()), 4) for k, v in greedy.items() if k != "cpu_loop"}
    graphs_exact = torch.equal(greedy["static"], greedy["static_graphs"])
    numbers = {f"{k}_tok_s": v for k, v in speed.items()} | {f"{k}_greedy_agree": v for k, v in agree.items()}
    return {**numbers, "graphs_exact": graphs_exact, "ok": graphs_exact and min(agree.values()) >= 0.99}


@check("update_precision")
def update_precision(device: str, dry: bool) -> dict:
    """One actor update step (packed log-probs of every response token, backward, AdamW) on the
    135M-shaped model: float32 weights computing in float32 (TF32 matmuls on GPU) against bf16 autocast."""
    from tearless.models.logprobs import response_logprobs
    from tearless.models.precision import configure_cuda, set_compute_dtype

    if device == "cuda":
        configure_cuda()
    g = torch.Generator().manual_seed(3)
    rows, p, r = (64, 64, 128) if not dry else (4, 6, 8)
    vocab = 49152 if not dry else 512
    prompt = torch.randint(3, vocab, (rows, p), generator=g)
    prompt_mask = torch.ones(rows, p, dtype=torch.long)
    response = torch.randint(3, vocab, (rows, r), generator=g)
    response_mask = (torch.arange(r)[None] < torch.randint(r // 2, r + 1, (rows, 1), generator=g)).long()
    seconds, peak, losses = {}, {}, {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = smol_shaped(device, dry)
        if dtype != torch.float32:
            set_compute_dtype(model, dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        times = []
        reset_peak()
        for _ in range(4):  # the first step allocates AdamW's moments and warms the kernels up
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            lp, _ = response_logprobs(
                model, prompt, prompt_mask, response, response_mask,
                temperature=1.0, remove_padding=True, share_prompts=False,
            )  # fmt: skip
            loss = -(lp * response_mask.to(lp.device)).sum() / response_mask.sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds[name], peak[name], losses[name] = sorted(times[1:])[1], peak_gib(), float(loss.detach())
        del model, opt
    return {"fp32_s": round(seconds["fp32"], 4), "bf16_s": round(seconds["bf16"], 4),
            "speedup": round(seconds["fp32"] / seconds["bf16"], 2), "fp32_peak_gib": peak["fp32"],
            "bf16_peak_gib": peak["bf16"], "ok": all(math.isfinite(x) for x in losses.values())}  # fmt: skip


@check("grpo_default_bf16")
def grpo_default_bf16(task, work: Path, device: str, steps: int) -> dict:
    """The default run (the default task, 125 steps of 16 prompts × 8 responses) in the GPU default
    precision; a dry run keeps the small task."""
    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    if device == "cuda":
        cache = os.environ.get("TEARLESS_CACHE", str(work / "cache"))
        task = prepare_task(TaskSpec(), cache, log=lambda _: None)
    run_dir = work / "default"
    log: list[str] = []
    reset_peak()
    summary = run_rl(overrides(task, run_dir, device, steps, "data.val_max_samples=-1"), log)
    numbers = step_numbers(run_dir, 2)
    before, after = accuracy(summary)
    return {**numbers, "peak_gib": peak_gib(), "acc_before": before, "acc_after": after,
            "ok": numbers["steps"] == steps and numbers["finite"]}  # fmt: skip


# ---------------------------------------------------------------------------------------- real scale
def real_scale_checks(task, device: str, args) -> dict[str, Callable[[], None]]:
    """The real-scale tier's checks (benchmarks/gpu_scale.py): per shape one update, one decode and
    one update per variant (``gpu_scale.VARIANTS``: compiled layers, compute copies)."""
    import gpu_scale  # beside this script: python puts its directory first on sys.path

    shapes = ["dry"] if device == "cpu" else args.shapes.split(",")
    rows, prompt, response = (16, 8, 16) if device == "cpu" else (args.sequences, args.prompt, args.response)
    checks: dict[str, Callable[[], None]] = {}
    for shape in shapes:

        @check(f"update_{shape}")
        def update(shape=shape) -> dict:
            numbers = gpu_scale.update(task, shape, device, rows, prompt, response, repeats=2)
            return {**numbers, "ok": numbers["finite"]}

        @check(f"decode_{shape}")
        def decode(shape=shape) -> dict:
            numbers = gpu_scale.decode(shape, device, rows, prompt, response)
            return {**numbers, "ok": numbers["tok_s"] > 0 and numbers["hf_generate_tok_s"] > 0}

        checks[f"update_{shape}"], checks[f"decode_{shape}"] = update, decode
        for variant in gpu_scale.VARIANTS:
            if not variant:
                continue

            @check(f"update_{shape}{variant}")
            def update_variant(shape=shape, variant=variant) -> dict:
                numbers = gpu_scale.update(task, shape, device, rows, prompt, response, 2, variant)
                return {**numbers, "ok": numbers["finite"]}

            checks[f"update_{shape}{variant}"] = update_variant
    return checks


def fit_checks(task, device: str, args) -> dict[str, Callable[[], None]]:
    """The fit tier's checks (``gpu_scale.FITS``): the largest models per card, 2 training steps each
    (rollout, then update), peak memory beside the start-up estimate."""
    import gpu_scale

    rows, prompt, response = (16, 8, 16) if device == "cpu" else (args.sequences, args.prompt, args.response)
    checks: dict[str, Callable[[], None]] = {}
    for name in gpu_scale.FITS:

        @check(f"fit_{name}")
        def fit(name=name) -> dict:
            numbers = gpu_scale.fit(task, name, device, rows, prompt, response)
            return {**numbers, "ok": numbers["finite"]}

        checks[f"fit_{name}"] = fit
    return checks


# ---------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run on CPU with tiny sizes (CI)")
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps of the two runs (20; dry 2)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="write gpu_check.json here")
    parser.add_argument("--only", nargs="*", default=None, help="run only these checks")
    parser.add_argument(
        "--tier", choices=("basic", "real", "fit"), default="basic",
        help="real: gpu_scale.py's update and decode checks; fit: its largest models per card",
    )  # fmt: skip
    parser.add_argument("--shapes", default="0.5b,1.5b", help="real tier: Qwen2.5 shapes (0.5b, 1.5b)")
    parser.add_argument("--sequences", type=int, default=128, help="real and fit tiers: rows (64-256)")
    parser.add_argument("--prompt", type=int, default=128, help="real and fit tiers: prompt tokens")
    parser.add_argument("--response", type=int, default=1024, help="real and fit tiers: response tokens")
    args = parser.parse_args(argv)
    dry = args.dry_run or not torch.cuda.is_available()
    device = "cpu" if dry else "cuda"
    steps = args.steps or (2 if dry else 20)
    import transformers

    from tearless.tasks.bootstrap import TaskSpec
    from tearless.trainers.warmup import prepare_task

    # torch.compile's GPU kernels (triton) build small C launchers: without a C compiler and Python's
    # headers the compiled checks fail, and this line says why
    headers = Path(sysconfig.get_paths()["include"], "Python.h").exists()
    print(f"gpu_check: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"device {torch.cuda.get_device_name(0) if not dry else 'cpu (dry run)'}, "
          f"C compiler {shutil.which('gcc') or shutil.which('cc') or 'none'}, Python.h "
          f"{'found' if headers else 'missing'}", flush=True)  # fmt: skip
    OUT.extend([Path(args.out)] if args.out else [])
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    tiers = {"real": real_scale_checks, "fit": fit_checks}
    # the real and fit tiers read only the task's tokenizer: its model needs no real warm-up
    spec = TaskSpec(num_train=400, num_val=100, warmup_steps=20 if dry or args.tier in tiers else 300)
    task = prepare_task(spec, os.environ.get("TEARLESS_CACHE", str(work / "cache")), log=lambda _: None)
    checks = (
        tiers[args.tier](task, device, args)
        if args.tier in tiers
        else {
            "grpo_fp32_resume": lambda: grpo_fp32_resume(task, work, device, steps),
            "grpo_bf16_packed": lambda: grpo_bf16_packed(task, work, device, steps),
            "fsdp_offload": lambda: fsdp_offload(task, work, device),
            "rank_sharded_logprobs": lambda: rank_sharded_logprobs(task, device),
            "weight_broadcast": lambda: weight_broadcast(device),
            "packed_attention": lambda: packed_attention(device, dry),
            "decode_loop": lambda: decode_loop(device, dry),
            "update_precision": lambda: update_precision(device, dry),
            "grpo_default_bf16": lambda: grpo_default_bf16(task, work, device, 2 if dry else 125),
        }
    )
    for name, run in checks.items():
        if args.only is None or name in args.only:
            run()
    passed = sum(r["ok"] for r in RESULTS)
    print(f"gpu_check: {passed} passed, {len(RESULTS) - passed} failed")
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
