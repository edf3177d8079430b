"""Sweeps through a real Slurm cluster (tools/slurm_local.sh): jobs go out with sbatch, sacct
says COMPLETED, the aggregate table equals the local launcher's; a scancel'ed job and a job over
its time limit show as failed with their Slurm state and the sweep exits non-zero; `down` stops
everything the cluster started and `up` brings it back.

    tools/slurm_local.sh up
    SPLITLAB_REQUIRE_SLURM=1 .venv/bin/pytest tests/integration/test_slurm.py -q

The failing sweep spends a minute waiting for its time limit at ~0.13 of a core, so it starts
with the module and the passing sweeps run beside it; its tests then wait for it, and a job
submitted after it shows the cluster still takes work. `down`/`up` runs last and leaves the
cluster up.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest

from splitlab.cluster.slurm_jobs import query_sacct, read_record

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = Path(os.environ.get("SPLITLAB_SLURM_DIR", "/var/tmp/splitlab-slurm"))
# Small enough that every job of a sweep runs at once on the local node.
ON_SLURM = ["hydra/launcher=slurm", "hydra.launcher.mem_gb=2", "hydra.launcher.timeout_min=10"]
# Two of the sweep's four layouts: a 3-stage and a 4-stage ring.
RING = ["+sweep=ring_cuts", "architecture.cuts=[1,2],[1,2,3]", "task.max_new_tokens=4"]
TINY_FINETUNE = [
    "model=tiny_bert", "architecture.owners=1", "data.samples_per_owner=16",
    "data.val_samples=16", "data.test_samples=16", "finetune.batch_size=4", "task.rounds=1",
    "architecture.cut_layers=1,2",
]  # fmt: skip
# Figures that are timings (wall_s, trace_span_s, *_ms, ...): equal tables mean equal
# everything else.
TIMED = ("_ms", "tokens_per_s", "_s_")


def splitlab(*argv: str) -> list[str]:
    return [sys.executable, "-m", "splitlab", "-m", *argv]


def run(argv: list[str], timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, text=True, capture_output=True, timeout=timeout_s,
                          check=False)  # fmt: skip


def aggregate(sweep: Path) -> pd.DataFrame:
    done = run([sys.executable, "tools/aggregate_sweep.py", str(sweep)])
    assert done.returncode == 0, done.stderr[-3000:]
    return pd.read_csv(sweep / "sweep.csv", dtype=str)


def untimed(table: pd.DataFrame) -> pd.DataFrame:
    return table[[c for c in table.columns
                  if not (c.endswith("_s") or any(t in c for t in TIMED))]]  # fmt: skip


def slurm_and_local(tmp_path: Path, overrides: list[str], num_jobs: int) -> None:
    """The same sweep through sbatch and through Hydra's local launcher (at the same time)."""
    on_slurm, local = tmp_path / "slurm", tmp_path / "local"
    with subprocess.Popen(splitlab(*ON_SLURM, *overrides, f"hydra.sweep.dir={on_slurm}"),
                          cwd=REPO, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT) as submitted:  # fmt: skip
        done_local = run(splitlab(*overrides, f"hydra.sweep.dir={local}"))
        out, _ = submitted.communicate(timeout=600)
    assert done_local.returncode == 0, done_local.stderr[-3000:]
    assert submitted.returncode == 0, out[-3000:]

    records = [read_record(on_slurm / str(n)) for n in range(num_jobs)]
    assert all(r is not None for r in records)
    states = query_sacct(r.job_id for r in records)
    assert states is not None, "sacct did not answer"
    assert [states[r.job_id][0] for r in records] == ["COMPLETED"] * num_jobs
    assert (on_slurm / ".submitit").is_dir()

    slurm_table, local_table = aggregate(on_slurm), aggregate(local)
    assert slurm_table.columns.tolist() == local_table.columns.tolist()
    assert (slurm_table["status"] == "ok").all()
    pd.testing.assert_frame_equal(untimed(slurm_table), untimed(local_table))


def assert_takes_a_job(tmp_path: Path) -> None:
    done = run(["sbatch", "--wait", "-o", str(tmp_path / "job.out"), "--wrap", "echo ok"],
               timeout_s=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "job.out").read_text().strip() == "ok"


