"""Tool calls: a tool that raises, one that hangs, bad arguments, the concurrency bound, YAML loading."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from tearless.tools import Tool, ToolCall, argument_problem, load_tools, run_calls
from tearless.tools.python import PythonTool


class Echo(Tool):
    name = "echo"
    description = "echo the text"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}  # noqa: RUF012

    def call(self, text: str) -> str:
        return text.upper()


class Boom(Echo):
    name = "boom"

    def call(self, text: str) -> str:
        raise RuntimeError(f"cannot handle {text}")


class Hang(Echo):
    name = "hang"

    def call(self, text: str) -> str:
        time.sleep(30)
        return "never"


class AsyncHang(Echo):
    name = "ahang"

    async def call(self, text: str) -> str:
        await asyncio.sleep(30)
        return "never"


class Counting(Echo):
    """Records how many calls run at once."""

    name = "count"

    def __init__(self) -> None:
        self.lock, self.now, self.peak = threading.Lock(), 0, 0

    def call(self, text: str) -> str:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
        time.sleep(0.05)
        with self.lock:
            self.now -= 1
        return text


TOOLS = {t.name: t for t in (Echo(), Boom(), Hang(), AsyncHang())}


def test_failing_hanging_and_malformed_calls_become_error_strings_and_the_rest_still_run():
    calls = [
        ToolCall("echo", {"text": "hi"}),
        ToolCall("boom", {"text": "x"}),
        ToolCall("hang", {"text": "x"}),
        ToolCall("ahang", {"text": "x"}),
        ToolCall("nope", {"text": "x"}),
        ToolCall("echo", {"txt": "x"}),
        ToolCall("echo", {"text": 3}),
        ToolCall("echo", ["not", "a", "dict"]),
    ]
    started = time.perf_counter()
    results = run_calls(calls, TOOLS, max_parallel=8, timeout_s=0.5)
    assert time.perf_counter() - started < 5  # the hanging calls were abandoned at the timeout
    assert [r.error for r in results] == [False, True, True, True, True, True, True, True]
    texts = [r.text for r in results]
    assert texts[0] == "HI"
    assert texts[1] == "error: boom failed: RuntimeError: cannot handle x"
    assert texts[2] == "error: hang timed out after 0.5 s"
    assert texts[3] == "error: ahang timed out after 0.5 s"
    assert texts[4].startswith("error: unknown tool 'nope'; available: ahang, boom, echo, hang")
    assert texts[5] == "error: echo: missing required argument(s) text"
    assert texts[6] == "error: echo: argument 'text' must be string, got int"
    assert texts[7] == "error: echo: arguments must be a JSON object, got list"


def test_a_hung_tool_does_not_keep_the_process_alive():
    code = (
        "import time\n"
        "from tearless.tools import ToolCall, run_calls\n"
        "class Hang:\n"
        "    name, description = 'hang', 'sleeps'\n"
        "    parameters = {'type': 'object', 'properties': {}}\n"
        "    def call(self):\n"
        "        time.sleep(120)\n"
        "print(run_calls([ToolCall('hang', {})], {'hang': Hang()}, max_parallel=1, timeout_s=0.2)[0].text)\n"
    )
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "error: hang timed out after 0.2 s"
    assert time.perf_counter() - started < 30  # the interpreter exited without waiting for the thread


@pytest.mark.parametrize("bound", [1, 3])
def test_at_most_max_parallel_calls_run_at_once(bound):
    tool = Counting()
    results = run_calls(
        [ToolCall("count", {"text": str(i)}) for i in range(9)],
        {"count": tool},
        max_parallel=bound,
        timeout_s=10,
    )
    assert [r.text for r in results] == [str(i) for i in range(9)]
    assert tool.peak == bound


def test_argument_problem_checks_required_unknown_and_types():
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "x": {"type": "number"}},
        "required": ["n"],
    }
    assert argument_problem(schema, {"n": 2, "x": 1.5}) is None
    assert argument_problem(schema, {"n": True}) == "argument 'n' must be integer, got boolean"
    assert argument_problem(schema, {"n": 1, "y": 2}) == "unknown argument 'y'; expected n, x"
    assert argument_problem(schema, {"x": 2}) == "missing required argument(s) n"


USER_TOOL = """
class Weather:
    name = "weather"
    description = "today's weather in a city"
    parameters = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    async def call(self, city):
        return f"sunny in {city}"
"""


def test_load_tools_builds_builtin_and_user_tools_with_paths_relative_to_the_yaml(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"title": "kat", "text": "kat: born Lora."}\n')
    (tmp_path / "mine.py").write_text(USER_TOOL)
    (tmp_path / "tools.yaml").write_text(
        "tools:\n"
        "  - class_name: search\n"
        "    config: {corpus_path: corpus.jsonl, topk: 1}\n"
        "  - class_name: mine.py:Weather\n"
        "    tool_schema:\n"
        "      type: function\n"
        "      function: {name: forecast, description: the forecast}\n"
    )
    tools = load_tools(tmp_path / "tools.yaml")
    assert sorted(tools) == ["forecast", "search"]
    assert tools["forecast"].description == "the forecast"
    results = run_calls(
        [ToolCall("search", {"query": "kat"}), ToolCall("forecast", {"city": "Lora"})],
        tools,
        max_parallel=2,
        timeout_s=5,
    )
    assert [r.text for r in results] == ["kat: born Lora.", "sunny in Lora"]


@pytest.mark.parametrize(
    ("yaml", "message"),
    [
        ("tools:\n  - class_name: nothing\n", "unknown tool class_name 'nothing'; use one of python, search"),
        ("tools:\n  - class_name: gone.py:X\n", "gone.py is not a file"),
        ("tools:\n  - class_name: search\n    config: {corpus_path: none.jsonl}\n", "cannot create search"),
        ("tools: {}\n", "expected a top-level 'tools' list"),
        (
            "tools:\n  - class_name: python\n  - class_name: python\n",
            "a second tool named 'python'",
        ),
        ("tools:\n  - config: {}\n", r"tools\[0\]: each tool needs a 'class_name'"),
    ],
)
def test_bad_tool_yaml_names_the_entry_and_the_problem(tmp_path, yaml, message):
    path = tmp_path / "tools.yaml"
    path.write_text(yaml)
    with pytest.raises(ValueError, match=message):
        load_tools(path)
    with pytest.raises(FileNotFoundError, match="tool_config_path"):
        load_tools(tmp_path / "missing.yaml")


def test_python_tool_returns_stdout_and_errors_through_the_sandbox():
    tools = {"python": PythonTool(time_limit_s=2, max_output_chars=40)}
    ok, err, long = run_calls(
        [
            ToolCall("python", {"code": "print(sum(range(10)))"}),
            ToolCall("python", {"code": "raise ValueError('bad input')"}),
            ToolCall("python", {"code": "print('x' * 100 + 'END')"}),
        ],
        tools,
        max_parallel=1,
        timeout_s=20,
    )
    assert ok.text == "45\n" and not ok.error
    # A failing program is the tool's normal output (its status and the end of stderr), not a tool error.
    assert err.text.endswith("ValueError: bad input") and not err.error
    assert len(long.text) == 40 and long.text.endswith("END\n")
