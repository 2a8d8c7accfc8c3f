"""Synthetic metric histories: a healthy GRPO-with-critic-metrics run, and pathologies planted in it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

STEPS = 20


def healthy(steps: int = STEPS) -> list[dict]:
    """A run that learns: reward 0.3 → ~0.7, entropy drifting down slowly, small clip fraction and KL,
    a critic that explains half the variance, nothing truncated, most groups kept."""
    history: list[dict] = [{"step": 0, "val-core/arith/acc/greedy": 0.40, "val-core/arith/acc/mean@4": 0.35}]
    for s in range(1, steps + 1):
        history.append(
            {
                "step": s,
                "critic/score/mean": 0.3 + 0.02 * s,
                "reward/accuracy": 0.3 + 0.02 * s,
                "reward/failures": 0.0,
                "actor/entropy": 1.0 - 0.01 * s,
                "actor/pg_loss": -0.01 + 0.002 * (s % 3),
                "actor/pg_clipfrac": 0.02,
                "actor/pg_clipfrac_lower": 0.001,
                "actor/ppo_kl": 0.001,
                "actor/kl_loss": 0.0005 * s,
                "actor/grad_norm": 0.5,
                "actor/skipped_steps": 0.0,
                "critic/advantages/mean": 0.0,
                "critic/advantages/max": 1.5,
                "critic/advantages/min": -1.5,
                "critic/vf_explained_var": 0.5,
                "critic/vf_loss": 0.1,
                "critic/values/mean": 0.4,
                "response_length/mean": 10.0,
                "response_length/max": 14.0,
                "response_length/min": 6.0,
                "response_length/clip_ratio": 0.0,
                "train/kept_prompt_ratio": 0.9,
                "timing_s/gen": 0.1,
                "timing_s/update_actor": 0.2,
                "timing_s/step": 0.35,
                "perf/throughput": 7000.0,
            }
        )
        if s % 10 == 0:
            history[-1] |= {"val-core/arith/acc/greedy": 0.4 + 0.01 * s, "val-core/arith/acc/mean@4": 0.5}
    return history


def planted(change: Callable[[int], dict], steps: int = STEPS) -> list[dict]:
    """The healthy history with ``change(step)`` merged into every training step's record."""
    return [r | change(r["step"]) if r["step"] > 0 else r for r in healthy(steps)]


def write_run(run_dir: Path, history: list[dict], torn: bool = False) -> Path:
    """A run directory: metrics.jsonl (optionally with a half-written last line) and config.json."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in history)
    if torn:
        text += '{"step": 999, "actor/pg_lo'
    (run_dir / "metrics.jsonl").write_text(text)
    config = {"algorithm": {"adv_estimator": "grpo"}, "trainer": {"total_training_steps": STEPS}}
    (run_dir / "config.json").write_text(json.dumps(config))
    return run_dir
