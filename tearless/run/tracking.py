"""Metric sinks: console (progress bar + a table every few steps), JSONL (always), TensorBoard, W&B, MLflow.

The JSONL file gets one complete line per step, written in a single call and flushed, so a crash
can at worst leave a torn last line, which :func:`read_metrics` skips. Every logger gets the same
metric names, except that MLflow forbids some characters (``mean@4``): :func:`mlflow_name` maps
each of them to ``_``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The loggers the Tracker serves (``trainer.logger`` of every trainer); config validation reads this one
# list. metrics.jsonl is written whatever the list says.
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
KEY_METRICS = {
    "critic/score/mean": "reward",
    "reward/accuracy": "acc",
    "actor/kl_loss": "kl",
    "actor/entropy": "entropy",
    "response_length/mean": "len",
    "timing_s/step": "s/step",
    "perf/throughput": "tok/s",
}
_MLFLOW_FORBIDDEN = re.compile(r"[^\w\-. /]")


def mlflow_name(key: str) -> str:
    """A metric name MLflow accepts (letters, digits, ``_ - . /`` and space): others become ``_``."""
    return _MLFLOW_FORBIDDEN.sub("_", key)


# The largest step a record may carry: a float64 (the plots' axis) still holds every integer up to it.
_MAX_STEP = 2**53


def is_step_record(record: Any) -> bool:
    """A JSON value is a step record (a metrics line, a rollout record): an object whose ``step`` is
    an integer in [0, 2**53]."""
    if not isinstance(record, dict):
        return False
    step = record.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= _MAX_STEP


def _loads(line: str) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError, a 4,300-digit number, deep nesting
        return None


def parse_jsonl(text: str) -> list[dict]:
    """The step records (:func:`is_step_record`) of JSON-lines text; other lines (a torn last line,
    JSON that is not a record) are skipped."""
    return [r for r in map(_loads, text.splitlines()) if is_step_record(r)]


def read_metrics_counted(path: str | os.PathLike) -> tuple[list[dict], list[int]]:
    """``(records, skipped)``: the metrics records of a JSONL file and the (1-based) numbers of the
    lines that are not one (JSON that does not parse, too deep or too long a number to read, or a value
    that is not an object with an integer ``step``: :func:`is_step_record`). A torn last line (no
    newline after it: a write in progress or cut by a crash) is skipped without being counted. Bytes
    that are not UTF-8 are read as U+FFFD, so one bad byte costs at most its string, not the file."""
    p = Path(path)
    if not p.exists():
        return [], []
    text = p.read_bytes().decode("utf-8", errors="replace")
    lines = text.splitlines()
    records, skipped = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        record = _loads(line)
        if is_step_record(record):
            records.append(record)
        elif not (number == len(lines) and not text.endswith("\n")):
            skipped.append(number)
    return records, skipped


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The metrics records of a JSONL file; lines that are not one are skipped
    (:func:`read_metrics_counted` says which)."""
    return read_metrics_counted(path)[0]


def skipped_lines_message(path: str | os.PathLike, skipped: list[int]) -> str:
    """One line naming how many lines of ``path`` were skipped and the first few of them."""
    shown = ", ".join(map(str, skipped[:5])) + (", …" if len(skipped) > 5 else "")
    if len(skipped) == 1:
        return (
            f"skipped 1 line of {path} (line {shown}) that is not a metrics record (a JSON object with "
            "an integer step)"
        )
    return (
        f"skipped {len(skipped)} lines of {path} (lines {shown}) that are not metrics records (JSON objects "
        "with an integer step)"
    )


def truncate_jsonl(path: str | os.PathLike, last_step: int, log: Callable[[str], None] | None = None) -> None:
    """Keep the records of a step-keyed JSONL file up to ``last_step`` (-1 empties it). Lines that are
    not records are dropped, and ``log`` told how many (:func:`read_metrics_counted`)."""
    p = Path(path)
    if not p.exists():
        return
    records, skipped = read_metrics_counted(p)
    if skipped and log is not None:
        log(f"warning: {skipped_lines_message(p, skipped)}; dropped")
    kept = [r for r in records if r["step"] <= last_step]
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, p)


