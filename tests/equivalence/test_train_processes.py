"""U-shape training between real processes over loopback TCP and the embedded control bus.

.venv/bin/pytest tests/equivalence/test_train_processes.py -q
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from model_helpers import tiny_config, tiny_model, twin
from safetensors.torch import load_file
from test_train_engine import WINDOW, assert_same_parameters, batches, train_unsplit

from splitlab.control.embedded import EmbeddedBusServer
from splitlab.errors import ExitCode
from splitlab.launch.supervisor import ChildSpec, run_group
from splitlab.train.process import DATA_KEY_ENV, save_batches
from splitlab.train.window import round_schedule


def specs(
    tmp_path: Path,
    family: str,
    data: dict[str, list],
    workers: list[str],
    worker_extra: dict[str, object] | None = None,
    **extra: object,
) -> list[ChildSpec]:
    server = EmbeddedBusServer()
    env = {**server.start().to_env(), DATA_KEY_ENV: secrets.token_hex(32)}
    specs.servers.append(server)  # type: ignore[attr-defined]
    session = f"t{uuid.uuid4().hex[:10]}"
    schedule = round_schedule({o: len(b) for o, b in data.items()}, WINDOW)
    model = {k: getattr(v, "value", v) for k, v in dataclasses.asdict(tiny_config(family)).items()}
    common = {
        "session": session,
        "owners": list(data),
        "workers": workers,
        "model": model,
        "num_windows": len(schedule),
        "quota": WINDOW,
        "eps": 1e-6,  # as in the in-process equivalence (see test_train_engine.adamw)
        "timeout_s": 30.0,
        **extra,
    }
    children = []
    for role, names in (("worker", workers), ("owner", list(data))):
        for name in names:
            spec = {
                **common,
                "role": role,
                "name": name,
                "out_path": str(tmp_path / f"{name}.safetensors"),
            }
            if role == "worker":
                spec.update(worker_extra or {})
            if role == "owner":
                save_batches(tmp_path / f"{name}.data.safetensors", data[name])
                spec["data_path"] = str(tmp_path / f"{name}.data.safetensors")
            (tmp_path / f"{name}.json").write_text(json.dumps(spec))
            argv = [sys.executable, "-m", "splitlab.train.process", str(tmp_path / f"{name}.json")]
            children.append(ChildSpec(name=name, argv=argv, env=env))
    return children


specs.servers = []  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _close_servers():
    yield
    while specs.servers:  # type: ignore[attr-defined]
        specs.servers.pop().close()  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_one_owner_one_worker_processes_match_unsplit(tmp_path: Path, family: str) -> None:
    ref = tiny_model(family)
    data = batches(family)
    train_unsplit(ref, family, data)

    result = run_group(specs(tmp_path, family, {"o0": data}, ["w0"]), timeout_s=180, sink=None)

    assert result.exit_code == 0, result.diagnosis()
    split = twin(tiny_model(family))
    state = {
        **load_file(str(tmp_path / "o0.safetensors")),
        **load_file(str(tmp_path / "w0.safetensors")),
    }
    split.load_state_dict(state, strict=False)
    assert_same_parameters(ref, split)


def run_each(children: list[ChildSpec], timeout_s: float = 120.0) -> dict[str, tuple[int, str]]:
    """Every child to its own end (no teardown at the first failure): name -> (code, output)."""
    procs = {
        c.name: subprocess.Popen(
            list(c.argv),
            env={**os.environ, **c.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for c in children
    }
    try:
        return {name: (p.wait(timeout_s), p.stdout.read()) for name, p in procs.items()}  # type: ignore[union-attr]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_divergence_aborts_every_process_naming_the_cause(tmp_path: Path) -> None:
    data = {"o0": batches("llama", n=6)}  # lr 1e30: after one step activations overflow

    ended = run_each(specs(tmp_path, "llama", data, ["w0"], lr=1e30))

    (owner_code, owner_log), (worker_code, worker_log) = ended["o0"], ended["w0"]
    assert owner_code == ExitCode.NON_FINITE, owner_log
    assert "NonFiniteError" in owner_log and "owner 'o0'" in owner_log
    assert worker_code == ExitCode.ABORTED, worker_log
    assert "aborted by 'o0'" in worker_log and "NonFiniteError" in worker_log


@pytest.mark.slow
def test_a_vanished_worker_times_the_owner_out_naming_it(tmp_path: Path) -> None:
    data = {"o0": batches("gpt2", n=7)}  # three windows; the worker leaves after the first

    ended = run_each(specs(tmp_path, "gpt2", data, ["w0"], {"num_windows": 1}, timeout_s=3.0))

    owner_code, owner_log = ended["o0"]
    assert ended["w0"][0] == 0
    assert owner_code in (ExitCode.TIMEOUT, ExitCode.PEER_LOST), owner_log
    assert "'w0'" in owner_log.split("ERROR", 1)[-1]
