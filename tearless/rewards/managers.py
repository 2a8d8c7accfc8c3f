"""Reward managers chosen by ``reward_model.reward_manager``, and the factory that builds them.

Every manager has ``score(items) -> list[ScoreResult]`` and ``close()`` and is a context manager.
An item is a dict with ``data_source``, ``solution_str``, ``ground_truth`` and ``extra_info``; the
``dapo`` overlong penalty also needs ``response_length`` (response tokens, an int) and reward-model
scoring needs ``prompt`` (the chat messages, or a string).

- ``naive``: the reward function per sample, in this process (veRL's default).
- ``batch``: one call per batch with lists, ``fn(data_sources, solution_strs, ground_truths,
  extra_infos, **reward_kwargs) -> list`` (veRL's batch manager); without a custom function, the
  built-in scorers are called in a loop.
- ``prime``: a pool of ``num_workers`` processes with a per-sample timeout
  (:class:`tearless.rewards.RewardManager`); the tearless default, and the one to use for code.
- ``dapo``: ``prime`` plus DAPO's overlong soft penalty when ``overlong_buffer.enable``:
  with L_max = ``data.max_response_length`` and buffer B = ``overlong_buffer.len``,
  penalty = min(0, −(L − (L_max − B)) / B · penalty_factor), added to the score
  (:func:`tearless.algos.overlong_penalty`).

With ``reward_model.enable`` a reward model (:class:`~tearless.rewards.model.RewardModelScorer`)
scores every pair, and the score is ``model score + rule_weight · rule score``, the rule score coming
from the manager above; with ``rule_weight=0`` (the default, as in veRL) rule scorers are not called.

With ``reward_model.judge.enable`` an LLM judge behind an OpenAI-compatible endpoint
(:class:`~tearless.rewards.judge.Judge`) scores every sample the same way, its failures counted and
bounded (:class:`JudgeRewardManager`).

With ``reward_model.step_reward.prm.enable`` a process reward model
(:class:`~tearless.rewards.prm.ProcessRewardScorer`) scores every step of every response; its step
scores become each result's ``steps`` (replacing any the rule scorer gave) while the score stays the
outcome of the managers above.
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

from tearless.rewards.judge import FIELDS, PARSERS, Judge, JudgeError, template_fields
from tearless.rewards.manager import RewardError, RewardManager, ScoreResult
from tearless.rewards.pool import check_value, user_traceback
from tearless.rewards.registry import compute_score
from tearless.rewards.sandbox import SandboxError

REWARD_MANAGERS = ("naive", "batch", "prime", "dapo")
_BATCH_KEYS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")


def compute_score_batch(
    data_sources: Sequence[str],
    solution_strs: Sequence[str],
    ground_truths: Sequence[Any],
    extra_infos: Sequence[Any],
    **kwargs: Any,
) -> list[float | dict]:
    """The built-in scorers by ``data_source``, with the batch signature (one call per sample)."""
    return [
        compute_score(*args, **kwargs)
        for args in zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)
    ]


class _Manager:
    def close(self) -> None:
        """Release what the manager holds (worker processes)."""

    @property
    def lost_workers(self) -> int:
        """Reward worker processes that died while scoring, so far (0 without a process pool)."""
        return 0

    def __enter__(self) -> _Manager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Wrapper(_Manager):
    """A manager over an ``inner`` one: its workers and their release are the inner manager's."""

    inner: Any

    @property
    def lost_workers(self) -> int:
        return self.inner.lost_workers

    def close(self) -> None:
        self.inner.close()


