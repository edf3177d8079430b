"""`finetune.compute_dtype`: which dtype the U-shape nodes autocast to, and where it is refused."""

from __future__ import annotations

import pytest
import torch

from splitlab.config.enums import DType
from splitlab.configure import compose_config
from splitlab.errors import ConfigError
from splitlab.train import node_setup
from splitlab.train.node_setup import autocast_dtype
from splitlab.train.nodes import widened

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("amx", [True, False])
def test_auto_is_bf16_only_on_a_cpu_with_amx(monkeypatch: pytest.MonkeyPatch, amx: bool) -> None:
    monkeypatch.setattr(node_setup, "_has_amx", lambda: amx)
    assert autocast_dtype(DType.auto, CPU) == (torch.bfloat16 if amx else None)
    assert autocast_dtype(DType.auto, CUDA) is None
    assert autocast_dtype(DType.bf16, CPU) == autocast_dtype(DType.bf16, CUDA) == torch.bfloat16
    assert autocast_dtype(DType.fp32, CPU) is None


def test_widened_casts_only_what_autocast_left_narrow() -> None:
    crossing = {"hidden_BTH": torch.ones(2, dtype=torch.bfloat16), "ids": torch.ones(2).long()}
    out = widened(crossing, torch.bfloat16)
    assert out["hidden_BTH"].dtype == torch.float32 and out["ids"].dtype == torch.long
    assert widened(crossing, None)["hidden_BTH"].dtype == torch.bfloat16


def test_bf16_outside_u_shape_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="finetune.compute_dtype=bf16 .* two_stage"):
        compose_config(["architecture=two_stage", "finetune.compute_dtype=bf16"])
    compose_config(["architecture=two_stage", "finetune.compute_dtype=auto"])  # fp32 there
