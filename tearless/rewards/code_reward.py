"""Code execution reward: run the response's last Python code block against test cases.

The ground truth follows the APPS / TACO convention, as a dict or its JSON string:

- standard input / output: ``{"inputs": [stdin, …], "outputs": [expected stdout, …]}``; an input or
  output given as a list of lines is joined with newlines;
- function calls: ``{"fn_name": "two_sum", "inputs": [[arg, …], …], "outputs": [value, …]}``; the
  function is top-level or a method of ``class Solution`` (LeetCode style). APPS wraps each expected
  value in a one-element list, so ``[value]`` also accepts ``value``.

The program is the last complete fenced block (three backticks) tagged ``python``, ``py``,
``python3``, ``py3`` or untagged; a response without one scores 0. Every test runs in the sandbox
(:mod:`tearless.rewards.sandbox`, which documents what is enforced).

Score = passed / number of tests (after ``max_tests``); ``acc`` = 1.0 when all passed. A test that
times out ends the sample: the remaining tests count as failed without running.

Standard output is compared token by token (any run of whitespace separates tokens, so line breaks
and trailing spaces do not matter, case does); two tokens that both parse as finite floats, one of
them with a decimal point or exponent, match within 1e-6 absolute or relative. Return values are
compared as JSON values (tuples are lists) with the same tolerance for floats.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from tearless.rewards.sandbox import SandboxLimits, run_in_sandbox

PYTHON_TAGS = ("python", "py", "python3", "py3", "")
FLOAT_TOLERANCE = 1e-6

_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class TestCases:
    inputs: list[Any]
    outputs: list[Any]
    fn_name: str | None = None


def extract_code(solution_str: str) -> str | None:
    """The last complete fenced Python (or untagged) code block, or ``None`` if there is none."""
    blocks = [body for tag, body in _FENCE.findall(solution_str) if tag.strip().lower() in PYTHON_TAGS]
    return blocks[-1] if blocks else None


def parse_tests(ground_truth: Any) -> TestCases:
    """Read an APPS/TACO ground truth (dict or JSON string); a malformed one raises ``ValueError``."""
    spec = ground_truth
    if isinstance(spec, (str, bytes)):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"code ground truth is not valid JSON: {exc}") from exc
    if not isinstance(spec, dict) or "inputs" not in spec or "outputs" not in spec:
        keys = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise ValueError(
            'code ground truth needs {"inputs": [...], "outputs": [...]} (optionally "fn_name"); '
            f"got {keys}"
        )
    inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
    if not inputs or len(inputs) != len(outputs):
        raise ValueError(
            f"code ground truth needs as many outputs as inputs, at least one; got {len(inputs)} inputs "
            f"and {len(outputs)} outputs"
        )
    fn_name = spec.get("fn_name") or None
    if fn_name is None:
        inputs = [_as_text(x) for x in inputs]
        outputs = [_as_text(x) for x in outputs]
    else:
        inputs = [list(x) if isinstance(x, (list, tuple)) else [x] for x in inputs]
    return TestCases(inputs, outputs, fn_name)


def outputs_match(actual: str, expected: str) -> bool:
    """Token-by-token comparison of standard output (see the module docs)."""
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(_tokens_match(a, e) for a, e in zip(got, want, strict=True))


def values_match(actual: Any, expected: Any) -> bool:
    """Compare a return value with the expected one; APPS's ``[value]`` wrapping is accepted."""
    if _values_equal(actual, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and _values_equal(actual, expected[0])


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    time_limit_s: float = 4.0,
    memory_mb: int = 512,
    max_tests: int | None = None,
) -> dict[str, float]:
    """``{"score": passed / tests, "acc": all passed}``; see the module docs for the conventions.

    ``time_limit_s`` (per test), ``memory_mb`` and ``max_tests`` (use the first N tests) come from
    ``reward_kwargs``; a row's ``extra_info`` may override ``time_limit_s`` and ``memory_mb``.
    """
    tests = parse_tests(ground_truth)
    if max_tests is not None:
        tests = TestCases(tests.inputs[:max_tests], tests.outputs[:max_tests], tests.fn_name)
    code = extract_code(solution_str)
    if code is None:
        return {"score": 0.0, "acc": 0.0}
    info = extra_info if isinstance(extra_info, dict) else {}
    limits = SandboxLimits(
        time_limit_s=float(info.get("time_limit_s") or time_limit_s),
        memory_mb=int(info.get("memory_mb") or memory_mb),
    )
    result = run_in_sandbox(code, tests.inputs, fn_name=tests.fn_name, limits=limits)
    passed = 0
    for run, expected in zip(result.runs, tests.outputs, strict=True):
        if run.status != "ok" or run.output is None:
            continue
        if tests.fn_name is None:
            passed += outputs_match(run.output, expected)
        else:
            try:
                passed += values_match(json.loads(run.output), expected)
            except ValueError:  # not JSON: the program replaced its own result file
                continue
    total = len(tests.inputs)
    return {"score": passed / total, "acc": float(passed == total)}


def _as_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(map(str, value)) + "\n"
    return str(value)


def _tokens_match(a: str, e: str) -> bool:
    if a == e:
        return True
    if not any(c in s for s in (a, e) for c in ".eE"):
        return False
    try:
        x, y = float(a), float(e)
    except ValueError:
        return False
    return (
        math.isfinite(x)
        and math.isfinite(y)
        and math.isclose(x, y, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
    )


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a == b:
            return True
        return (
            math.isfinite(a)
            and math.isfinite(b)
            and math.isclose(a, b, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
        )
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    return a == b
