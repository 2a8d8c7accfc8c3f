"""Written diagnoses of a run: small rules over its metric history that a person can read and check.

Each rule takes the history (one dict per step, veRL metric names, as in ``metrics.jsonl``) and
returns a :class:`Diagnosis` or ``None``. A rule only looks at metrics that exist, so a run without a
critic or a KL term is never diagnosed on them. Most rules judge the *late* part of the run (its last
half): a pathology that the run grew out of is not worth a warning, one that it ends in is.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

History = Sequence[dict]

# Too few points and "persistent" or "falling" mean nothing; 4 steps is the least a trend needs.
MIN_STEPS = 4
# A condition is "persistent" when it holds in at least this share of the late steps.
PERSISTENT_SHARE = 0.5

# Entropy collapse: the late entropy below 10% of the early entropy (the policy has become close to
# deterministic) while the reward gained less than REWARD_PLATEAU_GAIN over the same late half.
ENTROPY_COLLAPSE_RATIO = 0.1
# Scores are usually in [0, 1]: two points of accuracy is the least gain that is not noise.
REWARD_PLATEAU_GAIN = 0.02
# veRL/TRL runs that learn well clip a few percent of tokens; a fifth means each update moves the
# policy well past the trust region (PPO's clip range is 0.2).
CLIPFRAC_HIGH = 0.2
# KL to the reference that at least doubled from the early to the late half and is no longer tiny
# (below 0.01 nats per token the policy is still practically the reference).
KL_RISE_RATIO = 2.0
KL_MIN_LEVEL = 0.01
# More than a fifth of the responses cut at response_length: the reward is scoring truncated answers.
TRUNCATION_HIGH = 0.2
TRUNCATION_MOST = 0.5  # a share of truncated responses that fires the rule from the first step
# Dynamic sampling keeps only groups with unequal rewards: below half kept, most groups teach nothing.
KEPT_PROMPT_LOW = 0.5
# All advantages within this of zero: every group had equal rewards, so GRPO had no signal that step.
ADVANTAGE_ZERO = 1e-6
# Explained variance below 0.2: the value baseline explains little of the returns.
EXPLAINED_VAR_LOW = 0.2
# A policy loss persistently below -0.1 means advantages are biased upwards (a lagging baseline).
PG_LOSS_NEGATIVE = -0.1

SCORE_KEYS = ("critic/score/mean", "critic/rewards/mean", "reward/accuracy")
REF_KL_KEYS = ("actor/kl_loss", "actor/reward_kl_penalty")


@dataclass(frozen=True)
class Diagnosis:
    """One finding: what was seen, at which steps, and what to try."""

    name: str
    severity: str  # "error" (the run is broken) or "warning" (it learns badly)
    what_was_seen: str
    steps: list[int]
    what_to_try: str


def series(history: History, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every finite value of ``key``, in step order."""
    points = [
        (int(r.get("step", i)), float(r[key]))
        for i, r in enumerate(history)
        if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
    ]
    return sorted(points)


def _first_series(history: History, keys: Sequence[str]) -> tuple[str, list[tuple[int, float]]]:
    for key in keys:
        points = series(history, key)
        if points:
            return key, points
    return "", []


def _halves(points: list[tuple[int, float]]) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    mid = len(points) // 2
    return points[:mid], points[mid:]


def _mean(points: list[tuple[int, float]]) -> float:
    return sum(v for _, v in points) / len(points)


def _reward_gain(history: History) -> float | None:
    """Late-half mean minus early-half mean of the training score (None without a score)."""
    points = [p for p in _first_series(history, SCORE_KEYS)[1] if p[0] > 0]
    if len(points) < MIN_STEPS:
        return None
    early, late = _halves(points)
    return _mean(late) - _mean(early)


def _persistent(points: list[tuple[int, float]], holds: Callable[[float], bool]) -> list[int]:
    """Steps of the late half where ``holds``; empty unless it holds in PERSISTENT_SHARE of them."""
    if len(points) < MIN_STEPS:
        return []
    late = _halves(points)[1]
    steps = [s for s, v in late if holds(v)]
    return steps if len(steps) >= PERSISTENT_SHARE * len(late) else []


