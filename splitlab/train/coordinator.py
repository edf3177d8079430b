"""The round coordinator on the control bus, and the node side of its exchange.

Coordinator, per round (round ids are 0-based indexes, logged as 1..N; they start at 0, or one
past the last checkpoint with `resume`):

    START   -> every node: round id, first window id, windows in the round and the roster
               (no key: every member derives the data plane's from the session key)
    (owners and workers run the windows among themselves)
    UPDATE  <- every node: its partition ("owner" or "body") as safetensors bytes + samples
    FedAvg owner and body partitions separately by processed samples (`splitlab.train.rounds`)
    checkpoint (optional, atomic, original key names, round + RNG + validation loss), then
               prune the checkpoints `task.keep_checkpoints` does not keep
    UPDATE  -> every node: partition "merged", the averaged weights of its own keys
    ... and after the last round, STOP.

On resume the coordinator first sends each node the checkpoint's weights (UPDATE "merged",
`round_id` = the checkpoint's round) right after START, so every replica starts from the
last completed round. Model updates are safetensors bytes, never pickle.

    .venv/bin/pytest tests/equivalence/test_train_coordinator.py -q
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load, save
from torch import nn

from splitlab.config.enums import KeepCheckpoints
from splitlab.control.endpoint import ControlEndpoint
from splitlab.control.messages import Abort, BusMessage, Kind, Start, Stop, Update
from splitlab.errors import AbortedError, AssetError, ProtocolError, WaitTimeoutError
from splitlab.telemetry.records import (
    AbortRecord,
    CheckpointRecord,
    Emit,
    FedavgRecord,
    RoundEndRecord,
    RoundStartRecord,
    StopRecord,
    round_number,
)
from splitlab.train.checkpoint import (
    capture_rng,
    checkpoint_path,
    latest_checkpoint,
    prune_checkpoints,
    remove_stale_temps,
    save_checkpoint,
    unshared,
)
from splitlab.train.checkpoint_files import checkpoint_bytes
from splitlab.train.fedavg import check_finite
from splitlab.train.protocol import abort_peers
from splitlab.train.rounds import NodeUpdate, aggregate, redistribute

log = logging.getLogger(__name__)
MERGED = "merged"  # UPDATE partition: this round's average, loaded with `Exchange.load`
RESTORE = "restore"  # UPDATE partition: a checkpoint's dense weights, loaded with `.restore`
DenseView = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    return save(unshared(state))


def decode_state(blob: bytes, sender: str) -> dict[str, torch.Tensor]:
    """Raises: ProtocolError naming the sender when the bytes are not a safetensors state."""
    try:
        return load(blob)
    except Exception as exc:  # safetensors raises its own error types
        raise ProtocolError(f"UPDATE from {sender!r} is not a safetensors state: {exc}") from exc


class Coordinator:
    """Runs rounds over a fixed roster of owners and workers."""

    def __init__(
        self,
        *,
        control: ControlEndpoint,
        owners: Sequence[str],
        workers: Sequence[str],
        num_windows: int,
        checkpoint_dir: Path | None = None,
        keep_checkpoints: KeepCheckpoints = KeepCheckpoints.last_and_best,
        timeout_s: float = 120.0,
        dense_view: DenseView | None = None,
        emit: Emit | None = None,
    ) -> None:
        """`dense_view` turns the averaged updates into the checkpoint's dense state under the
        original keys (LoRA adapters need the base: see `splitlab.train.roles`); None = as is.
        `keep_checkpoints` prunes `checkpoint_dir` after every save ("best" = the lowest
        owners' validation loss of the round, sample-weighted).
        `emit` traces the rounds: `round_start`, `fedavg` (each node's weight = its samples, and
        its metrics), `checkpoint`, `round_end`, `abort` (the cause), `stop`.
        """
        self.emit: Emit = emit or (lambda record: None)
        self.control = control
        self.dense_view = dense_view or dict
        self.owners, self.workers = list(owners), list(workers)
        self.num_windows = num_windows
        self.checkpoint_dir = checkpoint_dir
        self.keep_checkpoints = KeepCheckpoints(keep_checkpoints)
        self.timeout_s = timeout_s
        self.history: list[dict[str, int]] = []  # per round: node -> FedAvg weight
        self.metrics: list[dict[str, Any]] = []  # per round and node: UPDATE metrics + samples

    @property
    def nodes(self) -> list[str]:
        return self.owners + self.workers

    def run(self, *, rounds: int, resume: bool = False) -> None:
        """Run rounds `[start, rounds)`; any failure sends ABORT with its cause to every node."""
        try:
            self._run(rounds=rounds, resume=resume)
        except BaseException as exc:
            self.emit(AbortRecord(reason=f"{type(exc).__name__}: {exc}"[:2000]))
            abort_peers(self.control, self.nodes, exc)
            raise

    def _run(self, *, rounds: int, resume: bool) -> None:
        ctl = self.control
        start, initial = 0, None
        if self.checkpoint_dir is not None:
            remove_stale_temps(self.checkpoint_dir)
        if resume and self.checkpoint_dir is not None:
            checkpoint = latest_checkpoint(self.checkpoint_dir)
            if checkpoint is not None:
                start, initial = checkpoint.round_id + 1, checkpoint
        for round_id in range(start, rounds):
            began = time.monotonic()
            plan: dict[str, Any] = {
                "first_window": round_id * self.num_windows,
                "num_windows": self.num_windows,
                "load": initial is not None,
            }
            start_msg = Start(
                session_id=ctl.session, sender=ctl.node_id, round_id=round_id, plan=plan,
                roster=[{"node": n} for n in self.nodes],
            )  # fmt: skip
            ctl.send_all(self.nodes, start_msg)
            self.emit(RoundStartRecord(round=round_id, resumed=initial is not None, **plan))
            if initial is not None:
                self._send_merged(initial.round_id, initial.state, None, RESTORE)
                initial = None
            updates = self._collect_updates(round_id)
            merged = aggregate(updates)
            self.history.append({u.node: u.num_samples for u in updates})
            for update in updates:
                self.emit(FedavgRecord(
                    round=round_id, node=update.node, partition=update.partition,
                    weight=update.num_samples, metrics=self._node_metrics(round_id, update.node),
                ))  # fmt: skip
            if self.checkpoint_dir is not None:
                dense = self.dense_view(merged)
                path = save_checkpoint(
                    self.checkpoint_dir, round_id=round_id, state=dense, rng=capture_rng(),
                    val_loss=self._owner_mean(round_id, "loss"),
                )  # fmt: skip
                self.emit(CheckpointRecord(round=round_id, path=str(path), num_tensors=len(dense)))
                prune_checkpoints(self.checkpoint_dir, self.keep_checkpoints)
            self._send_merged(round_id, merged, {u.node: set(u.state) for u in updates}, MERGED)
            seconds = time.monotonic() - began
            self.emit(RoundEndRecord(round=round_id, round_s=round(seconds, 3)))
            log.info("%s", self._round_line(round_id, rounds, updates, seconds))
        ctl.send_all(self.nodes, Stop(session_id=ctl.session, sender=ctl.node_id, reason="done"))
        self.emit(StopRecord(num_rounds=rounds))
        if self.checkpoint_dir is not None:
            num_files, num_bytes = checkpoint_bytes(self.checkpoint_dir)
            log.info("checkpoints (keep_checkpoints=%s): %d files, %.1f MiB in %s",
                     self.keep_checkpoints.value, num_files, num_bytes / 2**20,
                     self.checkpoint_dir)  # fmt: skip

    def _node_metrics(self, round_id: int, node: str) -> dict[str, Any]:
        rows = [m for m in self.metrics if m["round"] == round_id and m["node"] == node]
        return {k: v for k, v in rows[-1].items() if k not in ("round", "node")} if rows else {}

    def _round_line(
        self, round_id: int, rounds: int, updates: list[NodeUpdate], seconds: float
    ) -> str:
        """One progress line: the owners' held-out metrics, sample-weighted."""
        samples = sum(u.num_samples for u in updates if u.node in self.owners)
        line = f"round {round_number(round_id)}/{rounds} done in {seconds:.1f} s: {samples} samples"
        for name in ("train_loss", "loss", "accuracy", "perplexity"):
            mean = self._owner_mean(round_id, name)
            if mean is not None:
                line += f", {'val_' if name != 'train_loss' else ''}{name} {mean:.4f}"
        return line

    def _owner_mean(self, round_id: int, name: str) -> float | None:
        """The owners' metric `name` of the round, sample-weighted; None when none reported it."""
        rows = [m for m in self.metrics if m["round"] == round_id and m["node"] in self.owners]
        pairs = [(r[name], r.get("samples") or 1) for r in rows if r.get(name) is not None]
        return sum(v * w for v, w in pairs) / sum(w for _, w in pairs) if pairs else None

    def _collect_updates(self, round_id: int) -> list[NodeUpdate]:
        got = self.control.collect(Kind.UPDATE, self.nodes, self.timeout_s)
        updates = []
        for node, msg in got.items():
            assert isinstance(msg, Update)
            self.metrics.append(
                {"round": round_id, "node": node, "samples": msg.num_samples, **msg.metrics}
            )
            if msg.round_id != round_id:
                raise ProtocolError(
                    f"UPDATE from {node!r} is for round {msg.round_id}, not {round_id}"
                )
            expected = "owner" if node in self.owners else "body"
            if msg.partition != expected:
                raise ProtocolError(
                    f"UPDATE from {node!r} carries {msg.partition!r}, expected {expected!r}"
                )
            state = decode_state(msg.weights, node)
            check_finite(node, state)  # loud, naming node and key, even at weight 0 (a fault)
            updates.append(NodeUpdate(node, msg.partition, state, msg.num_samples))
        return updates

    def _send_merged(
        self,
        round_id: int,
        merged: Mapping[str, torch.Tensor],
        keys: Mapping[str, set[str]] | None,
        partition: str,
    ) -> None:
        ctl = self.control
        for node in self.nodes:
            own = keys[node] if keys is not None else set(merged)
            blob = encode_state({k: merged[k] for k in own if k in merged})
            msg = Update(
                session_id=ctl.session, sender=ctl.node_id, round_id=round_id,
                num_samples=0, partition=partition, weights=blob,
            )  # fmt: skip
            ctl.send(node, msg)


# --- the node side ------------------------------------------------------------------------------


Idle = Callable[[], object]  # a waiting node's work between control polls (e.g. validation);
# a truthy return means it did some (served a request): that is progress, the wait restarts


def _wait(
    control: ControlEndpoint, kinds: tuple[Kind, ...], timeout_s: float, idle: Idle | None
) -> BusMessage:
    """`control.wait_for`, calling `idle` (which blocks briefly) between polls.

    Work `idle` reports (a truthy return) restarts the `timeout_s` clock: a worker serving the
    owners' held-out batches under load is making progress, not waiting on a lost peer.
    """
    if idle is None:
        return control.wait_for(kinds, timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        msg = control.poll(0.0, kinds)
        if isinstance(msg, Abort):
            raise AbortedError(f"round aborted by {msg.cause_node!r}: {msg.reason}")
        if msg is not None:
            return msg
        if time.monotonic() > deadline:
            names = ", ".join(k.value for k in kinds)
            raise WaitTimeoutError(f"{control.node_id!r} waited {timeout_s:.1f} s for {names}")
        if idle():
            deadline = time.monotonic() + timeout_s


def wait_start(
    control: ControlEndpoint, coordinator: str, timeout_s: float, idle: Idle | None = None
) -> Start | None:
    """The next START, or None when the coordinator said STOP."""
    msg = _wait(control, (Kind.START, Kind.STOP), timeout_s, idle)
    if msg.sender != coordinator:
        raise ProtocolError(
            f"{msg.kind.value} from {msg.sender!r}, not the coordinator {coordinator!r}"
        )
    return msg if isinstance(msg, Start) else None


def send_update(
    control: ControlEndpoint,
    coordinator: str,
    *,
    round_id: int,
    partition: str,
    state: Mapping[str, torch.Tensor],
    num_samples: int,
    metrics: Mapping[str, Any] | None = None,
) -> None:
    msg = Update(
        session_id=control.session, sender=control.node_id, round_id=round_id,
        num_samples=num_samples, partition=partition, weights=encode_state(state),
        metrics=dict(metrics or {}),
    )  # fmt: skip
    control.send(coordinator, msg)


Loader = Callable[[nn.Module, Mapping[str, torch.Tensor]], None]


def _redistribute_one(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    redistribute(state, [module])


def receive_merged(
    control: ControlEndpoint,
    modules: Sequence[nn.Module],
    timeout_s: float,
    idle: Idle | None = None,
    *,
    load: Loader = _redistribute_one,
    restore: Loader = _redistribute_one,
) -> int:
    """Load the coordinator's weights into `modules`; returns their round id.

    A MERGED update is a round's average (`load`); a RESTORE update is a checkpoint's dense
    weights sent on resume (`restore`). See `splitlab.train.exchange` for both per mode.

    Raises:
        ProtocolError: the MERGED update lacks a key these modules hold (or has another shape).
        AssetError: the same for a RESTORE update, naming the checkpoint file.
        NonFiniteError: the update holds NaN/Inf.
    """
    msg = _wait(control, (Kind.UPDATE,), timeout_s, idle)
    assert isinstance(msg, Update)
    if msg.partition not in (MERGED, RESTORE):
        raise ProtocolError(
            f"UPDATE {msg.partition!r} from {msg.sender!r}, expected {MERGED!r} or {RESTORE!r}"
        )
    state = decode_state(msg.weights, msg.sender)
    check_finite(msg.sender, state)
    if msg.partition == MERGED:
        for module in modules:
            load(module, state)
        return msg.round_id
    try:
        for module in modules:
            restore(module, state)
    except ProtocolError as exc:  # a resume: the fault is in the file, so name it
        name = checkpoint_path(Path(), msg.round_id).name
        raise AssetError(f"checkpoint {name} sent by {msg.sender!r} to resume: {exc}") from exc
    return msg.round_id
