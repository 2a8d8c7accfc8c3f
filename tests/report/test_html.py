"""The HTML report and comparison pages, and the ``tearless report`` / ``compare`` commands."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tearless.cli import main
from tearless.report.html import RunDirError, compare, write_report
from tests.report.histories import healthy, planted, write_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# An empty 576×324 axes saves to ~5 kB; one with lines, a legend and labels to well over 10 kB.
MIN_PLOT_BYTES = 8_000


def embedded_pngs(page: Path) -> list[bytes]:
    """The PNGs of every <img> in ``page`` (all must be base64 data URIs: the page is self-contained)."""
    text = page.read_text()
    sources = re.findall(r'<img [^>]*src="([^"]*)"', text)
    assert len(sources) == text.count("<img ")
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    return [base64.b64decode(s.split(",", 1)[1]) for s in sources]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """The report of a run with a planted truncation problem and a torn last line (still writing)."""
    run = write_run(
        tmp_path_factory.mktemp("runs") / "trunc",
        planted(lambda s: {"response_length/clip_ratio": 0.6}),
        torn=True,
    )
    return write_report(run)


def test_report_embeds_one_png_with_data_per_plot(report):
    pngs = embedded_pngs(report)
    beside = sorted((report.parent / "report").glob("*.png"))
    # reward, accuracy, validation, pg_loss, clip fractions, ppo_kl, KL, entropy, length, truncated,
    # grad norm, advantages, value loss, explained variance, values, timing, throughput
    assert len(pngs) == len(beside) == 17
    assert [p.read_bytes() for p in beside] == pngs
    assert all(p.startswith(PNG_SIGNATURE) and len(p) > MIN_PLOT_BYTES for p in pngs)


def test_report_has_summary_and_diagnosis_and_skips_the_torn_line(report):
    text = report.read_text()
    assert report == report.parent / "report.html"
    assert "20 (last step 20 of 20: finished)" in text  # the torn step 999 is not there
    assert "algorithm.adv_estimator" in text and "grpo" in text
    assert "Validation (step 0 → step 20)" in text and "val-core/arith/acc/greedy" in text
    assert 'id="diagnosis"' in text and "responses pinned at the length cap" in text
    assert "<b>Steps:</b> 11-20" in text and "data.max_response_length" in text


def test_report_draws_only_the_plots_whose_metrics_exist(tmp_path):
    history = [{"step": s, "critic/score/mean": s / 10, "actor/entropy": 1.0} for s in range(1, 6)]
    page = write_report(write_run(tmp_path / "run", history), tmp_path / "out" / "r.html")
    assert len(embedded_pngs(page)) == 2
    assert 'class="ok"' in page.read_text()  # no diagnosis


def test_a_directory_without_metrics_is_refused(tmp_path):
    with pytest.raises(RunDirError, match=str(tmp_path)):
        write_report(tmp_path)


def test_compare_overlays_runs(tmp_path):
    a = write_run(tmp_path / "a", healthy())
    b = write_run(tmp_path / "b", planted(lambda s: {"actor/pg_clipfrac": 0.4}))
    page = compare([a, b], tmp_path / "cmp.html")
    text = page.read_text()
    assert "tearless compare: a vs b" in text
    assert "<td>a</td>" in text and "<td>b</td>" in text and "clip fraction persistently high" in text
    assert len(embedded_pngs(page)) == len(list((tmp_path / "compare").glob("*.png"))) == 17


def test_cli_report_and_compare_exit_0_and_print_the_page(tmp_path, capsys):
    run = write_run(tmp_path / "run", healthy(6))
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report.html")
    assert main(["compare", str(run), str(run), "--out", str(tmp_path / "c.html")]) == 0
    assert (tmp_path / "c.html").is_file()


def test_cli_report_of_a_directory_without_metrics_exits_2_naming_it(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "tearless.cli", "report", str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert f"{tmp_path}: no metrics.jsonl" in proc.stderr


def test_matplotlib_is_not_imported_by_the_cli_module():
    code = "import sys, tearless.cli; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_the_report_renders_in_headless_chromium(report, tmp_path):
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            f"--screenshot={shot}",
            "--window-size=1400,3000",
            report.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    assert shot.read_bytes().startswith(PNG_SIGNATURE)


def test_finished_without_total_steps_in_config_no_pass1_copy_no_returns_without_critic(tmp_path):
    import json

    from tearless.report.plots import same_as_mean

    # A critic-less run of 3 steps whose config leaves total_training_steps null (epochs decide):
    # the trainer logs training/total_steps, which tells the report the run finished.
    val = {"val-core/a/acc/mean@4": 0.5, "val-core/a/acc/pass@1": 0.5, "val-core/a/acc/pass@2": 0.7}
    history = [{"step": 0, **val}] + [
        {"step": s, "critic/score/mean": s / 10, "critic/returns/mean": 0.1, "training/total_steps": 3.0}
        for s in range(1, 4)
    ]
    run = write_run(tmp_path / "run", history)
    (run / "config.json").write_text(json.dumps({"trainer": {"total_training_steps": None}}))
    text = write_report(run).read_text()
    assert "(last step 3 of 3: finished)" in text
    titles = [p.stem for p in sorted((run / "report").glob("*.png"))]
    assert not any("returns" in t for t in titles)  # no critic: no values/returns panel
    assert "val-core/a/acc/pass@1" not in text and "val-core/a/acc/pass@2" in text
    # pass@1 (unbiased) equals mean@n: only a second copy of its line.
    assert same_as_mean("val-core/a/acc/pass@1", val) and not same_as_mean("val-core/a/acc/pass@2", val)
