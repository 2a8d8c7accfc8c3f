"""``python(code)``: run a program in the code sandbox of :mod:`tearless.rewards.sandbox` and return
what it printed (stdout), or its status and the end of stderr when it failed, cut to
``max_output_chars`` (the end is kept: errors and final results are printed last)."""

from __future__ import annotations

from tearless.rewards.sandbox import SandboxLimits, run_in_sandbox
from tearless.tools.base import Tool


class PythonTool(Tool):
    name = "python"
    description = "Run a Python program and return its standard output."
    parameters = {  # noqa: RUF012
        "type": "object",
        "properties": {"code": {"type": "string", "description": "a complete Python program"}},
        "required": ["code"],
    }

    def __init__(self, time_limit_s: float = 4.0, memory_mb: int = 512, max_output_chars: int = 1000) -> None:
        self.limits = SandboxLimits(time_limit_s=time_limit_s, memory_mb=memory_mb)
        self.max_output_chars = max_output_chars

    def call(self, code: str) -> str:
        result = run_in_sandbox(code, [""], limits=self.limits)
        run = result.runs[0]
        if result.compile_error:
            text = f"error: {result.compile_error}"
        elif run.status == "ok":
            text = run.output or ""
        else:
            text = f"{run.status}: {run.stderr}".rstrip()
        return text[-self.max_output_chars :]
