"""The benchmark report's guards: host load parsing and verdict, the physics check, thread
policies, and which targets a report trusts.

.venv/bin/pytest tests/unit/test_telemetry_bench.py -q
"""

from __future__ import annotations

import pytest

from splitlab.telemetry.bench import BenchExit, BenchReport, physics_violation, thread_policy
from splitlab.telemetry.host_load import (
    HostLoadMonitor,
    HostSample,
    descendants,
    noisy_reasons,
    parse_loadavg,
    parse_proc_stat,
    parse_stat,
    running_tasks,
    steal_fraction,
    summarize,
)

STAT = """cpu  100 5 20 800 10 0 5 60 7 0
cpu0 50 2 10 400 5 0 2 30 3 0
intr 1 2 3
procs_running 4
procs_blocked 0
"""


def _sample(*, load_1m: float = 0.5, running: int = 1, total: int = 1000, steal: int = 0,
            own: int = 1) -> HostSample:  # fmt: skip
    return HostSample(load_1m=load_1m, load_5m=load_1m, load_15m=load_1m, procs_running=running,
                      cpu_total_jiffies=total, cpu_steal_jiffies=steal,
                      own_running=own)  # fmt: skip


def _quiet_report() -> BenchReport:
    # so many cores that no real host's load can make this report noisy
    return BenchReport(bench="t", host=HostLoadMonitor(cores=10**9).start())


def test_parse_loadavg_reads_the_three_averages() -> None:
    assert parse_loadavg("7.62 8.40 10.67 5/212 13303\n") == (7.62, 8.40, 10.67)


def test_parse_loadavg_rejects_a_short_text() -> None:
    with pytest.raises(ValueError, match="/proc/loadavg"):
        parse_loadavg("1.0 2.0")


def test_parse_stat_sums_up_to_steal_and_reads_procs_running() -> None:
    assert parse_stat(STAT) == (100 + 5 + 20 + 800 + 10 + 0 + 5 + 60, 60, 4)


def test_parse_stat_without_procs_running_is_an_error() -> None:
    with pytest.raises(ValueError, match="procs_running"):
        parse_stat("cpu  1 2 3 4 5 6 7 8\n")


def test_steal_fraction_is_over_the_interval_not_since_boot() -> None:
    before, after = _sample(total=10_000, steal=5_000), _sample(total=11_000, steal=5_100)
    assert steal_fraction(before, after) == pytest.approx(0.1)


def test_a_quiet_host_has_no_reasons() -> None:
    assert noisy_reasons(cores=2, load_1m_before=1.0, load_1m_after=2.0, runnable_mean=1.0,
                         steal=0.01) == []  # fmt: skip


def test_other_tasks_filling_every_core_make_a_run_noisy() -> None:
    # one spinner per core leaves the benchmark no core of its own (read 2, or 1.5 on a miss)
    for runnable in (2.0, 1.5):
        reasons = noisy_reasons(cores=2, load_1m_before=0.0, load_1m_after=0.0,
                                runnable_mean=runnable, steal=0.0)  # fmt: skip
        assert len(reasons) == 1 and "runnable" in reasons[0]


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [("load_1m_before", 2.5, "before"), ("load_1m_after", 2.5, "after"),
     ("runnable_mean", 2.5, "runnable"), ("steal", 0.2, "steal")],
)  # fmt: skip
def test_each_kind_of_load_makes_a_run_noisy(field: str, value: float, reason: str) -> None:
    kwargs = {"load_1m_before": 0.0, "load_1m_after": 0.0, "runnable_mean": 0.0, "steal": 0.0}
    kwargs[field] = value
    reasons = noisy_reasons(cores=2, **kwargs)
    assert len(reasons) == 1 and reason in reasons[0]


def test_summarize_does_not_count_the_reader_among_runnable_tasks() -> None:
    quiet = summarize(cores=2, before=_sample(), after=_sample(total=2000),
                      during=[_sample(running=2), _sample(running=2)])  # fmt: skip
    assert quiet["runnable_during_mean"] == 1 and quiet["noisy"] is False
    busy = summarize(cores=2, before=_sample(), after=_sample(total=2000),
                     during=[_sample(running=3), _sample(running=5)])  # fmt: skip
    assert busy["runnable_during_mean"] == 3 and busy["noisy"] is True


