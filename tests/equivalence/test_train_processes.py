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
import torch
from model_helpers import adapter_of, tiny_config, tiny_model, twin
from safetensors.torch import load_file
from test_train_engine import WINDOW, adamw, assert_same_parameters, batches, train_unsplit

from splitlab.config.schema import LoraConfig
from splitlab.control.embedded import EmbeddedBusServer
from splitlab.errors import ExitCode
from splitlab.launch.supervisor import ChildSpec, run_group
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.train.checkpoint import completed_rounds, load_checkpoint
from splitlab.train.engine import UShapeEngine
from splitlab.train.lora import apply_lora, merged_state
from splitlab.train.node_setup import DATA_KEY_ENV, save_batches
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters
from splitlab.train.validate import evaluate, part_chain
from splitlab.train.window import round_schedule
from splitlab.train.wrr import SmoothWRR

PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)


def specs(
    tmp_path: Path,
    family: str,
    data: dict[str, list],
    workers: list[str],
    worker_extra: dict[str, object] | None = None,
    coordinator: dict[str, object] | None = None,
    validation: dict[str, list] | None = None,
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
    if coordinator is not None:
        common["coordinator"] = "coord"
    children = []
    roles = [("worker", workers), ("owner", list(data))]
    if coordinator is not None:
        roles.insert(0, ("coordinator", ["coord"]))
    for role, names in roles:
        for name in names:
            spec = {
                **common,
                "role": role,
                "name": name,
                "out_path": str(tmp_path / f"{name}.safetensors"),
            }
            if role == "worker":
                spec.update(worker_extra or {})
            if role == "coordinator":
                spec.update(coordinator or {})
            if role == "owner" and validation and validation.get(name):
                save_batches(tmp_path / f"{name}.val.safetensors", validation[name])
                spec["val_path"] = str(tmp_path / f"{name}.val.safetensors")
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

    # 3 s bounds the waits inside the windows; process start (model loads, REGISTER both
    # ways) has its own allowance, so a loaded machine cannot time the start-up out instead
    ended = run_each(
        specs(
            tmp_path,
            "gpt2",
            data,
            ["w0"],
            {"num_windows": 1},
            timeout_s=3.0,
            startup_timeout_s=120.0,
        )  # fmt: skip
    )

    owner_code, owner_log = ended["o0"]
    assert ended["w0"][0] == 0
    assert owner_code in (ExitCode.TIMEOUT, ExitCode.PEER_LOST), owner_log
    assert "'w0'" in owner_log.split("ERROR", 1)[-1]


def traces(folder: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in folder.glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]


@pytest.mark.slow
def test_three_owners_two_workers_rounds_traces_and_fedavg_weights(tmp_path: Path) -> None:
    data = {"o0": batches("gpt2", n=5), "o1": batches("gpt2", n=2, seed=40), "o2": []}
    weights = {"w0": 3.0, "w1": 1.0}
    (tmp_path / "traces").mkdir()
    children = specs(
        tmp_path, "gpt2", data, list(weights), coordinator={"rounds": 2},
        weights=weights, trace_dir=str(tmp_path / "traces"),
    )  # fmt: skip

    result = run_group(children, timeout_s=240, sink=None)

    assert result.exit_code == 0, result.diagnosis()
    records = traces(tmp_path / "traces")
    fedavg = json.loads((tmp_path / "coord.safetensors").read_text())["fedavg_weights"]
    samples = {o: sum(int(b["input_ids"].shape[0]) for b in items) for o, items in data.items()}
    for round_id, window_ids in ((0, (0, 1)), (1, (2, 3))):
        in_round = [r for r in records if r.get("window") in window_ids]
        for owner, items in data.items():  # each owner follows the 3:1 WRR sequence
            sent = [r["worker"] for r in in_round if r["kind"] == "forward" and r["owner"] == owner]
            expected = SmoothWRR(weights).assign(len(items))
            assert sorted(sent) == sorted(expected)
        for window in window_ids:  # every COMMIT after every DRAINED, every step after a COMMIT
            drained = [
                r["ts_us"] for r in in_round if r["kind"] == "drained" and r["window"] == window
            ]
            commits = [
                r["ts_us"] for r in in_round if r["kind"] == "commit" and r["window"] == window
            ]
            steps = [r["ts_us"] for r in in_round if r["kind"] == "step" and r["window"] == window]
            assert len(drained) == 3 and len(commits) == 2
            assert min(commits) >= max(drained)
            assert all(t >= max(commits) for t in steps)
        forwards = [r for r in in_round if r["kind"] == "forward"]
        per_worker = {w: sum(_size(data, r) for r in forwards if r["worker"] == w) for w in weights}
        assert fedavg[round_id] == {**samples, **per_worker}
    assert fedavg[0]["o2"] == 0


def _size(data: dict[str, list], record: dict, windows_per_round: int = 2) -> int:
    """Sequences in the microbatch a forward record names (ids count within their window)."""
    offset = record["window"] % windows_per_round
    return int(data[record["owner"]][offset * WINDOW + record["microbatch"]]["input_ids"].shape[0])


@pytest.mark.slow
def test_resume_continues_from_the_last_completed_round(tmp_path: Path) -> None:
    data = {"o0": batches("llama", n=4), "o1": batches("llama", n=2, seed=60)}
    straight, interrupted = tmp_path / "a", tmp_path / "b"
    for folder in (straight, interrupted):
        folder.mkdir()

    def launch(folder: Path, rounds: int, resume: bool) -> None:
        coordinator = {"rounds": rounds, "resume": resume, "checkpoint_dir": str(folder / "ckpt")}
        children = specs(folder, "llama", data, ["w0"], coordinator=coordinator)
        result = run_group(children, timeout_s=240, sink=None)
        assert result.exit_code == 0, result.diagnosis()

    launch(straight, 2, False)
    launch(interrupted, 1, False)
    launch(interrupted, 2, True)

    assert completed_rounds(interrupted / "ckpt") == [0, 1]
    final_a = load_checkpoint(straight / "ckpt" / "round-000001.safetensors").state
    final_b = load_checkpoint(interrupted / "ckpt" / "round-000001.safetensors").state
    for key, tensor in final_a.items():
        torch.testing.assert_close(final_b[key], tensor, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
def test_divergence_with_a_coordinator_ends_every_process_naming_the_cause(tmp_path: Path) -> None:
    data = {"o0": batches("llama", n=6)}

    ended = run_each(specs(tmp_path, "llama", data, ["w0"], coordinator={"rounds": 2}, lr=1e30))

    assert ended["o0"][0] == ExitCode.NON_FINITE, ended["o0"][1]
    for name in ("w0", "coord"):
        code, output = ended[name]
        assert code == ExitCode.ABORTED, output
        assert "aborted by 'o0'" in output and "NonFiniteError" in output


@pytest.mark.slow
def test_owner_validates_through_its_worker_before_fedavg(tmp_path: Path) -> None:
    data, held_out = {"o0": batches("gpt2", n=4)}, batches("gpt2", n=2, seed=90)
    (tmp_path / "traces").mkdir()
    children = specs(
        tmp_path, "gpt2", data, ["w0"], coordinator={"rounds": 1},
        validation={"o0": held_out}, trace_dir=str(tmp_path / "traces"),
    )  # fmt: skip

    result = run_group(children, timeout_s=240, sink=None)

    assert result.exit_code == 0, result.diagnosis()
    owner_records = [r for r in traces(tmp_path / "traces") if r["role"] == "owner"]
    kinds = [r["kind"] for r in owner_records]
    assert kinds.index("validation") < kinds.index("update")
    traced = owner_records[kinds.index("validation")]
    # 1 owner x 1 worker: FedAvg is the identity, so the saved states are the validated ones
    model = tiny_model("gpt2")
    state = {
        **load_file(str(tmp_path / "o0.safetensors")),
        **load_file(str(tmp_path / "w0.safetensors")),
    }
    model.load_state_dict(state, strict=False)
    expected = evaluate(part_chain(build_parts(model, PLAN)), adapter_of("gpt2"), held_out)
    assert traced["val_samples"] == expected.num_samples
    assert traced["val_loss"] == pytest.approx(expected.loss, rel=1e-5)
    assert traced["val_perplexity"] == pytest.approx(expected.perplexity, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("merge", [False, True], ids=["adapters", "merged"])
def test_lora_round_between_processes_matches_in_process(tmp_path: Path, merge: bool) -> None:
    data = {"o0": batches("gpt2", n=4)}
    lora = {"r": 4, "alpha": 8.0}
    coordinator = {"rounds": 1, "checkpoint_dir": str(tmp_path / "ckpt")}
    children = specs(
        tmp_path, "gpt2", data, ["w0"], coordinator=coordinator, lora=lora, merge_for_fedavg=merge
    )

    result = run_group(children, timeout_s=240, sink=None)

    assert result.exit_code == 0, result.diagnosis()
    model = tiny_model("gpt2")  # the same draws as every process: model, then adapters
    front, body, tail = build_parts(model, PLAN)
    apply_lora([front, body, tail], LoraConfig(**lora))
    owner = OwnerNode("o0", front, tail, adamw(partition_parameters(front, tail)))
    worker = WorkerNode("w0", body, adamw(partition_parameters(body)))
    engine = UShapeEngine(owners=[owner], workers=[worker], max_inflight=2, credit=2)
    engine.run_round(data, quota=WINDOW)
    expected = {**merged_state(front), **merged_state(tail), **merged_state(body)}
    saved = load_checkpoint(tmp_path / "ckpt" / "round-000000.safetensors").state
    assert set(saved) == set(tiny_model("gpt2").state_dict())
    for key, tensor in expected.items():
        torch.testing.assert_close(saved[key], tensor, msg=lambda m, k=key: f"{k}: {m}")
