"""report.html as a person sees it: rendered by headless Chromium, its headline equals the run's
final_metrics.json and every figure is an image that decoded.

    .venv/bin/pytest tests/integration/test_report_browser.py -q

Needs Debian's `chromium` (marker `chromium`: skips without it, fails under
SPLITLAB_REQUIRE_CHROMIUM=1, which `.ci/run` sets after installing it).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from report_helpers import FINAL_METRICS, headline_rows, write_training_run

from splitlab.analysis.report import analyze_run
from splitlab.analysis.sweep import write_aggregate

# Test-side probe appended to a copy of the page: after `load`, each <img> records the width it
# decoded to (0 for a broken image), which the DOM dump then carries.
PROBE = ("<script>window.addEventListener('load', () => { for (const img of document.images) "
         "img.dataset.naturalWidth = img.naturalWidth; });</script>")  # fmt: skip


def rendered_dom(chromium: str, page: Path, tmp_path: Path) -> str:
    """The DOM headless Chromium builds from `page` (probe added), after its load event."""
    probed = tmp_path / f"probed-{page.name}"
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", PROBE + "</body>"))
    done = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu",
         "--virtual-time-budget=10000", "--dump-dom", probed.as_uri()],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and "</html>" in done.stdout, done.stderr[-2000:]
    return done.stdout


def decoded_widths(dom: str) -> list[int]:
    return [int(w) for w in re.findall(r'<img[^>]*data-natural-width="(\d+)"', dom)]


@pytest.mark.chromium
def test_run_report_headline_and_images_in_chromium(chromium: str, tmp_path: Path) -> None:
    run = write_training_run(tmp_path / "run", num_workers=2)
    report = analyze_run(run)

    dom = rendered_dom(chromium, report.path, tmp_path)

    final = json.loads((run / "final_metrics.json").read_text())
    assert final == FINAL_METRICS
    rows = headline_rows(dom)
    assert list(rows)[0] == "test_accuracy"
    assert rows["test_accuracy"]["value"] == final["val_accuracy"]
    assert rows["test_accuracy"]["text"] == "0.801"
    assert rows["test_loss"]["value"] == final["val_loss"]
    assert rows["test_loss"]["text"] == f"{final['val_loss']:.4g}"
    widths = decoded_widths(dom)
    assert len(widths) == len(report.figures) >= 4  # rounds, wrr, bytes, transport
    assert all(w > 0 for w in widths), widths


@pytest.mark.chromium
def test_sweep_report_shows_jobs_side_by_side_in_chromium(chromium: str, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for job, alpha in enumerate((0.5, 1.0)):
        final = {**FINAL_METRICS, "val_accuracy": 0.7 + 0.1 * job}
        write_training_run(sweep / str(job), final=final)
        (sweep / str(job) / ".hydra").mkdir()
        (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(f"- data.alpha={alpha}\n")
    result = write_aggregate(sweep)

    dom = rendered_dom(chromium, result.report, tmp_path)

    jobs = dom[dom.index('id="jobs"') : dom.index("</table>", dom.index('id="jobs"'))]
    cells = [re.findall(r"<td>([^<]*)</td>", row) for row in jobs.split("<tr")[2:]]
    # overrides as typed, then the merged model's test accuracy
    assert [c[:4] for c in cells] == [["0", "ok", "0.5", "0.7"], ["1", "ok", "1.0", "0.8"]]
    assert decoded_widths(dom) and all(w > 0 for w in decoded_widths(dom))
