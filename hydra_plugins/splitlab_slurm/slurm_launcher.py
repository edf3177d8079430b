"""hydra-submitit-launcher's Slurm launcher with per-job resources and a record of every job.

    tools/slurm_local.sh up && export SLURM_CONF=/var/tmp/splitlab-slurm/etc/slurm.conf
    splitlab -m hydra/launcher=slurm +sweep=ring_cuts hydra.sweep.dir=outputs/sweeps/ring_cuts
    .venv/bin/python tools/aggregate_sweep.py outputs/sweeps/ring_cuts
    .venv/bin/pytest tests/integration/test_slurm.py -q

Three things differ from the stock launcher (`submitit_slurm`):
- resources are resolved per job: `hydra.launcher` is resolved against each job's own config,
  so `cpus_per_task: ${splitlab.num_processes:}` follows the job's stage or node count; jobs
  asking for the same resources go out as one Slurm array;
- it waits for every job (asking sacct every `poll_s`), then writes `SWEEP/<n>/slurm.json`
  (`splitlab.cluster.slurm_jobs.SlurmJobRecord`: state, exit code, log tail of a failed job),
  and raises when any job failed, so the sweep exits non-zero after all jobs have ended;
- a job ignores submitit's pre-timeout signal: splitlab runs are not checkpointable, so Slurm
  ends an over-time job itself and sacct says TIMEOUT. It is ignored from the job's first
  line (`JOB_PYTHON`): with a time limit under submitit's signal lead (1 minute vs 90 s)
  Slurm sends it as the job starts, and it killed jobs still unpickling their function.

It lives under `hydra_plugins` because Hydra instantiates launchers only from there; without the
`cluster` extra (hydra-submitit-launcher) the module defines nothing.
"""

import json
import logging
import shlex
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobStatus
from omegaconf import OmegaConf, open_dict

from splitlab.cluster.slurm_jobs import (
    ACTIVE_STATES,
    SlurmJobRecord,
    log_tail,
    query_sacct,
    write_record,
)

try:
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # the `cluster` extra is not installed: no Slurm launcher
    SlurmLauncher = None

log = logging.getLogger(__name__)

# The job's interpreter: SIGUSR2 ignored before submitit imports anything, then submitit's own
# entry (`python -u -m submitit.core._submit FOLDER` appends its arguments to this command).
_JOB_ENTRY = (
    "import signal, sys; signal.signal(signal.SIGUSR2, signal.SIG_IGN); "
    "sys.argv = ['submitit', sys.argv[-1]]; "
    "from submitit.core.submission import submitit_main; submitit_main()"
)
JOB_PYTHON = f"{shlex.quote(sys.executable)} -u -c {shlex.quote(_JOB_ENTRY)}"

# Keys of our schema that are not submitit parameters.
OWN_KEYS = ("_target_", "poll_s", "log_tail_lines", "state_wait_s")


class SweepJobsFailed(RuntimeError):
    """Some jobs of a Slurm sweep did not complete; the message lists them."""


