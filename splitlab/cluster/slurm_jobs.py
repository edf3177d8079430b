"""What each Slurm job of a sweep left behind: its state, exit code and log tail, as a file.

    splitlab -m hydra/launcher=slurm +sweep=ring_cuts hydra.sweep.dir=outputs/sweeps/ring_cuts
    .venv/bin/python tools/aggregate_sweep.py outputs/sweeps/ring_cuts
    .venv/bin/pytest tests/unit/test_slurm_jobs.py tests/integration/test_slurm.py -q

The Slurm launcher (`hydra_plugins/splitlab_slurm`) asks `sacct` once its jobs have ended and
writes one `SlurmJobRecord` per job folder (`SWEEP/<n>/slurm.json`, also for a job cancelled
before it started); `splitlab.analysis.sweep` reads those files and never calls Slurm itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD_FILE = "slurm.json"
# sacct states of a job that may still change; every other state is final.
ACTIVE_STATES = frozenset(
    {"PENDING", "RUNNING", "REQUEUED", "RESIZING", "SUSPENDED", "COMPLETING", "CONFIGURING"}
)


@dataclass(frozen=True)
class SlurmJobRecord:
    """One sweep job as Slurm saw it."""

    job_num: int  # Hydra's job number (the folder name under the sweep)
    job_id: str  # Slurm's id; <array id>_<index> for a task of an array
    state: str  # sacct State, first word: COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, ...
    exit_code: str = ""  # sacct ExitCode, "<code>:<signal>"
    overrides: list[str] = field(default_factory=list)  # the job's sweep overrides
    stdout: str | None = None  # submitit's log files of the job
    stderr: str | None = None
    log_tail: str = ""  # the last lines of those logs, for a failed job
    error: str = ""  # the job function's own error when Slurm still says COMPLETED

    @property
    def failed(self) -> bool:
        return self.state != "COMPLETED" or bool(self.error)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SlurmJobRecord:
        """Reads a record, ignoring fields this version does not know."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def parse_sacct(text: str) -> dict[str, tuple[str, str]]:
    """`sacct -X -n -P -o JobID,State,ExitCode` output -> {job id: (state, exit code)}.

    A state's trailing words go ("CANCELLED by 0" -> "CANCELLED"); lines of array tasks that
    have not started yet ("12_[2-3]") are skipped: their tasks have no state of their own.
    """
    states: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or not parts[0] or "[" in parts[0]:
            continue
        job_id, state, exit_code = parts[0], parts[1].split(" ")[0], parts[2]
        states[job_id] = (state, exit_code)
    return states


def query_sacct(
    job_ids: Iterable[str], *, timeout_s: float = 30.0
) -> dict[str, tuple[str, str]] | None:
    """Asks sacct for the jobs (arrays by their base id); None when sacct fails or times out."""
    bases = sorted({str(job_id).split("_")[0] for job_id in job_ids})
    if not bases:
        return {}
    command = ["sacct", "-X", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", ",".join(bases)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_sacct(done.stdout) if done.returncode == 0 else None


def tail_lines(text: str, num_lines: int) -> str:
    lines = text.rstrip("\n").splitlines()
    return "\n".join(lines[-num_lines:]) if num_lines > 0 else ""


def log_tail(paths: Iterable[str | Path | None], num_lines: int) -> str:
    """The last `num_lines` lines of each existing, non-empty log, each under its file name."""
    parts = []
    for path in paths:
        if path is None or not Path(path).is_file():
            continue
        text = Path(path).read_text(errors="replace")
        if text.strip():
            parts.append(f"==> {Path(path).name} <==\n{tail_lines(text, num_lines)}")
    return "\n".join(parts)


def write_record(job_dir: str | Path, record: SlurmJobRecord) -> Path:
    """Writes JOB/slurm.json atomically (temp file + rename); creates the folder if needed."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / RECORD_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record.to_dict(), indent=1))
    os.replace(tmp, path)
    return path


def read_record(job_dir: str | Path) -> SlurmJobRecord | None:
    """The job folder's record, or None when Slurm did not run it."""
    path = Path(job_dir) / RECORD_FILE
    if not path.is_file():
        return None
    return SlurmJobRecord.from_dict(json.loads(path.read_text()))
