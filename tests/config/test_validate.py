"""Invalid combinations are refused before any process starts, naming keys and values.

pytest tests/config/test_validate.py -q
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splitlab.configure import compose_config
from splitlab.errors import ConfigError, ExitCode

REFUSED = [
    # (overrides, fragments the message must contain)
    (
        ["architecture.cut_layers=4", "architecture.tail_blocks=2"],
        ["no remote body block", "cut_layers=4", "tail_blocks=2"],
    ),
    (["architecture.cut_layers=6"], ["no remote body block", "num_layers=6"]),
    (["architecture.cut_layers=0"], ["architecture.cut_layers=0"]),
    (
        ["architecture.owners=4", "architecture.worker_max_inflight=3"],
        ["worker_max_inflight=3", "owners=4"],
    ),
    (
        ["architecture.workers=2", "architecture.compute_weights=[3.0]"],
        ["compute_weights", "workers=2"],
    ),
    (["architecture.compute_weights=[0.0]"], ["compute_weights[0]=0.0"]),
    (["finetune=sft", "finetune.sft.rank=384"], ["finetune.sft.rank=384", "hidden_size=384"]),
    (["finetune=sft", "finetune.sft.rank=0"], ["finetune.sft.rank=0"]),
    (
        ["architecture=two_stage", "finetune=sft", "finetune.sft.cuts=both"],
        ["finetune.sft.cuts=both"],
    ),
    (
        ["architecture=two_stage", "architecture.cut_layers=6"],
        ["architecture.cut_layers=6", "[1, 5]"],
    ),
    (["architecture=two_stage", "architecture.control_count=0"], ["architecture.control_count=0"]),
    (["task=infer", "architecture.cuts=[0,10]"], ["architecture.cuts[0]=0", "[1, 29]"]),
    (["task=infer", "architecture.cuts=[10,30]"], ["architecture.cuts[1]=30"]),
    (["task=infer", "architecture.window=-1"], ["architecture.window=-1"]),
    (["task=infer", "architecture.data_timeout_s=0"], ["architecture.data_timeout_s=0"]),
    (["task=infer", "architecture.cuts=[20,10]"], ["cuts=[20, 10]", "strictly increasing"]),
    (["task=infer", "architecture.stages=31"], ["architecture.stages=31"]),
    (["task=infer", "architecture.peer_hosts=[127.0.0.1]"], ["peer_hosts", "3 stages"]),
    (["task=infer", "model=minilm"], ["model=minilm", "BERT"]),
    (["data=gsm_symbolic"], ["model=minilm", "data.task=causal_lm"]),
    (["data=emotion"], ["num_labels=2", "6 classes"]),
    (["finetune.lr=0"], ["finetune.lr=0"]),
    (["task=infer", "architecture.stage_devices=[cpu,cuda]"], ["stage_devices", "3 stages"]),
    (["task=infer", "architecture.stage_devices=[cpu,gpu,cpu]"], ["stage_devices[1]='gpu'"]),
    (["architecture.worker_device=tpu"], ["architecture.worker_device='tpu'"]),
    (["finetune.batch_size=0"], ["finetune.batch_size=0"]),
    (["data.alpha=0"], ["data.alpha=0"]),
    (
        ["architecture.owners=3", "data.samples_per_owner=[20,8]"],
        ["data.samples_per_owner has 2 entries [20, 8]", "architecture.owners=3"],
    ),
    (["data.samples_per_owner=[20,-1]"], ["data.samples_per_owner[1]=-1"]),
    (["data.samples_per_owner=abc"], ["data.samples_per_owner='abc'", "list of one per owner"]),
    (["data.samples_per_owner=[0,0]"], ["sum(data.samples_per_owner)=0"]),
    (
        ["data.samples_per_owner=[20,8]", "data.quantity_skew_alpha=0.5"],
        ["data.quantity_skew_alpha=0.5", "[20, 8]"],
    ),
    (["data.quantity_skew_alpha=0"], ["data.quantity_skew_alpha=0"]),
    (["device=tpu"], ["device='tpu'"]),
    (
        ["task=infer", "architecture.bypass=true", "architecture.window=0"],
        ["architecture.bypass=true", "architecture.window > 0"],
    ),
]

# Edges that used to pass validation and fail later, or never (unbounded waits): each is refused
# at compose time naming the key and the value.
EDGES = [
    ("architecture.timeout_s=inf", "architecture.timeout_s=inf"),
    ("architecture.startup_timeout_s=nan", "architecture.startup_timeout_s=nan"),
    ("control.timeout_s=inf", "control.timeout_s"),  # not a key: Hydra refuses it
    ("+control.timeout_s=inf", "control.timeout_s"),  # added past the schema: refused too
    ("task.rounds=0", "task.rounds=0"),
    ("task.rounds=-3", "task.rounds=-3"),
    ("task.steps_per_round=-5", "task.steps_per_round=-5"),
    ("transport.port=70000", "transport.port=70000"),
    ("transport.port=-1", "transport.port=-1"),
    ("data.alpha=inf", "data.alpha=inf"),
    ("transport.pool_bytes=1", "transport.pool_bytes=1"),
    ("transport.max_frame_bytes=-1", "transport.max_frame_bytes=-1"),
    ("transport.send_queue_frames=0", "transport.send_queue_frames=0"),
    ("transport.spin_us=-1", "transport.spin_us=-1"),
    ("transport.spin_us=1e9", "transport.spin_us=1000000000.0"),
]


@pytest.mark.parametrize(("overrides", "fragments"), REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_invalid_combination_is_refused_naming_values(
    overrides: list[str], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


@pytest.mark.parametrize(("override", "named"), EDGES, ids=[o for o, _ in EDGES])
def test_edge_value_is_refused_naming_key_and_value(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:  # Hydra's own refusals come as ConfigError too
        compose_config([override])
    assert named in str(info.value), str(info.value)


def test_ring_ports_past_the_last_are_refused() -> None:
    with pytest.raises(ConfigError, match="base_port=65534: the last of 3 stages .* 65536"):
        compose_config(["task=infer", "architecture.base_port=65534"])


def test_extremes_are_accepted() -> None:
    compose_config(["architecture.cut_layers=1", "architecture.tail_blocks=0"])
    compose_config(["architecture.cut_layers=4", "architecture.tail_blocks=1"])  # one body block
    compose_config(["task=infer", "architecture.cuts=[1,29]"])
    compose_config(["finetune=sft", "finetune.sft.rank=383"])
    compose_config(["transport.port=65535", "transport.pool_bytes=1048576", "task.rounds=1"])
    compose_config(["task=infer", "architecture.base_port=65533"])  # stages on ..65535


def test_cli_exits_with_the_config_code_before_starting_anything() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "splitlab", "architecture.cut_layers=6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == ExitCode.CONFIG
    assert "no remote body block" in result.stderr


# (task, group option) pairs no task runner honours: refused, naming the key and the task.
UNRUN = [
    (["transport=inproc"], "transport=inproc", "task=finetune"),
    (["task=infer", "transport=rabbitmq"], "transport=rabbitmq", "task=infer"),
    (["task=infer", "transport=inproc"], "transport=inproc", "task=infer"),
    (["task=infer", "control=rabbitmq"], "control=rabbitmq", "task=infer"),
    (["task=infer", "transport=rabbitmq", "control=rabbitmq"], "transport=rabbitmq", "task=infer"),
    (["task=calibrate", "transport=rabbitmq"], "transport=rabbitmq", "task=calibrate"),
    (["task=calibrate", "transport=inproc"], "transport=inproc", "task=calibrate"),
    (["task=calibrate", "control=rabbitmq"], "control=rabbitmq", "task=calibrate"),
]


@pytest.mark.parametrize(("overrides", "key", "task"), UNRUN, ids=[" ".join(o) for o, *_ in UNRUN])
def test_cli_refuses_an_option_the_task_does_not_run(
    overrides: list[str], key: str, task: str, tmp_path: Path
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "splitlab", *overrides, f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == ExitCode.CONFIG, result.stderr[-2000:]
    assert key in result.stderr and task in result.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "nodes").exists()


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["transport.name=pigeon"], "transport.name='pigeon'"),
        (["control.name=pigeon"], "control.name='pigeon'"),
        (["task=infer", "planner.name=greedy"], "planner.name='greedy'"),
        (["task=infer", "drift.name=sunspots"], "drift.name='sunspots'"),
        (["model.family=t5"], "model.family='t5'"),
    ],
)
def test_unregistered_name_is_refused_listing_the_registered(
    overrides: list[str], key: str
) -> None:
    with pytest.raises(ConfigError, match="registered|choose from") as info:
        compose_config(overrides)
    assert key in str(info.value)


def test_planner_parameters_are_only_the_chosen_planners() -> None:
    cfg = compose_config(["task=infer", "planner=forced_shift", "planner.at_token=7"])
    assert cfg.planner.at_token == 7
    with pytest.raises(ConfigError, match="planner.hysteresis"):
        compose_config(["task=infer", "planner=forced_shift", "planner.hysteresis=0.2"])


def test_planner_model_calibration_is_checked_at_compose_time(tmp_path) -> None:
    cfg = compose_config(["task=infer", "planner=model", "planner.horizon_tokens=32"])
    assert cfg.planner.horizon_tokens == 32
    with pytest.raises(ConfigError, match="planner.calibration"):
        compose_config(["task=infer", "planner=model", f"planner.calibration={tmp_path}/none.json"])


@pytest.mark.parametrize(
    ("override", "named"),
    [("ring3_edge", "Error parsing override 'ring3_edge'"),  # no `=`: Hydra cannot parse it
     ("model=nosuch", "Could not find 'model/nosuch'"),
     ("nosuchkey=1", "Key 'nosuchkey' not in 'Config'")],
)  # fmt: skip
def test_an_override_hydra_refuses_is_a_config_error_naming_it(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["task=infer", override])
    assert named in str(info.value) and override in str(info.value)
