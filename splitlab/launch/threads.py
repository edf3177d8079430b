"""How the launchers share a host's cores among the node processes they start on it.

Every stage and training process gets its intra-op thread count in `OMP_NUM_THREADS` and the
OpenMP wait policy of `omp_env`. Nothing here imports torch: `tools/bench_ushape.py` sets the
policy before torch loads OpenMP. A user's own OMP_NUM_THREADS, OMP_WAIT_POLICY or
GOMP_SPINCOUNT wins over every figure chosen here.

    .venv/bin/pytest tests/unit/test_launch_threads.py -q
"""

from __future__ import annotations

import os

from splitlab.train.role import COORDINATOR

SPIN_COUNT = 20000  # GOMP_SPINCOUNT: busy-wait iterations before an idle OpenMP thread sleeps


def omp_env() -> dict[str, str]:
    """OpenMP environment of stage and training processes: idle threads spin `SPIN_COUNT`
    iterations, then sleep (libgomp's `GOMP_SPINCOUNT` under `OMP_WAIT_POLICY=PASSIVE`).

    Only one stage computes at a time. With the default policy (300,000 spins, ~ms) the idle
    stages' threads spin on the cores the working one needs; with PASSIVE alone (0 spins)
    every parallel region of a token wakes sleeping threads through the kernel. In between,
    threads stay awake across one token's regions (microseconds apart) and sleep while the
    other stages compute (milliseconds). SmolLM2, 3 stages, 2 cores, quiet, ring TPOT vs one
    process 33.3 ms (both arms under the same policy, `tools/bench_ring.py`): 0 spins
    63.6 ms (1.90x), 2,000 57 ms, 8,000 43-50 ms, 20,000 39.2 ms (1.18x), 50,000 40.1 ms,
    200,000 41-43 ms; the main job 83-85 s -> 77-79 s. A user's own OMP_WAIT_POLICY or
    GOMP_SPINCOUNT wins (and then nothing else is set).
    """
    own = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    return own or {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(SPIN_COUNT)}


def thread_env(threads: int) -> dict[str, str]:
    """OpenMP settings of one node process: `threads` intra-op threads, idle ones sleep
    (`omp_env`). With the defaults every node spins a thread per core: on 2 cores the 1x1
    bench burned 7-9x the CPU per sample under load (tools/bench_ushape.py
    `cpu_ms_per_sample`). A user's own OMP_NUM_THREADS / OMP_WAIT_POLICY win.
    """
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)), **omp_env()}


def stage_threads(*, stages: int, cores: int) -> int:
    """Intra-op threads of each of `stages` ring stages sharing `cores`: cores // stages.

    Only one stage computes at a time, yet a stage given every core runs its blocks slower
    than the same blocks in one process: its threads slept while the other stages computed,
    and their waking and the last stage's spinning threads cost more than a second thread
    gains on a decode step that streams weights from memory. SmolLM2, 3 stages on 2 cores
    (AMD EPYC, load 1.0-1.6, none noisy), `tools/bench_ring.py --tokens 128 --reps 1` three
    times each, alternating, both arms at the same count: 2 threads each, ring 83.9 / 92.9 /
    86.4 ms against one process 64.3 / 73.7 / 68.2 (1.26-1.30x); 1 thread each, ring 68.5 /
    78.6 / 70.1 against 69.6 / 69.7 / 60.3 (0.98-1.16x). The one process is as fast on 1
    thread as on 2 here; the stages' compute fell from 24-36 to 18-34 ms.
    """
    return max(1, cores // max(1, stages))


def local_stage_env(stages: int) -> dict[str, str]:
    """`thread_env` of each of `stages` ring stages started on this host (`stage_threads` of
    its cores)."""
    return thread_env(stage_threads(stages=stages, cores=os.cpu_count() or 1))


def role_threads(*, owners: int, workers: int, cores: int) -> dict[str, int]:
    """Intra-op threads per role for training processes sharing `cores`.

    A worker runs the body (most of the model) for every owner, so it is the critical path
    while the owners mostly wait for it: workers share all cores among themselves; owners and
    the coordinator (it only averages) get cores // (owners + workers). Idle threads sleep
    (`thread_env`), so a worker's threads cost nothing while it waits. On 2 cores, the main
    job (2 owners x 1 worker): 120.2 s with 1 thread each, 102.7 s with the worker on 2,
    105.0 s with every node on 2 (quiet, load 1.6-2.3, test accuracy 0.796-0.803).
    """
    share = max(1, cores // max(1, owners + workers))
    return {COORDINATOR: share, "owner": share, "worker": max(1, cores // max(1, workers))}
