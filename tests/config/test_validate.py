"""Invalid combinations are refused before any process starts, naming keys and values.

pytest tests/config/test_validate.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from splitlab.cli import compose_config
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
    (["task=infer", "architecture.cuts=[20,10]"], ["cuts=[20, 10]", "strictly increasing"]),
    (["task=infer", "architecture.stages=31"], ["architecture.stages=31"]),
    (["task=infer", "architecture.peer_hosts=[127.0.0.1]"], ["peer_hosts", "3 stages"]),
    (["task=infer", "model=minilm"], ["model=minilm", "BERT"]),
    (["data=gsm_symbolic"], ["model=minilm", "data.task=causal_lm"]),
    (["data=emotion"], ["num_labels=2", "6 classes"]),
    (["finetune.lr=0"], ["finetune.lr=0"]),
    (["finetune.batch_size=0"], ["finetune.batch_size=0"]),
    (["data.alpha=0"], ["data.alpha=0"]),
    (["device=tpu"], ["device='tpu'"]),
]


@pytest.mark.parametrize(("overrides", "fragments"), REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_invalid_combination_is_refused_naming_values(
    overrides: list[str], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} missing from: {info.value}"


def test_extremes_are_accepted() -> None:
    compose_config(["architecture.cut_layers=1", "architecture.tail_blocks=0"])
    compose_config(["architecture.cut_layers=4", "architecture.tail_blocks=1"])  # one body block
    compose_config(["task=infer", "architecture.cuts=[1,29]"])
    compose_config(["finetune=sft", "finetune.sft.rank=383"])


def test_cli_exits_with_the_config_code_before_starting_anything() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "splitlab", "architecture.cut_layers=6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == ExitCode.CONFIG
    assert "no remote body block" in result.stderr
