"""PNG plots of metric histories: one panel per family of metrics, one line per metric and run.

matplotlib is imported inside :func:`draw_panels` (through its object-oriented ``Figure``, which
renders with Agg and touches no global backend state), so ``import tearless`` stays light.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tearless.report.diagnose import History, series


@dataclass(frozen=True)
class Panel:
    """A plot: its title, the metrics it shows (exact names) and metric-name prefixes it takes in."""

    title: str
    keys: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    requires: str | None = None  # drawn only when this metric was logged (values: a critic)

    def metrics(self, names: set[str]) -> list[str]:
        """The metrics of this panel among ``names``, in panel order then sorted by name."""
        if self.requires is not None and self.requires not in names:
            return []
        exact = [k for k in self.keys if k in names]
        by_prefix = sorted(n for n in names if n.startswith(self.prefixes) and n not in exact)
        return exact + by_prefix if self.prefixes else exact


PANELS: tuple[Panel, ...] = (
    Panel("Reward", ("critic/score/mean", "critic/rewards/mean")),
    Panel("Accuracy", ("reward/accuracy",)),
    Panel("Validation accuracy", prefixes=("val-core/", "val/")),
    Panel("Policy loss", ("actor/pg_loss",)),
    Panel("Clip fractions", ("actor/pg_clipfrac", "actor/pg_clipfrac_lower")),
    Panel("PPO KL (to the old policy)", ("actor/ppo_kl",)),
    Panel("KL to the reference", ("actor/kl_loss", "actor/reward_kl_penalty")),
    Panel("Entropy", ("actor/entropy",)),
    Panel("Response length", ("response_length/mean", "response_length/max", "response_length/min")),
    Panel("Truncated responses (share)", ("response_length/clip_ratio",)),
    Panel("Gradient norm", ("actor/grad_norm", "critic/grad_norm")),
    Panel("Advantages", ("critic/advantages/mean", "critic/advantages/max", "critic/advantages/min")),
    Panel("Value loss", ("critic/vf_loss",)),
    Panel("Explained variance", ("critic/vf_explained_var",)),
    # Without a critic the returns are the advantages (shown above): no panel.
    Panel("Values and returns", ("critic/values/mean", "critic/returns/mean"), requires="critic/values/mean"),
    Panel("Timing per phase (s)", prefixes=("timing_s/",)),
    Panel("Throughput (tokens/s)", ("perf/throughput",)),
)

# Validation logs many metrics (pass@k, reward/…); the panel keeps accuracies, which people compare.
_VALIDATION_WORD = "/acc/"


@dataclass(frozen=True)
class Plot:
    """A drawn panel: its title, the PNG and the metrics on it."""

    title: str
    path: Path
    metrics: list[str]


def same_as_mean(key: str, record: Mapping) -> bool:
    """Whether ``key`` is an unbiased ``…/acc/pass@1`` that equals the record's ``…/acc/mean@n``
    (pass@1 = c/n averaged = mean@n), so it would only draw a second copy of that line."""
    if not key.endswith("/acc/pass@1"):
        return False
    prefix = key[: -len("pass@1")]
    return any(k.startswith(prefix + "mean@") for k in record)


def _metric_names(histories: Mapping[str, History]) -> set[str]:
    names = {
        k
        for h in histories.values()
        for r in h
        for k, v in r.items()
        if isinstance(v, (int, float)) and not same_as_mean(k, r)
    }
    names.discard("step")
    # Validation metrics other than accuracies would crowd the panel.
    return {n for n in names if not n.startswith(("val-core/", "val/")) or _VALIDATION_WORD in n}


def _slug(title: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in title.lower()).strip("_")


def draw_panels(histories: Mapping[str, History], out_dir: Path, dpi: int = 90) -> list[Plot]:
    """Draw every panel with data for the runs in ``histories`` (label → history) into ``out_dir``.

    One run: a line per metric. Several runs: a colour per run and a line style per metric, so the same
    metric of two runs is easy to tell apart. A metric with few points (validation) gets markers.
    """
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    names = _metric_names(histories)
    plots = []
    for panel in PANELS:
        metrics = panel.metrics(names)
        if not metrics:
            continue
        fig = Figure(figsize=(6.4, 3.6), layout="tight")
        ax = fig.add_subplot()
        styles = ("-", "--", ":", "-.")
        drawn = 0
        for run_index, (label, history) in enumerate(histories.items()):
            for metric_index, metric in enumerate(metrics):
                points = series(history, metric)
                if not points:
                    continue
                steps, values = zip(*points, strict=True)
                name = metric if len(histories) == 1 else f"{label}: {metric}"
                # A timing logged only at validation (before and after training) is two far-apart
                # points: markers, not a line across the run.
                sparse = metric.startswith("timing_s/") and len(points) * 2 < len(history)
                ax.plot(
                    steps,
                    values,
                    label=name,
                    color=f"C{(metric_index if len(histories) == 1 else run_index) % 10}",
                    linestyle="none"
                    if sparse
                    else "-"
                    if len(histories) == 1
                    else styles[metric_index % len(styles)],
                    marker="o" if len(points) < 12 or sparse else None,
                    markersize=3,
                )
                drawn += 1
        if not drawn:
            continue
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", ncols=max(1, math.ceil(drawn / 8)))
        path = out_dir / f"{len(plots):02d}_{_slug(panel.title)}.png"
        fig.savefig(path, dpi=dpi)
        plots.append(Plot(panel.title, path, metrics))
    return plots
