"""U-shape training between real processes over loopback TCP and the embedded control bus.

.venv/bin/pytest tests/equivalence/test_train_processes.py -q
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import IO

import pytest
import torch
from model_helpers import adapter_of, tiny_config, tiny_model, twin
from safetensors.torch import load_file
from test_train_engine import WINDOW, adamw, assert_same_parameters, batches, train_unsplit

from splitlab.config.load import save_resolved_config
from splitlab.config.schema import LoraConfig
from splitlab.configure import compose_config
from splitlab.control.embedded import EmbeddedBusServer
from splitlab.errors import ExitCode
from splitlab.launch.supervisor import LAUNCHER_PID_ENV, ChildSpec, run_group
from splitlab.launch.zygote import Zygotes
from splitlab.models.parts import build_parts
from splitlab.models.plan import u_shape_plan
from splitlab.reference.ushape import UShapeEngine
from splitlab.train.checkpoint import completed_rounds, load_checkpoint
from splitlab.train.lora import apply_lora, merged_state
from splitlab.train.node_setup import save_batches
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters
from splitlab.train.validate import evaluate, part_chain
from splitlab.train.window import round_schedule
from splitlab.train.wrr import SmoothWRR
from splitlab.wire.session_key import SESSION_KEY_ENV

PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)


def specs(
    tmp_path: Path,
    family: str,
    data: dict[str, list],
    workers: list[str],
    worker_args: list[str] | None = None,
    coordinator: list[str] | None = None,
    validation: dict[str, list] | None = None,
    overrides: list[str] = (),  # type: ignore[assignment]
    lora: bool = False,
) -> list[ChildSpec]:
    """Every process of one run, each started with the node command from one saved config.

    Owners train on fixed microbatches (`data`, named owner0, owner1, ...) and write their
    final states to `<name>.safetensors`; `coordinator` lists its config overrides (None: no
    coordinator, one round without FedAvg); `worker_args` are test-only node flags.
    """
    assert list(data) == [f"owner{i}" for i in range(len(data))], list(data)
    assert workers == [f"worker{i}" for i in range(len(workers))], workers
    key_hex = secrets.token_hex(32)
    server = EmbeddedBusServer(authkey=bytes.fromhex(key_hex))
    address = server.start()
    specs.servers.append(server)  # type: ignore[attr-defined]
    session = f"t{uuid.uuid4().hex[:10]}"
    most = max(len(b) for b in data.values())
    assert len(round_schedule({o: len(b) for o, b in data.items()}, WINDOW)) == -(-most // WINDOW)
    cfg = compose_config([
        f"model=tiny_{family}", "finetune=lora" if lora else "finetune=full",
        f"architecture.owners={len(data)}", f"architecture.workers={len(workers)}",
        "architecture.cut_layers=1", "architecture.tail_blocks=1",
        f"architecture.microbatches_per_window={WINDOW}", f"task.steps_per_round={most}",
        "architecture.adaptive_weights=false", "architecture.timeout_s=30",
        "finetune.lr=1e-2", "finetune.eps=1e-6",  # as in the in-process equivalence (adamw)
        "finetune.compute_dtype=fp32",  # the in-process oracle computes in fp32, bf16 would not match
        "data.labels=[l0,l1,l2]", "model.num_labels=3",  # tiny_config (the fixtures are the data)
        "task.save_checkpoint=false", *(coordinator or []), *overrides,
    ])  # fmt: skip
    cfg.model = tiny_config(family)
    config_path = tmp_path / "config.yaml"
    save_resolved_config(cfg, config_path)
    env = {SESSION_KEY_ENV: key_hex}
    roles = [("worker", workers), ("owner", list(data))]
    if coordinator is not None:
        roles.insert(0, ("coordinator", ["coordinator"]))
    children = []
    for role, names in roles:
        for rank, name in enumerate(names):
            argv = [
                sys.executable, "-m", "splitlab.node", "--config", str(config_path),
                "--role", role, "--rank", str(rank), "--run-dir", str(tmp_path),
                "--session", session, "--control", f"{address.host}:{address.port}",
                "--out", str(tmp_path / f"{name}.safetensors"),
            ]  # fmt: skip
            if coordinator is None:
                argv.append("--no-coordinator")
            if role == "worker":
                argv += worker_args or []
            if role == "owner" and validation and validation.get(name):
                save_batches(tmp_path / f"{name}.val.safetensors", validation[name])
                argv += ["--val-batches", str(tmp_path / f"{name}.val.safetensors")]
            if role == "owner":
                save_batches(tmp_path / f"{name}.data.safetensors", data[name])
                argv += ["--batches", str(tmp_path / f"{name}.data.safetensors")]
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

    children = specs(tmp_path, family, {"owner0": data}, ["worker0"])
    result = run_group(children, timeout_s=180, sink=None)

    assert result.exit_code == 0, result.diagnosis()
    split = twin(tiny_model(family))
    state = {
        **load_file(str(tmp_path / "owner0.safetensors")),
        **load_file(str(tmp_path / "worker0.safetensors")),
    }
    split.load_state_dict(state, strict=False)
    assert_same_parameters(ref, split)


def run_each(children: list[ChildSpec], timeout_s: float = 120.0) -> dict[str, tuple[int, str]]:
    """Every child to its own end (no teardown at the first failure): name -> (code, output).
    Forked from one zygote, as the launcher starts them."""
    zygotes = Zygotes([c.argv for c in children], pid_env=LAUNCHER_PID_ENV)
    logs = {c.name: tempfile.TemporaryFile(mode="w+") for c in children}
    procs = {}
    for c in children:
        env, out = {**os.environ, **c.env}, logs[c.name]
        procs[c.name] = zygotes.spawn(list(c.argv), env, out.fileno()) or subprocess.Popen(
            list(c.argv), env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        codes = {name: p.wait(timeout_s) for name, p in procs.items()}
        return {name: (code, _read(logs[name])) for name, code in codes.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        zygotes.close()
        for log in logs.values():
            log.close()


def _read(log: IO[str]) -> str:
    log.seek(0)
    return log.read()


@pytest.mark.slow
def test_divergence_aborts_every_process_naming_the_cause(tmp_path: Path) -> None:
    data = {"owner0": batches("llama", n=6)}  # lr 1e30: after one step activations overflow

    ended = run_each(specs(tmp_path, "llama", data, ["worker0"], overrides=["finetune.lr=1e30"]))

    (owner_code, owner_log), (worker_code, worker_log) = ended["owner0"], ended["worker0"]
    assert owner_code == ExitCode.NON_FINITE, owner_log
    assert "NonFiniteError" in owner_log and "owner 'owner0'" in owner_log
    assert worker_code == ExitCode.ABORTED, worker_log
    assert "aborted by 'owner0'" in worker_log and "NonFiniteError" in worker_log


@pytest.mark.slow
def test_a_vanished_worker_times_the_owner_out_naming_it(tmp_path: Path) -> None:
    data = {"owner0": batches("gpt2", n=7)}  # three windows; the worker leaves after the first

    # 3 s bounds the waits inside the windows; process start (model loads, REGISTER both
    # ways) has its own allowance, so a loaded machine cannot time the start-up out instead
    ended = run_each(
        specs(
            tmp_path,
            "gpt2",
            data,
            ["worker0"],
            ["--windows", "1"],
            overrides=["architecture.timeout_s=3", "architecture.startup_timeout_s=120"],
        )  # fmt: skip
    )

    owner_code, owner_log = ended["owner0"]
    assert ended["worker0"][0] == 0
    assert owner_code in (ExitCode.TIMEOUT, ExitCode.PEER_LOST), owner_log
    assert "'worker0'" in owner_log.split("ERROR", 1)[-1]


def traces(folder: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in folder.glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]


@pytest.mark.slow
def test_three_owners_two_workers_rounds_traces_and_fedavg_weights(tmp_path: Path) -> None:
    data = {"owner0": batches("gpt2", n=5), "owner1": batches("gpt2", n=2, seed=40), "owner2": []}
    weights = {"worker0": 3.0, "worker1": 1.0}
    (tmp_path / "traces").mkdir()
    children = specs(
        tmp_path, "gpt2", data, list(weights), coordinator=["task.rounds=2"],
        overrides=["architecture.compute_weights=[3.0,1.0]"],
    )  # fmt: skip

    result = run_group(children, timeout_s=240, sink=None)

    assert result.exit_code == 0, result.diagnosis()
    records = traces(tmp_path / "traces")
    fedavg = json.loads((tmp_path / "coordinator.safetensors").read_text())["fedavg_weights"]
    samples = {o: sum(int(b["input_ids"].shape[0]) for b in items) for o, items in data.items()}
    for round_id, window_ids in ((0, (0, 1)), (1, (2, 3))):
        in_round = [r for r in records if r.get("window") in window_ids]
        for owner, items in data.items():  # each owner follows the 3:1 WRR sequence on
            sent = [r["worker"] for r in in_round if r["kind"] == "forward" and r["owner"] == owner]
            n = len(items)
            expected = SmoothWRR(weights).assign(n * (round_id + 1))[n * round_id :]
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
    assert fedavg[0]["owner2"] == 0


def _size(data: dict[str, list], record: dict, windows_per_round: int = 2) -> int:
    """Sequences in the microbatch a forward record names (ids count within their window)."""
    offset = record["window"] % windows_per_round
    return int(data[record["owner"]][offset * WINDOW + record["microbatch"]]["input_ids"].shape[0])


@pytest.mark.slow
def test_resume_continues_from_the_last_completed_round(tmp_path: Path) -> None:
    data = {"owner0": batches("llama", n=4), "owner1": batches("llama", n=2, seed=60)}
    straight, interrupted = tmp_path / "a", tmp_path / "b"
    for folder in (straight, interrupted):
        folder.mkdir()

    def launch(folder: Path, rounds: int, resume: bool) -> None:
        coordinator = [
            f"task.rounds={rounds}",
            f"task.resume={str(resume).lower()}",
            "task.save_checkpoint=true",
            f"task.checkpoint_dir={folder / 'ckpt'}",
            "task.keep_checkpoints=all",
        ]
        children = specs(folder, "llama", data, ["worker0"], coordinator=coordinator)
        result = run_group(children, timeout_s=240, sink=None)
        assert result.exit_code == 0, result.diagnosis()

    launch(straight, 2, False)
    launch(interrupted, 1, False)
    launch(interrupted, 2, True)

    assert completed_rounds(interrupted / "ckpt") == [0, 1]
    final_a = load_checkpoint(straight / "ckpt" / "round-000002.safetensors").state
    final_b = load_checkpoint(interrupted / "ckpt" / "round-000002.safetensors").state
    for key, tensor in final_a.items():
        torch.testing.assert_close(final_b[key], tensor, msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.slow
def test_divergence_with_a_coordinator_ends_every_process_naming_the_cause(tmp_path: Path) -> None:
    data = {"owner0": batches("llama", n=6)}

    ended = run_each(specs(tmp_path, "llama", data, ["worker0"], coordinator=["task.rounds=2"],
                           overrides=["finetune.lr=1e30"]))  # fmt: skip

    assert ended["owner0"][0] == ExitCode.NON_FINITE, ended["owner0"][1]
    for name in ("worker0", "coordinator"):
        code, output = ended[name]
        assert code == ExitCode.ABORTED, output
        assert "aborted by 'owner0'" in output and "NonFiniteError" in output


@pytest.mark.slow
def test_owner_validates_through_its_worker_before_fedavg(tmp_path: Path) -> None:
    data, held_out = {"owner0": batches("gpt2", n=4)}, batches("gpt2", n=2, seed=90)
    (tmp_path / "traces").mkdir()
    children = specs(
        tmp_path, "gpt2", data, ["worker0"], coordinator=["task.rounds=1"],
        validation={"owner0": held_out},
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
        **load_file(str(tmp_path / "owner0.safetensors")),
        **load_file(str(tmp_path / "worker0.safetensors")),
    }
    model.load_state_dict(state, strict=False)
    expected = evaluate(part_chain(build_parts(model, PLAN)), adapter_of("gpt2"), held_out)
    assert traced["val_samples"] == expected.num_samples
    assert traced["val_loss"] == pytest.approx(expected.loss, rel=1e-5)
    assert traced["val_perplexity"] == pytest.approx(expected.perplexity, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("merge", [False, True], ids=["adapters", "merged"])
def test_lora_round_between_processes_matches_in_process(tmp_path: Path, merge: bool) -> None:
    data = {"owner0": batches("gpt2", n=4)}
    lora = {"r": 4, "alpha": 8.0}
    coordinator = ["task.rounds=1", "task.save_checkpoint=true",
                   f"task.checkpoint_dir={tmp_path / 'ckpt'}"]  # fmt: skip
    overrides = ["finetune.lora.r=4", "finetune.lora.alpha=8.0",
                 f"finetune.merge_for_fedavg={str(merge).lower()}"]  # fmt: skip
    children = specs(
        tmp_path, "gpt2", data, ["worker0"], coordinator=coordinator, lora=True, overrides=overrides
    )

    result = run_group(children, timeout_s=240, sink=None)

    assert result.exit_code == 0, result.diagnosis()
    model = tiny_model("gpt2")  # the same draws as every process: model, then adapters
    front, body, tail = build_parts(model, PLAN)
    apply_lora([front, body, tail], LoraConfig(**lora))
    owner = OwnerNode("owner0", front, tail, adamw(partition_parameters(front, tail)))
    worker = WorkerNode("worker0", body, adamw(partition_parameters(body)))
    engine = UShapeEngine(owners=[owner], workers=[worker], max_inflight=2, credit=2)
    engine.run_round(data, quota=WINDOW)
    expected = {**merged_state(front), **merged_state(tail), **merged_state(body)}
    saved = load_checkpoint(tmp_path / "ckpt" / "round-000001.safetensors").state
    assert set(saved) == set(tiny_model("gpt2").state_dict())
    for key, tensor in expected.items():
        torch.testing.assert_close(saved[key], tensor, msg=lambda m, k=key: f"{k}: {m}")