class BatchRewardManager(_Manager):
    """Scores a whole batch with one call; if the call raises, every sample of it fails."""

    def __init__(
        self,
        batch_fn: Callable[..., Sequence[Any]] | None = None,
        *,
        failure_score: float = 0.0,
        reward_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.batch_fn = compute_score_batch if batch_fn is None else batch_fn
        self.failure_score = float(failure_score)
        self.reward_kwargs = dict(reward_kwargs or {})
        try:
            inspect.signature(self.batch_fn).bind(**dict.fromkeys(_BATCH_KEYS), **self.reward_kwargs)
        except TypeError as exc:
            raise TypeError(
                f"reward_manager=batch needs a function fn(data_sources, solution_strs, ground_truths, "
                f"extra_infos, **reward_kwargs) returning one score per sample: {exc}"
            ) from exc

    def score(self, items: Sequence[dict]) -> list[ScoreResult]:
        # data_sources=[item["data_source"], …], solution_strs=…, ground_truths=…, extra_infos=…
        columns = {key: [item[key.removesuffix("s")] for item in items] for key in _BATCH_KEYS}
        pid = os.getpid()
        try:
            values = self.batch_fn(**columns, **self.reward_kwargs)
        except SandboxError as exc:
            raise RewardError(f"reward scoring cannot run: {exc}") from exc
        except (Exception, SystemExit) as exc:  # sys.exit() in it fails the batch, not the trainer
            if os.getpid() != pid:
                os._exit(0)  # a process it forked must not go on as a second trainer
            error = f"raised: {type(exc).__name__}: {exc}"
            tb = user_traceback(exc)
            return [ScoreResult(self.failure_score, {}, error, traceback=tb) for _ in items]
        if os.getpid() != pid:
            os._exit(0)
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__len__"):
            raise TypeError(
                f"the batch reward function returned a {type(values).__name__}; it must return a list "
                f"with one score (or dict with 'score') per sample, {len(items)} here"
            )
        values = list(values)
        if len(values) != len(items):
            raise ValueError(
                f"the batch reward function returned {len(values)} scores for {len(items)} samples"
            )
        return [ScoreResult.from_outcome(check_value(v), self.failure_score) for v in values]


class OverlongPenaltyManager(_Wrapper):
    """DAPO's overlong soft penalty on top of another manager (see the module docs).

    Each result's extras gain ``acc`` (the inner ``acc``, else whether the unpenalised score was
    ≥ 1) and, with ``log``, ``overlong_reward`` (the penalty) and ``overlong`` (1.0 when penalised).
    """

    def __init__(
        self, inner: Any, *, max_response_length: int, buffer_len: int, penalty_factor: float, log: bool
    ) -> None:
        if not 0 < buffer_len <= max_response_length:
            raise ValueError(
                "reward_model.overlong_buffer.len must be in "
                f"(0, max_response_length={max_response_length}], "
                f"got {buffer_len}"
            )
        self.inner = inner
        self.max_response_length = max_response_length
        self.buffer_len = buffer_len
        self.penalty_factor = penalty_factor
        self.log = log

    def score(self, items: Sequence[dict]) -> list[ScoreResult]:
        import torch

        # torch: the reward worker processes import tearless.rewards without it
        from tearless.algos import overlong_penalty

        missing = [i for i, item in enumerate(items) if "response_length" not in item]
        if missing:
            raise ValueError(
                f"the overlong penalty needs each item's response_length (tokens); item {missing[0]} lacks it"
            )
        results = self.inner.score(items)
        lengths = torch.tensor([float(item["response_length"]) for item in items])
        penalties = overlong_penalty(lengths, self.max_response_length, self.buffer_len, self.penalty_factor)
        shaped = []
        for result, penalty in zip(results, penalties.tolist(), strict=True):
            extra = {**result.extra, "acc": result.extra.get("acc", float(result.score >= 1.0))}
            if self.log:
                extra.update(overlong_reward=penalty, overlong=float(penalty < 0))
            shaped.append(ScoreResult(result.score + penalty, extra, result.error, result.steps))
        return shaped


class ModelRewardManager(_Manager):
    """A reward model's score, plus ``rule_weight`` times the rule manager's score when given.

    Extras: ``rm_score``, and with a rule manager ``rule_score`` and the rule result's extras.
    """

    def __init__(self, scorer: Any, rule: Any = None, rule_weight: float = 0.0) -> None:
        self.scorer = scorer
        self.rule = rule
        self.rule_weight = float(rule_weight)

    def score(self, items: Sequence[dict]) -> list[ScoreResult]:
        if any("prompt" not in item for item in items):
            raise ValueError("reward-model scoring needs each item's prompt (its chat messages)")
        model_scores = self.scorer.score([it["prompt"] for it in items], [it["solution_str"] for it in items])
        rules = self.rule.score(items) if self.rule is not None else [None] * len(items)
        return [
            with_rule(value, "rm_score", rule, self.rule_weight)
            for value, rule in zip(model_scores, rules, strict=True)
        ]

    @property
    def lost_workers(self) -> int:
        return self.rule.lost_workers if self.rule is not None else 0

    def close(self) -> None:
        if self.rule is not None:
            self.rule.close()


def with_rule(value: float, key: str, rule: ScoreResult | None, rule_weight: float) -> ScoreResult:
    """A model's (or judge's) score ``value``, logged as extra ``key``, plus ``rule_weight`` × the rule
    result's score when there is one (whose extras, error and steps it keeps, with ``rule_score``)."""
    if rule is None:
        return ScoreResult(value, {key: value})
    extra = {**rule.extra, key: value, "rule_score": rule.score}
    return ScoreResult(value + rule_weight * rule.score, extra, rule.error, rule.steps)


class JudgeRewardManager(ModelRewardManager):
    """An LLM judge's score (:class:`~tearless.rewards.judge.Judge`), plus ``rule_weight`` × the rule
    manager's score when given. A sample the judge fails on gets ``failure_score`` and its error;
    when the judge stopped for its ``max_failures`` failed samples in a row, the batch raises
    :class:`RewardError` (one line naming the key) and the run stops.

    Extras: ``judge_score``, and with a rule manager ``rule_score`` and the rule result's extras.
    """

    def __init__(
        self,
        judge: Judge,
        rule: Any = None,
        rule_weight: float = 0.0,
        *,
        failure_score: float = 0.0,
    ) -> None:
        super().__init__(judge, rule, rule_weight)
        self.failure_score = float(failure_score)

    def score(self, items: Sequence[dict]) -> list[ScoreResult]:
        if any("prompt" not in item for item in items):
            raise ValueError("judge scoring needs each item's prompt (its chat messages)")
        judged = self.scorer.score(items)
        if self.scorer.down is not None:
            raise RewardError(
                f"reward_model.judge: {self.scorer.max_failures} samples in a row failed to be judged "
                f"(last: {self.scorer.down}); check reward_model.judge.base_url, model and prompt_template, "
                "or raise reward_model.judge.max_failures"
            )
        rules = self.rule.score(items) if self.rule is not None else [None] * len(items)
        return [
            with_rule(value, "judge_score", rule, self.rule_weight)
            if not isinstance(value, JudgeError)
            else ScoreResult(self.failure_score, {}, f"judge: {value}")
            for value, rule in zip(judged, rules, strict=True)
        ]

    def close(self) -> None:
        self.scorer.close()
        super().close()


class ProcessRewardManager(_Wrapper):
    """The inner manager's outcome scores, with a process reward model's step scores as their steps.

    Extras gain ``prm_step_mean`` (the mean step score of the response; absent without steps).
    """

    def __init__(self, scorer: Any, inner: Any) -> None:
        self.scorer = scorer
        self.inner = inner

    def score(self, items: Sequence[dict]) -> list[ScoreResult]:
        if any("prompt" not in item for item in items):
            raise ValueError("process-reward-model scoring needs each item's prompt (its chat messages)")
        outcomes = self.inner.score(items)
        steps = self.scorer.score([it["prompt"] for it in items], [it["solution_str"] for it in items])
        results = []
        for outcome, (scores, ends) in zip(outcomes, steps, strict=True):
            extra = dict(outcome.extra)
            if scores:
                extra["prm_step_mean"] = sum(scores) / len(scores)
            results.append(ScoreResult(outcome.score, extra, outcome.error, (scores, ends)))
        return results


def reward_config_problems(reward_model: Any, max_response_length: int) -> list[tuple[str, str, str]]:
    """``(key, problem, fix)`` for every inconsistency in a ``reward_model`` config section."""
    rm, problems = reward_model, []
    if rm.reward_manager not in REWARD_MANAGERS:
        problems.append(
            ("reward_model.reward_manager", f"{rm.reward_manager!r} is not a reward manager",
             f"Use one of {', '.join(REWARD_MANAGERS)}.")
        )  # fmt: skip
    ob = rm.overlong_buffer
    if ob.enable and rm.reward_manager != "dapo":
        problems.append(
            ("reward_model.overlong_buffer.enable", "the overlong penalty belongs to the dapo manager",
             "Set reward_model.reward_manager=dapo.")
        )  # fmt: skip
    if ob.enable and not 0 < ob.len <= max_response_length:
        problems.append(
            ("reward_model.overlong_buffer.len", f"must be in (0, {max_response_length}], got {ob.len}",
             "Set it to at most data.max_response_length (DAPO used a quarter of it).")
        )  # fmt: skip
    if ob.enable and not (math.isfinite(ob.penalty_factor) and ob.penalty_factor >= 0):
        problems.append(
            ("reward_model.overlong_buffer.penalty_factor", f"must be >= 0, got {ob.penalty_factor}",
             "DAPO used 1.0.")
        )  # fmt: skip
    if rm.enable and not rm.model.path:
        problems.append(
            ("reward_model.model.path", "reward_model.enable=true needs a model",
             "Point it at a local sequence-classification model directory (num_labels=1).")
        )  # fmt: skip
    if rm.step_reward.prm.enable and not rm.step_reward.prm.path:
        problems.append(
            ("reward_model.step_reward.prm.path", "prm.enable=true needs a process reward model",
             "Point it at a local PRM directory (python -m tearless.trainers.step_prm builds the embedded "
             "chain_addition task's and prints its path).")
        )  # fmt: skip
    if (
        rm.step_reward.prm.enable
        and rm.step_reward.prm.kind == "implicit"
        and not rm.step_reward.prm.ref_path
    ):
        problems.append(
            ("reward_model.step_reward.prm.ref_path", "prm.kind=implicit needs the reference model",
             "Point it at the model the implicit PRM was trained against (its starting point).")
        )  # fmt: skip
    if not (rm.enable or rm.judge.enable) and rm.rule_weight != 0.0:
        problems.append(
            ("reward_model.rule_weight", "only applies with reward_model.enable or judge.enable",
             "Enable the reward model or the judge, or leave rule_weight at 0.")
        )  # fmt: skip
    if rm.judge.enable:
        problems += judge_config_problems(rm)
    return problems


def judge_config_problems(rm: Any) -> list[tuple[str, str, str]]:
    """``(key, problem, fix)`` for the ``reward_model.judge`` keys of an enabled judge."""
    j, problems = rm.judge, []

    def bad(key: str, problem: str, fix: str) -> None:
        problems.append((f"reward_model.judge.{key}", problem, fix))

    if rm.enable:
        bad(
            "enable", "is on with reward_model.enable: two model scores", "Use the reward model or the judge."
        )
    if not j.base_url or not str(j.base_url).startswith(("http://", "https://")):
        bad(
            "base_url", f"{j.base_url!r} is not an http(s) URL", "e.g. http://127.0.0.1:8000/v1 (vllm serve)."
        )
    try:
        fields = template_fields(j.prompt_template)
    except ValueError as e:
        bad("prompt_template", f"is not a template: {e}", "Write fields plainly, as {response}, and literal "
            "braces as {{ and }}.")  # fmt: skip
    else:
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            bad("prompt_template", f"has unknown field(s) {unknown}", "Use {prompt}, {response}, "
                "{ground_truth}; write literal braces as {{ and }}.")  # fmt: skip
        elif "response" not in fields:
            bad("prompt_template", "has no {response}", "The judge must see the response it scores.")
    if j.parser not in PARSERS:
        bad("parser", f"{j.parser!r} is not a parser", f"Use one of {', '.join(PARSERS)}.")
    numbers = [v for v in j.score_range if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if j.parser != "labels" and not (len(numbers) == 2 == len(j.score_range) and numbers[0] < numbers[1]):
        bad("score_range", f"{j.score_range!r} is not [lo, hi] with lo < hi", "e.g. [0, 10].")
    if j.parser == "labels" and not j.labels:
        bad("labels", "is empty but parser=labels", "e.g. {correct: 1.0, incorrect: 0.0}.")
    for label, value in j.labels.items():
        try:
            float(value)
        except (TypeError, ValueError):
            bad("labels", f"{label!r}: {value!r} is not a number", "Give each label a score, e.g. 1.0.")
    for key in ("max_concurrency", "max_tokens", "max_failures"):
        if getattr(j, key) < 1:
            bad(key, f"must be >= 1, got {getattr(j, key)}", "Set a positive value.")
    if not j.timeout_s > 0:
        bad("timeout_s", f"must be > 0, got {j.timeout_s}", "e.g. 30 (seconds per socket operation).")
    for key in ("backoff_s", "max_retries", "temperature", "cache_size"):
        if getattr(j, key) < 0:
            bad(key, f"must be >= 0, got {getattr(j, key)}", "Set a value >= 0.")
    return problems


def make_reward_manager(
    reward_model: Any,
    score_fn: Callable[..., Any] | None = None,
    reward_kwargs: dict[str, Any] | None = None,
    *,
    max_response_length: int,
    device: str = "cpu",
) -> Any:
    """Build the manager a ``reward_model`` config section describes (see the module docs).

    ``score_fn`` is the custom reward function (``None``: the built-in scorers); for ``batch`` it
    must have the batch signature. ``max_response_length`` is the rollout's response cap in tokens.
    """
    problems = reward_config_problems(reward_model, max_response_length)
    if problems:
        key, problem, fix = problems[0]
        raise ValueError(f"{key}: {problem}. {fix}")
    rm, kwargs = reward_model, dict(reward_kwargs or {})
    rule: Any = None
    if not (rm.enable or rm.judge.enable) or rm.rule_weight != 0.0:
        if rm.reward_manager == "batch":
            rule = BatchRewardManager(score_fn, failure_score=rm.failure_score, reward_kwargs=kwargs)
        else:
            workers = 0 if rm.reward_manager == "naive" else rm.num_workers
            rule = RewardManager(
                score_fn,
                num_workers=workers,
                timeout_s=rm.timeout_s,
                failure_score=rm.failure_score,
                reward_kwargs=kwargs,
            )
    manager = rule
    if rm.enable:
        # a model-based scorer loads transformers: only a config that names one pays for it
        from tearless.rewards.model import RewardModelScorer

        scorer = RewardModelScorer(
            rm.model.path,
            micro_batch_size=rm.micro_batch_size_per_gpu,
            max_length=rm.max_length,
            device=device,
        )
        manager = ModelRewardManager(scorer, rule, rm.rule_weight)
    if rm.judge.enable:
        j = rm.judge
        judge = Judge(
            base_url=j.base_url,
            model=j.model,
            prompt_template=j.prompt_template,
            parser=j.parser,
            score_range=j.score_range,
            labels=j.labels,
            api_key_env=j.api_key_env,
            temperature=j.temperature,
            max_tokens=j.max_tokens,
            max_concurrency=j.max_concurrency,
            timeout_s=j.timeout_s,
            max_retries=j.max_retries,
            backoff_s=j.backoff_s,
            max_failures=j.max_failures,
            cache_size=j.cache_size,
        )
        manager = JudgeRewardManager(judge, rule, rm.rule_weight, failure_score=rm.failure_score)
    sr = rm.step_reward
    if sr.prm.enable:
        # a model-based scorer loads transformers: only a config that names one pays for it
        from tearless.rewards.prm import ProcessRewardScorer

        prm = ProcessRewardScorer(
            sr.prm.path,
            kind=sr.prm.kind,
            separator=sr.separator,
            separator_regex=sr.separator_regex,
            good_token=sr.prm.good_token,
            bad_token=sr.prm.bad_token,
            step_tag=sr.prm.step_tag,
            ref_path=sr.prm.ref_path,
            beta=sr.prm.beta,
            micro_batch_size=rm.micro_batch_size_per_gpu,
            max_length=rm.max_length,
            device=device,
        )
        manager = ProcessRewardManager(prm, manager)
    ob = rm.overlong_buffer
    if rm.reward_manager == "dapo" and ob.enable:
        manager = OverlongPenaltyManager(
            manager,
            max_response_length=max_response_length,
            buffer_len=ob.len,
            penalty_factor=ob.penalty_factor,
            log=ob.log,
        )
    return manager
