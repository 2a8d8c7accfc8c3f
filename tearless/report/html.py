"""``tearless report`` and ``tearless compare``: one self-contained HTML page per run (or set of runs).

The page embeds its PNGs as base64 data URIs, so it can be mailed or opened anywhere; the same PNGs
are also written beside it under ``report/`` (``compare/`` for comparisons). A run still going, or one
that crashed mid-write, is read up to its last complete line.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from tearless.report.diagnose import Diagnosis, History, diagnose, step_ranges
from tearless.report.plots import Plot, draw_panels, same_as_mean
from tearless.run.tracking import read_metrics_counted, skipped_lines_message

# Config keys a reader wants first; the whole config is in the run's config.json.
CONFIG_HIGHLIGHTS = (
    "algorithm.adv_estimator",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.actor.optim.lr",
    "data.train_batch_size",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "actor_rollout_ref.actor.clip_ratio",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "algorithm.use_kl_in_reward",
    "data.max_response_length",
    "trainer.total_training_steps",
)

_CSS = """
body { font-family: system-ui, sans-serif; max-width: 1400px; margin: 1em auto; padding: 0 1em; }
table { border-collapse: collapse; margin: .5em 0; } td, th { padding: 2px 10px; text-align: left; }
tr:nth-child(even) { background: #f4f4f4; }
.plots { display: flex; flex-wrap: wrap; gap: 8px; } .plots img { width: 640px; max-width: 100%; }
.diagnosis { border-left: 4px solid #e0a000; padding: 4px 12px; margin: 8px 0; background: #fffaf0; }
.diagnosis.error { border-color: #c00000; background: #fff4f4; }
.ok { color: #207020; }
"""


class RunDirError(FileNotFoundError):
    """The directory is not a run directory (it has no metrics.jsonl)."""


def load_run(run_dir: str | Path, log: Callable[[str], None] | None = None) -> tuple[list[dict], dict]:
    """The run's metric history (sorted by step) and its config (empty when there is no config.json).

    What the page cannot use is skipped and counted, never fatal (``log`` gets one line for each
    kind): lines of ``metrics.jsonl`` that are not metrics records
    (:func:`~tearless.run.tracking.read_metrics_counted`), metric values that are not numbers,
    and a ``config.json`` that is not a JSON object."""
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        raise RunDirError(f"{run}: no metrics.jsonl here; pass a run directory (trainer.default_local_dir)")
    records, skipped = read_metrics_counted(metrics)
    if skipped and log is not None:
        log(skipped_lines_message(metrics, skipped))
    history, dropped = [], []
    for record in records:
        numbers = {k: v for k, v in record.items() if _is_number(v)}
        dropped += [k for k in record if k not in numbers]
        history.append(numbers)
    if dropped and log is not None:
        names = ", ".join(sorted(set(dropped))[:5])
        what = "value that is not a number" if len(dropped) == 1 else "values that are not numbers"
        log(f"ignored {len(dropped)} {what} in {metrics} ({names})")
    history.sort(key=lambda r: r["step"])
    config_file = run / "config.json"
    try:
        config = json.loads(config_file.read_bytes()) if config_file.is_file() else {}
    except (ValueError, RecursionError) as e:
        config = None
        why = str(e)[:80]
    else:
        why = "not a JSON object"
    if not isinstance(config, dict):
        if log is not None:
            log(f"ignored {config_file} ({why}): the summary shows no config values")
        config = {}
    return history, config


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _lookup(config: Mapping, dotted: str) -> object:
    node: object = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _table(rows: Sequence[Sequence[object]], header: Sequence[str] = ()) -> str:
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table>{head}{body}</table>"


def _is_validation_accuracy(key: str) -> bool:
    return key.startswith(("val-core/", "val/")) and "/acc/" in key


def _validation(history: History) -> tuple[dict, dict]:
    """The first and the last validation records (validation metrics only)."""
    records = [
        {
            "step": r.get("step", 0),
            **{k: v for k, v in r.items() if _is_validation_accuracy(k) and not same_as_mean(k, r)},
        }
        for r in history
        if any(_is_validation_accuracy(k) for k in r)
    ]
    return (records[0], records[-1]) if records else ({}, {})


def _summary(run_dir: Path, history: History, config: Mapping) -> str:
    train_steps = [r["step"] for r in history if r.get("step", 0) > 0]
    # The run's own step count (total_training_steps, or epochs × batches when that is null).
    logged_total = max(
        (int(r["training/total_steps"]) for r in history if "training/total_steps" in r), default=0
    )
    total = _lookup(config, "trainer.total_training_steps") or logged_total or None
    last = max(train_steps, default=0)
    state = "finished" if total and last >= total else "still going or stopped early"
    checkpoints = sorted(p.name for p in run_dir.glob("global_step_*") if p.is_dir())
    of_total = f" of {total}" if total else ""
    rows = [
        ("run directory", str(run_dir)),
        ("training steps logged", f"{len(train_steps)} (last step {last}{of_total}: {state})"),
        ("checkpoints", ", ".join(checkpoints) or "-"),
    ]
    config_rows = [(k, v) for k in CONFIG_HIGHLIGHTS if (v := _lookup(config, k)) is not None]
    first, final = _validation(history)
    val_rows = [(k, first.get(k, "-"), v) for k, v in sorted(final.items()) if k != "step"]
    out = "<h2>Run</h2>" + _table(rows)
    if config_rows:
        out += "<h3>Config highlights</h3>" + _table(config_rows, ("key", "value"))
    if val_rows:
        out += f"<h3>Validation (step {first['step']} → step {final['step']})</h3>"
        out += _table(val_rows, ("metric", f"step {first['step']}", f"step {final['step']}"))
    return out


def _diagnoses(found: Sequence[Diagnosis]) -> str:
    out = '<h2 id="diagnosis">Diagnosis</h2>'
    if not found:
        return out + '<p class="ok">No rule fired: no pathology the rules know of was seen.</p>'
    for d in found:
        out += (
            f'<div class="diagnosis {d.severity}"><h3>{html.escape(d.name)} ({d.severity})</h3>'
            f"<p><b>Seen:</b> {html.escape(d.what_was_seen)}</p>"
            f"<p><b>Steps:</b> {html.escape(step_ranges(d.steps))}</p>"
            f"<p><b>Try:</b> {html.escape(d.what_to_try)}</p></div>"
        )
    return out


def _images(plots: Sequence[Plot]) -> str:
    imgs = "".join(
        f'<img alt="{html.escape(p.title)}" title="{html.escape(", ".join(p.metrics))}" '
        f'src="data:image/png;base64,{base64.b64encode(p.path.read_bytes()).decode()}">'
        for p in plots
    )
    return f'<h2>Plots</h2><div class="plots">{imgs}</div>'


def _page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )


def write_report(
    run_dir: str | Path, out: str | Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``RUN_DIR/report.html``); return its path.

    Raises :class:`RunDirError` when ``run_dir`` has no ``metrics.jsonl``; ``log`` gets a line for
    what was skipped (:func:`load_run`).
    """
    run = Path(run_dir)
    history, config = load_run(run, log)
    page = Path(out) if out is not None else run / "report.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    plots = draw_panels({run.name: history}, page.parent / "report")
    body = _summary(run, history, config) + _diagnoses(diagnose(history)) + _images(plots)
    page.write_text(_page(f"tearless report: {run.name}", body))
    return page


def compare(
    run_dirs: Sequence[str | Path], out: str | Path, log: Callable[[str], None] | None = None
) -> Path:
    """Overlay the metrics of several runs on one page at ``out``; return its path.

    Runs are labelled by directory name (by path and position where two names are the same); ``log``
    gets a line for what was skipped (:func:`load_run`).
    """
    runs = [Path(r) for r in run_dirs]
    names = [r.name for r in runs]
    labels = [r.name if names.count(r.name) == 1 else f"{r} (#{i + 1})" for i, r in enumerate(runs)]
    loaded = {label: load_run(run, log) for label, run in zip(labels, runs, strict=True)}
    page = Path(out)
    page.parent.mkdir(parents=True, exist_ok=True)
    plots = draw_panels({label: h for label, (h, _) in loaded.items()}, page.parent / "compare")
    rows = []
    for label, (history, config) in loaded.items():
        found = diagnose(history)
        steps = max((r.get("step", 0) for r in history), default=0)
        final = _validation(history)[1]
        accuracy = ", ".join(f"{k.split('/', 1)[1]}={v:.3f}" for k, v in sorted(final.items()) if k != "step")
        rows.append(
            (
                label,
                _lookup(config, "algorithm.adv_estimator") or "-",
                steps,
                accuracy or "-",
                ", ".join(d.name for d in found) or "none",
            )
        )
    table = _table(rows, ("run", "estimator", "last step", "final validation", "diagnoses"))
    title = "tearless compare: " + " vs ".join(labels)
    page.write_text(_page(title, "<h2>Runs</h2>" + table + _images(plots)))
    return page