def test_summarize_does_not_count_the_benchmarks_own_tree_as_noise() -> None:
    # three stages of a ring bench runnable on two cores, and nothing else: quiet
    own = summarize(cores=2, before=_sample(), after=_sample(load_1m=3.5, total=2000),
                    during=[_sample(running=4, own=4), _sample(running=4, own=4)])  # fmt: skip
    assert own["runnable_during_mean"] == 0 and own["own_runnable_during_mean"] == 3
    assert own["noisy"] is False, own["noisy_reasons"]
    # the same with two foreign spinners: noisy
    foreign = summarize(cores=2, before=_sample(), after=_sample(load_1m=5.5, total=2000),
                        during=[_sample(running=7, own=4)])  # fmt: skip
    assert foreign["runnable_during_mean"] == 3 and foreign["noisy"] is True


def test_summarize_without_samples_during_uses_the_end_reading() -> None:
    report = summarize(cores=2, before=_sample(), after=_sample(running=4, total=2000), during=[])
    assert report["samples_during"] == 1 and report["runnable_during_mean"] == 3


def test_parse_proc_stat_reads_past_a_command_name_with_parentheses() -> None:
    assert parse_proc_stat("42 (a (b) c) R 7 42 42 0 -1") == (42, 7, "R")
    with pytest.raises(ValueError):
        parse_proc_stat("garbage")


def test_descendants_walks_the_whole_tree_and_nothing_else() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 12, 20: 1, 21: 20}
    assert descendants(10, parents) == {10, 11, 12, 13}


def test_running_tasks_counts_the_tree_and_the_rest_apart() -> None:
    import os
    import subprocess
    import sys
    import time

    assert running_tasks(os.getpid())[0] >= 1  # this reader
    spin = "import time\nend = time.monotonic() + 20\nwhile time.monotonic() < end: pass\n"
    spinner = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)
        # rooted at the spinner: it is the tree's one runnable thread; this reader is another's
        own, others = running_tasks(spinner.pid)
        assert own == 1 and others >= 1
    finally:
        spinner.kill()
        spinner.wait(10)


def test_physics_holds_within_the_tolerance() -> None:
    assert physics_violation("ring", 0.95, floor=1.0, tolerance=0.10) is None


def test_physics_violation_below_the_floor_less_tolerance() -> None:
    v = physics_violation("ring", 0.29, floor=1.0, tolerance=0.10)
    assert v == {"name": "ring", "value": 0.29, "floor": 1.0, "tolerance": 0.10, "limit": 0.9}


def test_physics_tolerance_out_of_range_names_the_check() -> None:
    with pytest.raises(ValueError, match="'ring'.*tolerance"):
        physics_violation("ring", 1.0, floor=1.0, tolerance=1.5)


def test_a_physics_violation_fails_the_run_and_distrusts_its_targets() -> None:
    report = _quiet_report()
    report.add_target("ring_over_one_process_tpot", 0.29, 1.05, "<=")
    assert report.check_physics("ring_over_one_process_tpot", 0.29, floor=1.0,
                                tolerance=0.10) is False  # fmt: skip
    out = report.to_dict()
    assert out["targets"]["ring_over_one_process_tpot"]["met"] is True  # computed, not trusted
    assert out["targets"]["ring_over_one_process_tpot"]["trusted"] is False
    assert out["targets_trusted"] is False
    assert [v["name"] for v in out["physics_violations"]] == ["ring_over_one_process_tpot"]
    assert report.exit_code(require_quiet=False) == BenchExit.PHYSICS


def test_a_quiet_run_with_matching_arms_is_trusted() -> None:
    report = _quiet_report()
    policy = thread_policy(torch_threads=1, env={"OMP_NUM_THREADS": "1"})
    report.add_arm("baseline", policy)
    report.add_arm("candidate", policy)
    report.add_target("x", 1.0, 1.5, "<=")
    out = report.to_dict()
    assert out["machine"]["noisy"] is False and out["thread_policies_match"] is True
    assert out["targets"]["x"]["trusted"] is True and out["targets_trusted"] is True
    assert report.exit_code(require_quiet=True) == BenchExit.OK


def test_arms_under_different_omp_policies_are_not_trusted() -> None:
    report = _quiet_report()
    report.add_arm("one_process", thread_policy(torch_threads=2, env={}))
    report.add_arm("ring", thread_policy(torch_threads=2, env={"OMP_WAIT_POLICY": "PASSIVE"}))
    report.add_target("x", 1.0, 1.5, "<=")
    out = report.to_dict()
    assert out["arms"]["ring"] == {"OMP_NUM_THREADS": None, "OMP_WAIT_POLICY": "PASSIVE",
                                   "GOMP_SPINCOUNT": None, "torch_threads": 2}  # fmt: skip
    assert out["thread_policies_match"] is False and out["targets_trusted"] is False
    assert report.exit_code(require_quiet=True) == BenchExit.NOISY
    assert report.exit_code(require_quiet=False) == BenchExit.OK
