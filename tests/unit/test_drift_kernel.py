"""Drift on a testbed (pure parts): the kernel schedule a profile asks for, how a run applies
its drift, and how the applier follows the head's trace.

.venv/bin/pytest tests/unit/test_drift_kernel.py -q
"""

from __future__ import annotations

import json

import pytest

from splitlab.config.schema import DriftConfig
from splitlab.drift.kernel import (
    CPU,
    LINK_UP,
    HeadProgress,
    KernelChange,
    drift_applied,
    kernel_schedule,
)
from splitlab.drift.profiles import ProfileParams, generate
from splitlab.errors import ConfigError

HOSTS = ["dev0", "dev1", "dev2"]
CPU_OF = dict.fromkeys(HOSTS, 0.5)
UP_OF = dict.fromkeys(HOSTS, 100.0)


def params(**kw) -> ProfileParams:
    return ProfileParams(**{"num_stages": 3, "length_tokens": 40, "slow_stage": 1, "phi": 4.0,
                            "period_tokens": 10, **kw})  # fmt: skip


def test_cpu_throttle_is_one_quota_cut_at_its_token_on_the_slow_host() -> None:
    schedule = kernel_schedule(generate("cpu_throttle", params()), hosts=HOSTS, cpu=CPU_OF,
                               up_mbit=UP_OF)  # fmt: skip
    assert schedule == [KernelChange(token=10, stage=1, host="dev1", kind=CPU, value=0.125)]


def test_link_degrade_is_a_few_falling_rate_steps_on_the_slow_host() -> None:
    schedule = kernel_schedule(generate("link_degrade", params(phi=2.0)), hosts=HOSTS, cpu=CPU_OF,
                               up_mbit=UP_OF, min_step=0.1)  # fmt: skip
    assert {(c.host, c.kind) for c in schedule} == {("dev1", LINK_UP)}
    rates = [c.value for c in schedule]
    assert rates == sorted(rates, reverse=True) and 3 <= len(rates) <= 8
    assert rates[-1] == pytest.approx(50.0, rel=0.1)  # 100 Mbit/s / phi at the last token
    tokens = [c.token for c in schedule]
    assert tokens == sorted(tokens) and tokens[0] > 0


def test_steady_changes_nothing_even_without_budgets() -> None:
    records = generate("steady", params())
    assert kernel_schedule(records, hosts=HOSTS, cpu=dict.fromkeys(HOSTS, 0.0),
                           up_mbit=dict.fromkeys(HOSTS, 0.0)) == []  # fmt: skip


def test_a_drifting_host_without_a_cpu_budget_is_named() -> None:
    with pytest.raises(ConfigError, match=r"testbed\.hosts\.dev1\.cpu"):
        kernel_schedule(generate("cpu_throttle", params()), hosts=HOSTS,
                        cpu={**CPU_OF, "dev1": 0.0}, up_mbit=UP_OF)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "source", "testbed", "expected"),
    [("cpu_throttle", "replay", True, "kernel"), ("link_degrade", "replay", False, "simulated"),
     ("live", "live", True, None), ("none", "none", True, None)],
)  # fmt: skip
def test_drift_applied(name: str, source: str, testbed: bool, expected: str | None) -> None:
    assert drift_applied(DriftConfig(name=name, source=source), on_testbed=testbed) == expected


def test_head_progress_reads_complete_token_lines_as_the_trace_grows(tmp_path) -> None:
    trace = tmp_path / "stage-0.jsonl"
    progress = HeadProgress(trace)
    assert progress.poll() == -1  # no trace yet

    def line(kind: str, t: int) -> str:
        return json.dumps({"kind": kind, "token": t}, separators=(",", ":"))

    trace.write_text(line("token", 0) + "\n" + line("window", 9) + "\n" + line("token", 1)[:8])
    assert progress.poll() == 0  # the window record and the half-written line do not count
    with trace.open("a") as f:
        f.write(line("token", 1)[8:] + "\n" + line("token", 2) + "\n")
    assert progress.poll() == 2
