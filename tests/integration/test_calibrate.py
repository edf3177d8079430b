"""Calibration: the full SmolLM2 run fits decode with r^2 >= 0.9 and writes nulls for what it did
not observe; `splitlab task=calibrate` on a tiny model writes the same shape, `analyze` plots it,
and `schema_from` diffs keys against another device file.

.venv/bin/pytest tests/integration/test_calibrate.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from splitlab.analysis.fits import CalibrationResult, load_cost, select_record
from splitlab.analysis.report import analyze_run
from splitlab.config.schema import CalibrateTaskConfig
from splitlab.configure import compose_config
from splitlab.errors import ConfigError
from splitlab.measure.calibrate import options_from

REPO = Path(__file__).resolve().parents[2]
TOP_KEYS = {"version", "model", "device", "dtype", "calibrated", "warnings", "fits",
            "weight_load_ms", "swap_ms", "link", "load", "contention", "thermal"}  # fmt: skip


def _record(path: Path) -> dict:
    document = json.loads(path.read_text(encoding="utf-8"))
    assert document["version"] == 1 and len(document["records"]) == 1
    ((key, record),) = document["records"].items()
    assert key == f"{record['model']}|{record['device']}|{record['dtype']}"
    return record


def _assert_uncalibrated_with_nulls(record: dict) -> None:
    assert TOP_KEYS <= set(record)
    assert record["calibrated"] is False
    assert record["swap_ms"] is None  # CPU only: nothing to swap to
    assert record["contention"]["rho"] is None
    assert record["link"]["loopback"] is True
    assert any("NOT A LINK MEASUREMENT" in w for w in record["warnings"])
    assert any("swap_ms is null" in w for w in record["warnings"])
    assert record["weight_load_ms"]["cache"] in ("cold", "warm", "unknown")
    if record["thermal"] is None:
        assert any("thermal is null" in w for w in record["warnings"])
    CalibrationResult.from_dict(record)  # the record reads back


@pytest.mark.slow
@pytest.mark.assets
def test_smollm2_full_calibration_fits_decode(tmp_path: Path) -> None:
    out = tmp_path / "smollm2.json"
    done = subprocess.run(
        [sys.executable, "tools/calibrate.py", "--threads", "1", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = _record(out)
    _assert_uncalibrated_with_nulls(record)
    decode, prefill = record["fits"]["decode"], record["fits"]["prefill"]
    assert max(x for x, _ in decode["points"]) > 8192
    assert min(x for x, _ in prefill["points"]) >= 512
    assert decode["r2"] >= 0.9, decode
    assert "decode:" in done.stdout and "r2=" in done.stdout


def test_task_calibrate_tiny_quick_then_analyze(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "splitlab", "task=calibrate", "model=tiny_llama", "task.quick=true",
         "task.threads=1", "task.blocks=2", f"hydra.run.dir={run}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = _record(run / "calibration.json")
    _assert_uncalibrated_with_nulls(record)
    assert record["model"] == "tiny_llama" and record["blocks"] == [1, 3]
    assert [n for n, _ in record["load"]["points"]] == [1, 2, 3, 4]  # L_n over all 4 blocks
    report = analyze_run(run)
    assert {"calibration_decode", "calibration_prefill", "calibration_link",
            "calibration_load"} <= set(report.figures)  # fmt: skip


def test_only_load_writes_an_l_n_fit_the_loader_reads_and_nulls_the_rest(tmp_path: Path) -> None:
    out = tmp_path / "cal.json"
    done = subprocess.run(
        [sys.executable, "tools/calibrate.py", "--model", "tiny_llama", "--quick", "--threads", "1",
         "--only", "load", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    record = _record(out)
    assert record["fits"] == {"decode": None, "prefill": None}
    assert record["link"] is None and record["contention"] is None and record["swap_ms"] is None
    assert any("not measured (task.only=load)" in w for w in record["warnings"])
    load = record["load"]
    assert load["n"] == 4 and load["cache"] in ("cold", "warm", "unknown")
    assert load["warm"]["n"] == 4 and "load:" in done.stdout
    cost = load_cost(select_record(json.loads(out.read_text(encoding="utf-8"))))
    assert cost.per_block_ms == load["per_block_ms"] == load["params"]["per_block_ms"]
    assert cost.ms(2) > 0


def test_schema_from_lists_key_differences(tmp_path: Path) -> None:
    from splitlab.measure.calibrate import diff_against

    ours = {"fits": {"decode": {"r2": 0.9}}, "swap_ms": None, "link": {"alpha_ms": 1.0}}
    other = tmp_path / "devices.json"
    other.write_text(json.dumps({"records": {"m|cuda|bf16": {
        "fits": {"decode": {"r2": 0.5, "c0_ms": 1.0}}, "swap_ms": 2.0, "H_swap": 3.0,
    }}}), encoding="utf-8")  # fmt: skip
    assert diff_against(other, "m|cpu|float32", ours) == [
        "only in b: H_swap",
        "only in b: fits.decode.c0_ms",
        "only in a: link",
    ]


@pytest.mark.parametrize(
    ("override", "match"),
    [("task.decode_steps=8", "decode_steps=8"), ("task.probe_round_trips=5", "round_trips=5"),
     ("task.prefill_min_tokens=64", "prefill_min_tokens=64")],
)  # fmt: skip
def test_settings_that_would_fit_noise_are_refused(override: str, match: str) -> None:
    cfg = compose_config(["task=calibrate", override])
    assert isinstance(cfg.task, CalibrateTaskConfig)
    with pytest.raises(ConfigError, match=match):
        options_from(cfg.task)


def test_quick_options_are_small_and_full_reach_8192() -> None:
    quick = options_from(CalibrateTaskConfig(quick=True))
    full = options_from(CalibrateTaskConfig())
    assert max(quick.contexts) == 2048 and max(full.contexts) == 8192
    assert full.decode_steps >= 24 and min(full.prefill_lengths) >= 512
    assert full.round_trips >= 30
    for options in (quick, full):  # more points than parameters: c0 c1, and d0 d1 d2
        assert len(set(options.contexts)) > 2 and len(set(options.prefill_lengths)) > 3