def restore_record(path: str | os.PathLike, step: int, record: dict[str, Any] | None) -> None:
    """Append ``record``, the metrics line a checkpoint of ``step`` kept, to the metrics file at
    ``path`` unless it holds that step already (the crash came between the save and the write)."""
    if not record:
        return
    if step not in [r.get("step") for r in read_metrics(path)]:
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, **record}) + "\n")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e4):
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class Tracker:
    """Send each step's metrics to every configured logger, with the same names everywhere."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        loggers: list[str],
        *,
        total_steps: int,
        config: dict,
        project: str,
        experiment: str,
        log_freq: int = 10,
        stream=None,
        key_metrics: dict[str, str] | None = None,
        callbacks: Sequence[Callable[[int, dict], None]] = (),
    ) -> None:
        # key_metrics: metric → short name shown on the progress bar; a record holding one of them
        # is a training step (the RL loop's by default; the SFT and DPO trainers pass theirs).
        # callbacks: called as callback(step, metrics) after every other sink has the record.
        self.callbacks = list(callbacks)
        self.key_metrics = KEY_METRICS if key_metrics is None else key_metrics
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = loggers
        self.log_freq = log_freq
        self.stream = stream or sys.stderr
        # Always written, whatever the logger list: it is the run's record (tearless report, resume).
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")
        self.bar = None
        if "console" in loggers:
            # tqdm.auto: a widget in Jupyter (with ipywidgets), plain text in a terminal.
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, desc="train", file=self.stream, dynamic_ncols=True)
        self.tb = None
        if "tensorboard" in loggers:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "trainer.logger has tensorboard but it is not installed: pip install 'tearless[logging]'"
                ) from e
            self.tb = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.wandb = None
        if "wandb" in loggers:
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    "trainer.logger has wandb but it is not installed: "
                    "pip install 'tearless[logging]' (WANDB_MODE=offline works without network)"
                ) from e
            self.wandb = wandb.init(project=project, name=experiment, config=config, dir=str(self.run_dir))
        self.mlflow = None
        if "mlflow" in loggers:
            self.mlflow = _start_mlflow(self.run_dir, config, project, experiment)

    def start_at(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in clean.items():
                if isinstance(v, float) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.mlflow is not None:
            scalars = {
                mlflow_name(k): v for k, v in clean.items() if isinstance(v, float) and math.isfinite(v)
            }
            self.mlflow.log_metrics(scalars, step=step)
        if self.bar is not None and any(k in clean for k in self.key_metrics):
            self.bar.set_postfix(
                {short: _fmt(clean[k]) for k, short in self.key_metrics.items() if k in clean}, refresh=False
            )
            self.bar.update(step - self.bar.n)
            if self.log_freq > 0 and step % self.log_freq == 0:
                self.print_table(clean, step)
        for callback in self.callbacks:
            callback(step, dict(clean))

    def print_table(self, metrics: dict[str, Any], step: int) -> None:
        keys = sorted(k for k in metrics if isinstance(metrics[k], float))
        lines = [f"step {step}"] + [f"  {k:<40} {_fmt(metrics[k])}" for k in keys]
        self.write("\n".join(lines))

    def write(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        elif "console" in self.loggers:
            print(text, file=self.stream)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()


def _start_mlflow(run_dir: Path, config: dict, project: str, experiment: str):
    """Start an MLflow run (experiment = project, run name = experiment) and return the module.

    Without ``MLFLOW_TRACKING_URI`` the run is stored in ``<run_dir>/mlruns`` rather than the working
    directory.
    """
    try:
        import mlflow
    except ImportError as e:
        raise ImportError("trainer.logger has mlflow but it is not installed: pip install mlflow") from e
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
    mlflow.set_experiment(project)
    mlflow.start_run(run_name=experiment)
    mlflow.log_dict(config, "config.json")
    return mlflow