@dataclass
class FailingSweep:
    """Two long ring jobs with a 1-minute limit: job 0 is scancel'ed once running (by a thread,
    while the tests beside it run), job 1 runs into its limit.

    The middle stage sleeps 49x its compute per token (`drift=one_slow_node`), so the jobs
    take ~0.13 of a core rather than ~1.1 for that minute, away from the tests beside them."""

    sweep: Path
    proc: subprocess.Popen[str] | None = None
    problem: str = ""  # what went wrong while cancelling job 0
    result: tuple[int, str, pd.DataFrame] | None = None
    _cancel: threading.Thread | None = field(default=None, repr=False)

    @property
    def log(self) -> Path:
        return self.sweep.parent / "sweep.log"

    def start(self) -> None:
        long_ring = ["task=infer", "model=tiny_llama", "model.max_position_embeddings=100000",
                     "task.max_new_tokens=90000", "drift=one_slow_node", "drift.phi=50",
                     "task.seed=0,1"]  # fmt: skip
        argv = splitlab(*ON_SLURM, *long_ring, "hydra.launcher.timeout_min=1",
                        f"hydra.sweep.dir={self.sweep}")  # fmt: skip
        self.sweep.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w", encoding="utf-8") as log:  # a file: nobody reads a pipe meanwhile
            self.proc = subprocess.Popen(argv, cwd=REPO, text=True, stdout=log,
                                         stderr=subprocess.STDOUT)  # fmt: skip
        self._cancel = threading.Thread(target=self._cancel_job0, daemon=True)
        self._cancel.start()

    def _cancel_job0(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + 240
        while not (self.sweep / "0" / ".hydra" / "overrides.yaml").is_file():
            if self.proc.poll() is not None:
                self.problem = "the sweep ended before job 0 started"
                return
            if time.monotonic() > deadline:
                self.problem = "job 0 did not start within 240 s"
                return
            time.sleep(1)
        (job0,) = [p.name for p in (self.sweep / ".submitit").glob("*_0")]
        subprocess.run(["scancel", job0], check=True, timeout=30)

    def finish(self) -> tuple[int, str, pd.DataFrame]:
        """The finished sweep's exit code, its output and its aggregate table."""
        if self.result is None:
            assert self.proc is not None and self._cancel is not None
            self._cancel.join(timeout=300)
            self.proc.wait(timeout=400)
            out = self.log.read_text(encoding="utf-8")
            assert not self.problem, f"{self.problem}: {out[-3000:]}"
            self.result = (self.proc.returncode, out, aggregate(self.sweep))
        return self.result

    def stop(self) -> None:
        """Cancel whatever of the sweep still runs (a partial run of this module)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        jobs = {p.name.split("_")[0] for p in (self.sweep / ".submitit").glob("*_*")}
        if jobs:
            subprocess.run(["scancel", *sorted(jobs)], check=False, timeout=30)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", autouse=True)
def failing_sweep(tmp_path_factory: pytest.TempPathFactory):
    """Started before the module's first test; its tests call `finish()`."""
    sweep = FailingSweep(tmp_path_factory.mktemp("failing") / "sweep")
    sweep.start()
    yield sweep
    sweep.stop()


def test_ring_cuts_through_sbatch_gives_the_local_table(tmp_path: Path) -> None:
    slurm_and_local(tmp_path, RING, num_jobs=2)


@pytest.mark.assets
def test_tiny_finetune_sweep_through_sbatch_gives_the_local_table(tmp_path: Path) -> None:
    slurm_and_local(tmp_path, TINY_FINETUNE, num_jobs=2)


def test_a_scancelled_job_shows_as_failed_with_its_state(failing_sweep: FailingSweep) -> None:
    code, out, table = failing_sweep.finish()
    assert code != 0 and "Slurm jobs failed" in out
    row = table.iloc[0]
    assert (row["status"], row["slurm_state"]) == ("failed", "CANCELLED")
    assert "CANCELLED" in row["log_tail"]  # slurmstepd's line in the job's log


def test_a_job_over_its_time_limit_shows_as_failed_with_its_state(
    failing_sweep: FailingSweep,
) -> None:
    code, _, table = failing_sweep.finish()
    row = table.iloc[1]
    assert (row["status"], row["slurm_state"]) == ("failed", "TIMEOUT")
    assert isinstance(row["log_tail"], str) and row["log_tail"]


def test_the_cluster_takes_a_job_after_the_failed_sweep(
    failing_sweep: FailingSweep, tmp_path: Path
) -> None:
    failing_sweep.finish()
    assert_takes_a_job(tmp_path)


def test_down_leaves_nothing_and_up_after_down_takes_jobs(
    failing_sweep: FailingSweep, tmp_path: Path
) -> None:
    failing_sweep.stop()  # a partial run of the module: nothing of it runs while `down` does
    pids = [int(p.read_text()) for p in (SLURM_DIR / "run").glob("*.pid")]
    assert pids, f"no pid files under {SLURM_DIR / 'run'}"

    down = run(["tools/slurm_local.sh", "down"], timeout_s=180)

    assert down.returncode == 0, down.stderr[-3000:]
    assert not SLURM_DIR.exists()
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists()] == []

    up = run(["tools/slurm_local.sh", "up"], timeout_s=600)
    assert up.returncode == 0, up.stderr[-3000:]
    assert run(["tools/slurm_local.sh", "status"]).returncode == 0
    assert_takes_a_job(tmp_path)