if SlurmLauncher is not None:

    @dataclass
    class SplitlabSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.splitlab_slurm.slurm_launcher.SplitlabSlurmLauncher"
        poll_s: float = 2.0  # seconds between sacct calls while jobs run
        log_tail_lines: int = 20  # lines of a failed job's logs kept in its slurm.json
        state_wait_s: float = 60.0  # how long to wait for sacct to record final states

    ConfigStore.instance().store(
        group="hydra/launcher", name="splitlab_submitit_slurm", node=SplitlabSlurmConf,
        provider="splitlab",
    )  # fmt: skip

    class SplitlabSlurmLauncher(SlurmLauncher):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            signal.signal(signal.SIGUSR2, signal.SIG_IGN)  # see the module docstring
            return super().__call__(*args, **kwargs)

        def launch(self, job_overrides: Any, initial_job_idx: int) -> Any:
            assert self.config is not None and self.hydra_context is not None
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            groups: dict[str, list[tuple[int, list[str], Path]]] = {}
            params_of: dict[str, dict[str, Any]] = {}
            for offset, overrides in enumerate(job_overrides):
                num = initial_job_idx + offset
                params, job_dir = self._job_params(list(overrides), num)
                key = json.dumps(params, sort_keys=True, default=str)
                params_of[key] = params
                groups.setdefault(key, []).append((num, list(overrides), job_dir))
                log.info("\t#%d : %s", num, " ".join(overrides))
            submitted: list[tuple[int, list[str], Path, Any]] = []
            for key, jobs in groups.items():
                executor = self._executor(dict(params_of[key]))
                # one call of __call__ per job: (overrides, job dir key, number, id, state)
                calls = [
                    (overrides, "hydra.sweep.dir", num, f"job_id_for_{num}", Singleton.get_state())
                    for num, overrides, _ in jobs
                ]
                arrays = executor.map_array(self, *zip(*calls, strict=True))
                for (num, overrides, job_dir), job in zip(jobs, arrays, strict=True):
                    log.info("job #%d is Slurm job %s", num, job.job_id)
                    submitted.append((num, overrides, job_dir, job))
            self._wait([job for *_, job in submitted])
            return self._collect(submitted)

        def _job_params(self, overrides: list[str], num: int) -> tuple[dict[str, Any], Path]:
            """This job's launcher parameters, resolved against its own config, and its folder."""
            assert self.config is not None and self.hydra_context is not None
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(cfg.hydra.job):
                cfg.hydra.job.num = num
                cfg.hydra.job.id = f"job_id_for_{num}"
            params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
            assert isinstance(params, dict)
            job_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
            return {k: v for k, v in params.items() if k not in OWN_KEYS}, job_dir

        def _executor(self, params: dict[str, Any]) -> Any:
            import submitit

            executor = submitit.AutoExecutor(
                cluster="slurm",
                folder=params.pop("submitit_folder"),
                slurm_max_num_timeout=params.pop("max_num_timeout"),
                slurm_python=JOB_PYTHON,
            )
            shared = set(OmegaConf.structured(BaseQueueConf).keys())
            executor.update_parameters(
                **{k if k in shared else f"slurm_{k}": v for k, v in params.items()}
            )
            return executor

        def _wait(self, jobs: list[Any]) -> None:
            """Until every job has a result file or a final state in sacct. Each job's time
            limit bounds the wait once it runs; sacct silent for `state_wait_s` is an error."""
            poll_s, silent_s = float(self.params["poll_s"]), float(self.params["state_wait_s"])
            pending, answered = list(jobs), time.monotonic()
            while pending:
                states = query_sacct(job.job_id for job in pending)
                if states is not None:
                    answered = time.monotonic()
                elif time.monotonic() - answered > silent_s:
                    raise SweepJobsFailed(
                        f"sacct has not answered for {silent_s:.0f} s "
                        f"(hydra.launcher.state_wait_s): Slurm jobs "
                        f"{', '.join(job.job_id for job in pending)} are in an unknown state"
                    )
                pending = [
                    job for job in pending
                    if not job.paths.result_pickle.exists()
                    and (states or {}).get(job.job_id, ("PENDING", ""))[0] in ACTIVE_STATES
                ]  # fmt: skip
                if pending:
                    time.sleep(poll_s)

        def _final_states(self, job_ids: list[str]) -> dict[str, tuple[str, str]]:
            """sacct's states once all are final (slurmdbd may trail slurmctld), bounded."""
            deadline = time.monotonic() + float(self.params["state_wait_s"])
            states = query_sacct(job_ids) or {}
            while time.monotonic() < deadline and any(
                states.get(j, ("PENDING", ""))[0] in ACTIVE_STATES for j in job_ids
            ):
                time.sleep(float(self.params["poll_s"]))
                states = query_sacct(job_ids) or {}
            return states

        def _collect(self, submitted: list[tuple[int, list[str], Path, Any]]) -> list[Any]:
            states = self._final_states([job.job_id for *_, job in submitted])
            tail_lines = int(self.params["log_tail_lines"])
            results, failed = [], []
            for num, overrides, job_dir, job in submitted:
                state, exit_code = states.get(job.job_id, ("UNKNOWN", ""))
                ret, error = None, ""
                if job.paths.result_pickle.exists():
                    try:
                        ret = job.results()[0]
                        if ret.status == JobStatus.FAILED:
                            ret.return_value  # noqa: B018 - raises the job's own error
                    except Exception as exc:  # the job function raised inside the job
                        error = repr(exc)
                record = SlurmJobRecord(
                    job_num=num, job_id=str(job.job_id), state=state, exit_code=exit_code,
                    overrides=overrides, stdout=str(job.paths.stdout),
                    stderr=str(job.paths.stderr), error=error,
                )  # fmt: skip
                if record.failed:
                    paths = (job.paths.stderr, job.paths.stdout)
                    record = replace(record, log_tail=log_tail(paths, tail_lines))
                    failed.append(record)
                write_record(job_dir, record)
                results.append(ret)
            if failed:
                listed = "; ".join(
                    f"#{r.job_num} (Slurm job {r.job_id}) {r.state} exit {r.exit_code or '?'}"
                    + (f": {r.error}" if r.error else "")
                    for r in failed
                )
                sweep_dir = self.config.hydra.sweep.dir if self.config is not None else "SWEEP"
                raise SweepJobsFailed(
                    f"{len(failed)} of {len(submitted)} Slurm jobs failed: {listed} "
                    f"(states and log tails in {sweep_dir}/<n>/slurm.json)"
                )
            return results
