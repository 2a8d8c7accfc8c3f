"""tearless against TRL's ``GRPOTrainer`` on every axis of issue 23, in one command.

The grid (each point a ``diverge`` case of ``cases.py``: an untrained 4-layer Llama over a 1,024-token
vocabulary, so that every sample differs from its first token and runs to the length cap or near it;
the ``long_addition`` prompts and graded reward; 8 generations per prompt; no reference model):

- response length 16 / 64 / 256 at hidden 256, 64 completions per step;
- hidden size 256 / 512 / 1024 at length 64, 64 completions;
- completions per step 64 / 256 at length 64, hidden 256.

Shared points are run once: six points in all. Every run is one ``vs_trl.py`` worker in a fresh
process (same settings in both frameworks, see BENCHMARKS.md); a round runs every point once in each
framework, the two runs of a point back to back, tearless first in odd rounds and TRL first in even
ones. Per point: each framework's s/step (the median of a run's steps after the first, warm-up
step) as the median over rounds with min and max, the TRL / tearless ratio of each round (median,
min, max), the mean response length and mean reward of each framework's own rollouts, peak RSS.
Held-out accuracy is 0 for an untrained model by construction, so it is off by default
(``--eval-prompts N`` turns the shared greedy evaluation on). Output: a markdown table, and JSON
(``--out``).

    OMP_NUM_THREADS=1 python benchmarks/vs_trl_axes.py                 # the grid, ~20 min idle
    OMP_NUM_THREADS=1 python benchmarks/vs_trl_axes.py --smoke         # every point, 2 steps, 1 round
    OMP_NUM_THREADS=1 python benchmarks/vs_trl_axes.py --points L256-H256-C64,L64-H1024-C64 --rounds 5

Steps per run: by default one warm-up step plus as many timed steps as fit in ~15 s of the point's
estimated TRL step time (1 to 5); ``--steps`` sets one count for every point. ``--tearless-set
KEY=VALUE`` (repeatable) adds tearless overrides, to measure a lever (e.g.
``actor_rollout_ref.model.use_remove_padding=true``) against the same TRL runs; the JSON records
them. ``--trl-bf16`` runs TRL with ``bf16=True`` (pair it with tearless's
``actor_rollout_ref.actor.fsdp_config.param_dtype=bfloat16`` for equal precision). Before it
starts the script prints its runtime estimate for an idle machine (see
:func:`estimate_s`); the times are meaningful only on an idle machine (BENCHMARKS.md, "Machine and
load").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cases import DIVERGE_LAYERS, DIVERGE_NAME, DIVERGE_VOCAB, diverge_name, make_case
from vs_trl import SET_HELP, TRL_BF16_HELP, run_fresh

AXES: dict[str, list[tuple[int, int, int]]] = {  # (response length, hidden size, completions per step)
    "length": [(16, 256, 64), (64, 256, 64), (256, 256, 64)],
    "hidden": [(64, 256, 64), (64, 512, 64), (64, 1024, 64)],
    "completions": [(64, 256, 64), (64, 256, 256)],
}
GRID = list(dict.fromkeys(p for points in AXES.values() for p in points))

# TRL / tearless s/step predicted per point before measuring, from the figures on diverging
# samples (64 tokens 1.07-1.12x, 256 tokens 1.33-1.48x, hidden 1024 1.37-1.54x) and the share of
# the update that the prompt forwarded once saves (a 15-token prompt: 48% of a 16-token sample's
# tokens, 19% at 64 tokens, 6% at 256).
PREDICTED = {
    (16, 256, 64): (1.3, 1.6),
    (64, 256, 64): (1.07, 1.15),
    (256, 256, 64): (1.3, 1.5),
    (64, 512, 64): (1.15, 1.35),
    (64, 1024, 64): (1.35, 1.55),
    (64, 256, 256): (1.07, 1.2),
}
PROMPT_TOKENS = 15  # ``<|user|>`` + 12 characters + ``<|end|><|assistant|>``
FLOPS_PER_S = 60e9  # fp32 on one core of this machine: TRL's medium-case step runs at ~67 GFLOP/s
STARTUP_S = 10.0  # a fresh process: imports, model and data loading, the trainer's set-up
TIMED_BUDGET_S = 15.0


def label(point: tuple[int, int, int]) -> str:
    return diverge_name(*point).removeprefix("diverge-")


def parse_point(text: str) -> tuple[int, int, int]:
    match = DIVERGE_NAME.fullmatch(f"diverge-{text.strip()}")
    if match is None:
        sys.exit(f"--points: {text!r} is not L<length>-H<hidden>-C<completions>, e.g. L64-H256-C64")
    length, hidden, completions = (int(g) for g in match.groups())
    return length, hidden, completions


def step_flops(length: int, hidden: int, completions: int) -> float:
    """FLOPs of one GRPO step that forwards every token of every sample (TRL's work here).

    A forward costs :math:`2P + 2 \\ell h T` per token (:math:`P = 13 h^2 \\ell + V h`: attention
    4h², SwiGLU 9h² per layer, the tied output layer; attention scores and values over the average
    context :math:`T / 2` of a :math:`T = 15 + L`-token sequence); the step forwards each token
    once in the rollout and once plus a backward (2×) in the update: 4 forwards' worth.
    """
    params = 13 * hidden**2 * DIVERGE_LAYERS + DIVERGE_VOCAB * hidden
    tokens = PROMPT_TOKENS + length
    per_token = 2 * params + 2 * DIVERGE_LAYERS * hidden * tokens
    return 4 * per_token * tokens * completions


def estimate_step_s(point: tuple[int, int, int]) -> tuple[float, float]:
    """(tearless, TRL) seconds per step predicted on an idle machine: TRL at ``FLOPS_PER_S``,
    tearless faster by the middle of the point's predicted ratio (1.2 off the grid)."""
    trl = step_flops(*point) / FLOPS_PER_S
    lo, hi = PREDICTED.get(point, (1.2, 1.2))
    return trl / ((lo + hi) / 2), trl


def default_steps(point: tuple[int, int, int]) -> int:
    """One warm-up step and as many timed steps as fit in ``TIMED_BUDGET_S`` of TRL time (1-5)."""
    return 1 + max(1, min(5, int(TIMED_BUDGET_S // estimate_step_s(point)[1])))


def estimate_s(steps: dict[tuple[int, int, int], int], rounds: int) -> float:
    """Idle wall time of the whole invocation: every run's start-up and steps, every round."""
    per_round = sum(2 * STARTUP_S + n * sum(estimate_step_s(p)) for p, n in steps.items())
    return rounds * per_round


def spread(values: list[float], fmt: str = "{:.3f}") -> str:
    """``median (min–max)`` of ``values``."""
    med = fmt.format(statistics.median(values))
    if len(values) == 1:
        return med
    return f"{med} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def summarise(point: tuple[int, int, int], runs: dict[str, list[dict]]) -> dict:
    step = {k: [statistics.median(r["step_s"][1:]) for r in v] for k, v in runs.items()}
    ratios = [b / a for a, b in zip(step["tearless"], step["trl"], strict=True)]
    out = {
        "s_per_step": {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "per_round": v}
                       for k, v in step.items()},
        "ratio_trl_over_tearless": {"median": statistics.median(ratios), "min": min(ratios),
                                    "max": max(ratios), "per_round": ratios},
        "predicted_ratio": PREDICTED.get(point),
        "mean_response_length": {k: statistics.mean(x for r in v for x in r["response_length"])
                                 for k, v in runs.items()},
        "mean_reward": {k: statistics.mean(x for r in v for x in r["reward"]) for k, v in runs.items()},
        "peak_rss_mb": {k: max(max(r["peak_rss_mb"]) for r in v) for k, v in runs.items()},
    }  # fmt: skip
    if "acc" in runs["tearless"][0]:
        out["held_out_acc"] = {k: [r["acc"] for r in v] for k, v in runs.items()}
        out["held_out_score"] = {k: [r["score"] for r in v] for k, v in runs.items()}
    return out


def table(points: list[tuple[int, int, int]], summary: dict[str, dict]) -> str:
    rows = [
        "| point (length, hidden, completions) | axes | tearless s/step | TRL s/step | TRL / tearless "
        "per round | predicted | mean response length (tearless / TRL) | mean reward (tearless / TRL) "
        "| peak RSS MiB (tearless / TRL) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        s = summary[label(p)]
        axes = ", ".join(a for a, ps in AXES.items() if p in ps) or "off the grid"
        pred = f"{s['predicted_ratio'][0]:.2f}–{s['predicted_ratio'][1]:.2f}" if s["predicted_ratio"] else "—"
        length, reward, rss = s["mean_response_length"], s["mean_reward"], s["peak_rss_mb"]
        rows.append(
            f"| {p[0]}, {p[1]}, {p[2]} | {axes} | {spread(s['s_per_step']['tearless']['per_round'])} "
            f"| {spread(s['s_per_step']['trl']['per_round'])} "
            f"| **{spread(s['ratio_trl_over_tearless']['per_round'], '{:.2f}')}** | {pred} "
            f"| {length['tearless']:.1f} / {length['trl']:.1f} "
            f"| {reward['tearless']:.3f} / {reward['trl']:.3f} "
            f"| {rss['tearless']:.0f} / {rss['trl']:.0f} |"
        )
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", help="comma-separated L<length>-H<hidden>-C<completions> (default: the grid)")
    ap.add_argument("--steps", type=int, help="GRPO steps per run, the first a warm-up (default: per point)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every point in both frameworks")
    ap.add_argument("--smoke", action="store_true", help="check every point works: 2 steps, 1 round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-prompts", type=int, default=0, help="held-out prompts for greedy accuracy")
    ap.add_argument("--out", default="vs_trl_axes.json", help="where the JSON report goes")
    ap.add_argument("--tearless-set", action="append", default=[], metavar="KEY=VALUE", help=SET_HELP)
    ap.add_argument("--trl-bf16", action="store_true", help=TRL_BF16_HELP)
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.rounds = 2, 1
    if args.steps is not None and args.steps < 2:
        sys.exit(
            "--steps must be at least 2: the first step of every run is a warm-up, left out of the timings"
        )
    points = [parse_point(t) for t in args.points.split(",")] if args.points else GRID
    for p in points:
        try:
            make_case(diverge_name(*p))  # build every model and data file before the first timed run
        except ValueError as e:
            sys.exit(f"--points: {e}")
    steps = {p: args.steps or default_steps(p) for p in points}
    print(
        f"{len(points)} points × {args.rounds} round(s) × 2 frameworks; steps per run "
        + ", ".join(f"{label(p)}: {n}" for p, n in steps.items())
        + f"; estimated {estimate_s(steps, args.rounds) / 60:.1f} min on an idle machine "
        f"(load now {os.getloadavg()[0]:.2f})",
        flush=True,
    )
    started = time.perf_counter()
    runs = {label(p): {"tearless": [], "trl": []} for p in points}
    for r in range(args.rounds):
        order = ("tearless", "trl") if r % 2 == 0 else ("trl", "tearless")
        for p in points:
            for name in order:
                case = diverge_name(*p)
                result = run_fresh(
                    name,
                    case,
                    steps[p],
                    args.threads,
                    args.seed,
                    args.eval_prompts,
                    args.tearless_set,
                    args.trl_bf16,
                )
                runs[label(p)][name].append(result)
                print(
                    f"round {r + 1} {label(p):15s} {name:8s}: "
                    f"{statistics.median(result['step_s'][1:]):.3f} s/step "
                    f"(steps {', '.join(f'{t:.2f}' for t in result['step_s'])}), "
                    f"mean response length {statistics.mean(result['response_length']):.1f}, "
                    f"reward {statistics.mean(result['reward']):.3f}, "
                    f"{result['wall_s']:.0f} s in all, load {result['load_before']:.2f} -> "
                    f"{result['load_after']:.2f}",
                    flush=True,
                )
    summary = {label(p): summarise(p, runs[label(p)]) for p in points}
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{args.threads} thread(s)",
        "settings": {"rounds": args.rounds, "steps": {label(p): n for p, n in steps.items()},
                     "tearless_set": args.tearless_set, "trl_bf16": args.trl_bf16,
                     "seed": args.seed, "smoke": args.smoke, "estimated_s": estimate_s(steps, args.rounds)},
        "wall_s": time.perf_counter() - started,
        "summary": summary,
        "runs": runs,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1))
    print()
    print(table(points, summary))
    print(f"\n{report['wall_s'] / 60:.1f} min in all; JSON in {args.out}")


if __name__ == "__main__":
    main()