def step_ranges(steps: Sequence[int]) -> str:
    """``[1, 2, 3, 7]`` → ``"1-3, 7"``."""
    out: list[str] = []
    for s in sorted(set(steps)):
        if out and s == int(out[-1].split("-")[-1]) + 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


def entropy_collapse(history: History) -> Diagnosis | None:
    points = series(history, "actor/entropy")
    gain = _reward_gain(history)
    if len(points) < MIN_STEPS or (gain is not None and gain >= REWARD_PLATEAU_GAIN):
        return None
    early, late = _halves(points)
    start, end = _mean(early), _mean(late)
    if start <= 0 or end > ENTROPY_COLLAPSE_RATIO * start:
        return None
    reward = "reward not measured" if gain is None else f"reward changed by {gain:+.3f}"
    return Diagnosis(
        "entropy collapse",
        "warning",
        f"actor/entropy fell from {start:.3f} (early mean) to {end:.3f} (late mean) while the {reward}: "
        "the policy became nearly deterministic and stopped exploring.",
        [s for s, v in late if v <= ENTROPY_COLLAPSE_RATIO * start],
        "raise actor_rollout_ref.rollout.temperature; add an entropy bonus "
        "(actor_rollout_ref.actor.entropy_coeff); use clip-higher "
        "(actor_rollout_ref.actor.clip_ratio_high=0.28); lower the learning rate.",
    )


def high_clip_fraction(history: History) -> Diagnosis | None:
    points = series(history, "actor/pg_clipfrac")
    steps = _persistent(points, lambda v: v > CLIPFRAC_HIGH)
    if not steps:
        return None
    return Diagnosis(
        "clip fraction persistently high",
        "warning",
        f"actor/pg_clipfrac above {CLIPFRAC_HIGH} in {len(steps)} of the last "
        f"{len(_halves(points)[1])} steps (late mean {_mean(_halves(points)[1]):.3f}): "
        "each update pushes the policy far outside the clip range.",
        steps,
        "lower actor_rollout_ref.actor.optim.lr; use fewer mini-batches per step (raise "
        "actor_rollout_ref.actor.ppo_mini_batch_size) or fewer actor_rollout_ref.actor.ppo_epochs.",
    )


def kl_drift(history: History) -> Diagnosis | None:
    key, points = _first_series(history, REF_KL_KEYS)
    gain = _reward_gain(history)
    if len(points) < MIN_STEPS or gain is None or gain >= REWARD_PLATEAU_GAIN:
        return None
    early, late = _halves(points)
    start, end = _mean(early), _mean(late)
    if end < KL_MIN_LEVEL or end < KL_RISE_RATIO * start:
        return None
    return Diagnosis(
        "KL rising without reward gain",
        "warning",
        f"{key} rose from {start:.4f} to {end:.4f} (early vs late mean) while the reward changed by "
        f"{gain:+.3f}: the policy drifts from the reference without learning the task "
        "(or it learns to exploit the reward).",
        [s for s, v in late if v >= KL_RISE_RATIO * start],
        "raise the KL coefficient (actor_rollout_ref.actor.kl_loss_coef or algorithm.kl_ctrl.kl_coef); "
        "lower the learning rate; read the late steps' samples for reward hacking "
        "(tearless samples RUN_DIR --best).",
    )


def truncation(history: History) -> Diagnosis | None:
    points = series(history, "response_length/clip_ratio")
    steps = _persistent(points, lambda v: v > TRUNCATION_HIGH)
    # Most responses cut in every step is a cap far too short, however few steps the run has.
    if not steps and points and all(v >= TRUNCATION_MOST for _, v in points):
        steps = [s for s, _ in points]
    if not steps:
        return None
    return Diagnosis(
        "responses pinned at the length cap",
        "warning",
        f"response_length/clip_ratio above {TRUNCATION_HIGH} in {len(steps)} late steps "
        f"(late mean {_mean(_halves(points)[1]):.2f}): answers are cut before they end.",
        steps,
        "raise data.max_response_length; add the overlong penalty "
        "(reward_model.overlong_buffer.enable=true); check the model emits EOS.",
    )


def no_group_signal(history: History) -> Diagnosis | None:
    kept = series(history, "train/kept_prompt_ratio")
    flat_groups = series(history, "train/zero_variance_group_ratio")
    if kept:
        steps = _persistent(kept, lambda v: v < KEPT_PROMPT_LOW)
        seen = f"train/kept_prompt_ratio below {KEPT_PROMPT_LOW} in {len(steps)} late steps"
    elif flat_groups:
        steps = _persistent(flat_groups, lambda v: v > 1 - KEPT_PROMPT_LOW)
        seen = f"train/zero_variance_group_ratio above {1 - KEPT_PROMPT_LOW} in {len(steps)} late steps"
    else:
        lo, hi = dict(series(history, "critic/advantages/min")), series(history, "critic/advantages/max")
        flat = [(s, float(abs(v) < ADVANTAGE_ZERO and abs(lo.get(s, 1.0)) < ADVANTAGE_ZERO)) for s, v in hi]
        steps = _persistent(flat, lambda v: v > 0)
        seen = f"every advantage was ~0 in {len(steps)} late steps"
    if not steps:
        return None
    return Diagnosis(
        "no learning signal in most groups",
        "warning",
        f"{seen}: most prompt groups got equal rewards for all responses, so GRPO-style advantages "
        "are zero and those samples teach nothing.",
        steps,
        "use prompts of matching difficulty (drop too-easy and too-hard ones); raise "
        "actor_rollout_ref.rollout.n; turn on dynamic sampling (algorithm.filter_groups.enable=true); "
        "use a denser reward.",
    )


def critic_lagging(history: History) -> Diagnosis | None:
    ev = dict(series(history, "critic/vf_explained_var"))
    lagging = [
        (s, float(v < PG_LOSS_NEGATIVE and ev[s] < EXPLAINED_VAR_LOW))
        for s, v in series(history, "actor/pg_loss")
        if s in ev
    ]
    steps = _persistent(lagging, lambda v: v > 0)
    if not steps:
        return None
    return Diagnosis(
        "critic lagging",
        "warning",
        f"critic/vf_explained_var below {EXPLAINED_VAR_LOW} while actor/pg_loss stays below "
        f"{PG_LOSS_NEGATIVE} in {len(steps)} late steps: the value baseline does not follow the "
        "policy, so advantages are biased upwards.",
        steps,
        "raise critic.optim.lr or critic.ppo_epochs; warm the critic up before the actor "
        "(trainer.critic_warmup); check values and returns share a scale.",
    )


def reward_failures(history: History) -> Diagnosis | None:
    steps = [s for s, v in series(history, "reward/failures") if v > 0]
    if not steps:
        return None
    return Diagnosis(
        "reward function failures",
        "error",
        f"reward/failures > 0 in {len(steps)} steps: some samples were not scored (an exception or a "
        "timeout in the reward function) and got the failure score.",
        steps,
        "read the reward function's errors in the training log; raise reward_model.timeout_s; "
        "test compute_score on the failing samples (tearless samples RUN_DIR --step N).",
    )


def non_finite(history: History) -> Diagnosis | None:
    bad = {
        (int(r.get("step", i)), k)
        for i, r in enumerate(history)
        for k, v in r.items()
        if isinstance(v, float) and not math.isfinite(v)
    }
    skipped = {
        s
        for key in ("actor/skipped_steps", "critic/skipped_steps")
        for (_, before), (s, v) in itertools.pairwise(series(history, key))
        if v > before
    }
    steps = sorted({s for s, _ in bad} | skipped)
    if not steps:
        return None
    names = ", ".join(sorted({k for _, k in bad})) or "-"
    return Diagnosis(
        "non-finite values or skipped updates",
        "error",
        f"NaN/inf in metrics ({names}) or optimizer steps skipped for a non-finite gradient norm.",
        steps,
        "lower the learning rate; keep gradient clipping on (actor_rollout_ref.actor.grad_clip); "
        "check rewards and log-probs for inf (KL estimators on very unlikely tokens); try float32.",
    )


RULES: tuple[Callable[[History], Diagnosis | None], ...] = (
    non_finite,
    reward_failures,
    entropy_collapse,
    high_clip_fraction,
    kl_drift,
    truncation,
    no_group_signal,
    critic_lagging,
)


def diagnose(history: History) -> list[Diagnosis]:
    """Every rule's finding on ``history`` (a healthy run yields none)."""
    history = sorted(history, key=lambda r: r.get("step", 0))
    return [d for rule in RULES if (d := rule(history)) is not None]
