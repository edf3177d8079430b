"""Migration between neighbouring stages: pre-stage, commit, abort, release (one stage's side).

For a proposed configuration the `Migrator` works out this stage's moves
(`splitlab.infer.reshard.moves_between`) and pre-stages them:

1. donor side: one sender thread per outgoing transfer sends the moved blocks' KV to the
   neighbour over that pair's dedicated KV channel (a multi-megabyte send blocks once the
   socket buffer fills, and both neighbours are busy pre-staging);
2. receiver side: the blocks' weights come from this stage's own checkpoint copy
   (`load_blocks`: a local read, not a transfer) and are resident before the KV, received
   next, is installed into the staging area;
3. every sender is joined before the stage answers ACK.

The weights need not wait for the barrier. The head decides the next barrier's cuts when the
previous barrier ends (its inputs are that barrier's ACKs) and sends them on COMMIT / ABORT
(`prepare`); each stage then builds the blocks it would receive in a background thread
(`prepare`) while the ring decodes the window, and the pre-stage that proposes the same cuts
takes them (`PrestageReport.prepared`). The pause is then KV and pointer swaps, whatever the
blocks weigh; a pre-stage the preparation does not match loads at the barrier as before.

Nothing live changes before COMMIT: the donor still owns (and could keep decoding with) every
block it sent, which is what makes an abort recoverable. `commit` swaps pointers on both
sides, `abort` drops the staging area, `release` frees what the commit detached, timed apart.

KV frames on a neighbour channel: kind "kv", meta {epoch, layer_ids, pos, at, n}, tensors
k<i>, v<i> (1 x kv heads x n x head dim each: positions [at, at + n) of the move, in order,
each frame at most `kv_chunks.KV_CHUNK_BYTES`, so a receiver meets its deadline between
frames on a slow link); the move's size is asserted to be
len(layer_ids) x pos x 2 x kv heads x head dim x dtype bytes. A sender that outlives the
pre-stage's deadline stops before its next chunk; what a receiver left unread (an aborted
epoch) is dropped by the next pre-stage.

    .venv/bin/python tools/check_migration.py --tokens 40 --shift-at 20
    .venv/bin/pytest tests/equivalence/test_migration_ring.py -q
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitlab.errors import ProtocolError, SplitlabError, WaitTimeoutError
from splitlab.infer.compute import PartCompute, StageCompute
from splitlab.infer.kv_chunks import KvAssembly, chunk_of, chunk_spans
from splitlab.infer.reshard import Move, moves_between, span_bounds, stage_moves

if TYPE_CHECKING:
    from splitlab.models.shard import CheckpointIndex  # transformers: echo stages skip it

log = logging.getLogger(__name__)


@dataclass
class PrestageReport:
    """What one pre-stage did (the receiver's terms of a shift's pause)."""

    moves: list[dict[str, Any]] = field(default_factory=list)  # {boundary, k, donor, receiver}
    weights_ms: float = 0.0  # load_blocks of incoming blocks (construct + read)
    kv_ms: float = 0.0  # waiting for, receiving and installing incoming KV
    send_ms: float = 0.0  # outgoing KV senders, until joined
    kv_bytes_in: int = 0
    kv_bytes_out: int = 0
    kv_bytes_per_block_token: int = 0  # 2 x kv heads x head dim x dtype bytes
    kv_frames_in: int = 0
    kv_frames_out: int = 0
    kv_stale_frames: int = 0  # frames of an aborted epoch dropped on the way
    prepared: bool = False  # the incoming blocks were built ahead, off the barrier
    prepare_ms: float = 0.0  # that background build (not part of the pause)

    @property
    def moved(self) -> bool:
        return bool(self.moves)


@dataclass
class _Prepared:
    """Blocks built ahead for one configuration, by a background thread."""

    cuts: tuple[int, ...]
    layer_ids: tuple[int, ...]
    thread: threading.Thread | None = None
    blocks: dict[int, Any] | None = None
    error: BaseException | None = None
    ms: float = 0.0


class Migrator:
    """One stage's migration machinery (see module docstring)."""

    def __init__(self, *, stage: int, compute: StageCompute, cuts: Sequence[int], num_layers: int,
                 index: CheckpointIndex | None = None, dtype: str = "auto",
                 kv_prev: Any = None, kv_next: Any = None, timeout_s: float = 5.0,
                 bypass: bool = False) -> None:  # fmt: skip
        self.stage, self.compute, self.num_layers = stage, compute, num_layers
        self.bypass = bypass  # a middle stage may be left without blocks (`architecture.bypass`)
        self.cuts = tuple(cuts)
        self.index, self.dtype, self.timeout_s = index, dtype, timeout_s
        self.kv_prev, self.kv_next = kv_prev, kv_next
        self.send_delay_s = 0.0  # testing only (`--ctrl-fault slow_kv`): the next pre-stage's
        # first KV chunk goes this late, as over a link too slow for the barrier
        self._pending: tuple[tuple[int, ...], tuple[Move, ...]] | None = None
        self._prepared: _Prepared | None = None

    def warm_up(self) -> float:
        """Load one block fresh and drop it, before generation; returns its ms.

        The first `load_blocks` in a process pays one-time costs (the block class's first
        construction, the checkpoint file's first open): measured 4.2 ms against 1.7 ms after,
        for a SmolLM2 block on 2 cores. Paid here, they stay out of the first shift's pause.
        The tensors are views of the memory-mapped checkpoint, so this holds no memory after.
        """
        compute = self.compute
        if self.index is None or not isinstance(compute, PartCompute):
            return 0.0
        layer = min(self.cuts[self.stage - 1] if self.stage else 0, self.num_layers - 1)
        t0 = time.perf_counter()
        self._load([layer])
        return (time.perf_counter() - t0) * 1e3

    def _load(self, layer_ids: Sequence[int]) -> dict[int, Any]:
        """Fresh blocks `layer_ids` from this stage's checkpoint copy (a local read)."""
        from splitlab.models.shard import load_blocks

        compute = self.compute
        assert isinstance(compute, PartCompute)
        part = compute.part
        return load_blocks(
            self.index, layer_ids, dtype=self.dtype,
            block_factory=lambda _config, i: part.adapter.block_factory(part.config, i),
        )  # fmt: skip

    def prepare(self, cuts: Sequence[int]) -> bool:
        """Start building, in a background thread, the blocks this stage would receive if the
        next barrier proposes `cuts`; True if there are any. Replaces an earlier preparation
        (its blocks are dropped when its thread ends). Cuts that cannot apply prepare nothing:
        the pre-stage that proposes them refuses them with the reason."""
        self._prepared = None
        if self.index is None or not isinstance(self.compute, PartCompute):
            return False
        try:
            moves = moves_between(self.cuts, tuple(cuts), self.num_layers, bypass=self.bypass)
        except SplitlabError:
            return False
        incoming, _ = stage_moves(self.stage, moves)
        wanted = tuple(i for m in incoming for i in m.layer_ids)
        if not wanted:
            return False
        job = _Prepared(cuts=tuple(cuts), layer_ids=wanted)

        def build() -> None:
            t0 = time.perf_counter()
            try:
                job.blocks = self._load(wanted)
            except BaseException as exc:  # raised by the pre-stage that takes it
                job.error = exc
            job.ms = (time.perf_counter() - t0) * 1e3

        job.thread = threading.Thread(target=build, name=f"prepare-{self.stage}", daemon=True)
        job.thread.start()
        self._prepared = job
        return True

    def _take_prepared(self, cuts: tuple[int, ...], wanted: Sequence[int],
                       report: PrestageReport, *, deadline: float) -> dict[int, Any] | None:  # fmt: skip
        """The blocks prepared for exactly this configuration (waiting for their thread until
        `deadline`, monotonic), or None when nothing matching was prepared."""
        job, self._prepared = self._prepared, None
        if job is None or job.cuts != cuts or job.layer_ids != tuple(wanted):
            return None
        assert job.thread is not None
        job.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if job.thread.is_alive():
            raise WaitTimeoutError(
                f"stage {self.stage}: preparing blocks {list(wanted)} did not finish within "
                f"timeout_s={self.timeout_s}"
            )
        if job.error is not None:
            raise job.error
        report.prepared, report.prepare_ms = True, job.ms
        return job.blocks

    def _port(self, neighbour: int) -> Any:
        port = self.kv_prev if neighbour < self.stage else self.kv_next
        if port is None:
            raise ProtocolError(f"stage {self.stage}: no KV channel to stage {neighbour}")
        return port

    def prestage(self, cuts: Sequence[int], *, pos: int, epoch: int) -> PrestageReport:
        """Get ready to run under `cuts` (everything, or raise: the caller NACKs)."""
        cuts = tuple(cuts)
        moves = moves_between(self.cuts, cuts, self.num_layers, bypass=self.bypass)
        incoming, outgoing = stage_moves(self.stage, moves)
        report = PrestageReport(
            moves=[
                {
                    "boundary": m.boundary,
                    "k": m.k,
                    "donor": m.donor,
                    "receiver": m.receiver,
                    "layer_ids": list(m.layer_ids),
                }
                for m in moves
                if self.stage in (m.donor, m.receiver)
            ]  # fmt: skip
        )
        self._pending = (cuts, moves)
        if not incoming:
            self._prepared = None  # prepared for another configuration: dropped
        if not (incoming or outgoing):
            return report
        compute = self.compute
        if not isinstance(compute, PartCompute):
            raise ProtocolError(f"stage {self.stage}: a model-free stage cannot migrate blocks")
        per_token = compute.bytes_per_token_kv()
        report.kv_bytes_per_block_token = per_token
        t_send = time.perf_counter()
        senders, errors, owed = [], [], list(outgoing)
        stop = threading.Event()  # set when the pre-stage gives up: senders end between chunks
        try:
            self._start_senders(
                outgoing, owed, senders, errors, stop, pos=pos, epoch=epoch, report=report
            )
        except BaseException:
            stop.set()
            self._cancel(owed, epoch)
            raise
        return self._receive(incoming, senders, errors, stop, cuts=cuts, pos=pos, epoch=epoch,
                             report=report, t_send=t_send)  # fmt: skip

    def _cancel(self, owed: list[Move], epoch: int) -> None:
        """Tell receivers still waiting for KV that it will not come (best effort)."""
        for m in owed:
            try:
                self._port(m.receiver).send("kv_cancel", {}, meta={"epoch": epoch})
            except Exception:
                pass

    def _start_senders(self, outgoing, owed, senders, errors, stop, *, pos, epoch, report) -> None:  # noqa: ANN001
        compute = self.compute
        assert isinstance(compute, PartCompute)
        per_token = report.kv_bytes_per_block_token
        delay_s = self.send_delay_s if outgoing else 0.0  # the fault delays one transfer
        if outgoing:
            self.send_delay_s = 0.0
        for m in outgoing:
            tensors = compute.export_kv(m.layer_ids)  # each chunk is made contiguous as sent
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            if nbytes != len(m.layer_ids) * pos * per_token:
                raise ProtocolError(
                    f"stage {self.stage}: KV of blocks {list(m.layer_ids)} is {nbytes} bytes, "
                    f"expected {len(m.layer_ids)} x {pos} tokens x {per_token} B"
                )
            report.kv_bytes_out += nbytes
            port = self._port(m.receiver)
            meta = {"epoch": epoch, "layer_ids": list(m.layer_ids), "pos": pos}
            spans = chunk_spans(pos, len(m.layer_ids) * per_token)
            report.kv_frames_out += len(spans)

            def send(port: Any = port, tensors: dict = tensors, meta: dict = meta,
                     spans: list = spans) -> None:  # fmt: skip
                try:
                    for i, (at, n) in enumerate(spans):
                        if stop.is_set():
                            return
                        if delay_s and not i:  # testing: the first chunk is on a slow link
                            time.sleep(delay_s)
                        port.send("kv", chunk_of(tensors, at, n), meta={**meta, "at": at, "n": n})
                except BaseException as exc:  # re-raised after the join
                    errors.append(exc)

            thread = threading.Thread(target=send, name=f"kv-send-{self.stage}", daemon=True)
            thread.start()
            senders.append(thread)
            owed.remove(m)

    def _receive(
        self, incoming, senders, errors, stop, *, cuts, pos, epoch, report, t_send
    ) -> PrestageReport:  # noqa: ANN001
        compute = self.compute
        assert isinstance(compute, PartCompute)
        per_token = report.kv_bytes_per_block_token
        try:
            if incoming:
                t0 = time.perf_counter()
                # one timeout for the blocks and their KV: the head counts on an answer within
                # two (window.ANSWER_TIMEOUTS: this, then the sends' join below)
                deadline = time.monotonic() + self.timeout_s
                wanted = [i for m in incoming for i in m.layer_ids]
                blocks = self._take_prepared(cuts, wanted, report, deadline=deadline)
                if blocks is None:
                    blocks = self._load(wanted)
                compute.stage_blocks(blocks)
                t1 = time.perf_counter()

                def recv(donor: int) -> Any:
                    # checked here: a recv looks once before it waits, and on a slow link the
                    # next frame's header is there as soon as the last one's payload is in
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise WaitTimeoutError(
                            f"stage {self.stage}: KV from stage {donor} not in within "
                            f"timeout_s={self.timeout_s}"
                        )
                    return self._port(donor).recv(timeout_s=left)

                for m in incoming:
                    kv = KvAssembly(m.layer_ids, pos)
                    while not kv.done:  # chunk by chunk: the deadline holds between them
                        msg = recv(m.donor)
                        try:
                            if int(msg.meta.get("epoch", epoch)) < epoch:  # left by an abort
                                report.kv_stale_frames += 1
                                continue
                            self._check_kv(msg, m, pos=pos, epoch=epoch)
                            kv.add(msg.tensors, at=msg.meta["at"], n=msg.meta["n"])
                            report.kv_frames_in += 1
                        finally:
                            msg.release()
                    nbytes = compute.stage_kv(kv.tensors, m.layer_ids, copy=False)
                    expect = len(m.layer_ids) * pos * per_token if per_token else nbytes
                    if nbytes != expect:
                        raise ProtocolError(
                            f"stage {self.stage}: KV for {list(m.layer_ids)} is {nbytes} bytes, "
                            f"expected {expect}"
                        )
                    report.kv_bytes_in += nbytes
                    if not per_token:
                        report.kv_bytes_per_block_token = nbytes // max(1, len(m.layer_ids) * pos)
                t2 = time.perf_counter()
                report.weights_ms, report.kv_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
        finally:
            deadline = time.monotonic() + self.timeout_s
            for thread in senders:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            report.send_ms = (time.perf_counter() - t_send) * 1e3
            stop.set()  # a sender still running (a slow link) sends no further chunk
        if any(t.is_alive() for t in senders):
            raise WaitTimeoutError(
                f"stage {self.stage}: KV send did not finish within timeout_s={self.timeout_s}"
            )
        if errors:
            raise errors[0]
        return report

    def _check_kv(self, msg: Any, move: Move, *, pos: int, epoch: int) -> None:
        meta = msg.meta
        if msg.kind == "kv_cancel":
            raise ProtocolError(f"stage {self.stage}: stage {move.donor} cancelled its KV transfer")
        if msg.kind != "kv" or meta.get("epoch") != epoch:
            raise ProtocolError(
                f"stage {self.stage}: expected KV of epoch {epoch}, got {msg.kind!r} "
                f"epoch {meta.get('epoch')}"
            )
        if list(meta.get("layer_ids", ())) != list(move.layer_ids) or meta.get("pos") != pos:
            raise ProtocolError(
                f"stage {self.stage}: KV for blocks {meta.get('layer_ids')} at pos "
                f"{meta.get('pos')}, expected {list(move.layer_ids)} at {pos}"
            )
        for key in ("at", "n"):
            if type(meta.get(key)) is not int:
                raise ProtocolError(
                    f"stage {self.stage}: KV chunk meta {key}={meta.get(key)!r}, expected an int"
                )

    def commit(self) -> float:
        """Apply the pre-staged configuration; returns the pointer-swap time (ms)."""
        if self._pending is None:
            raise ProtocolError(f"stage {self.stage}: commit without a pre-staged configuration")
        cuts, moves = self._pending
        self._pending = None
        t0 = time.perf_counter()
        incoming, outgoing = stage_moves(self.stage, moves)
        if incoming or outgoing:
            start, stop = span_bounds(cuts, self.num_layers, self.stage)
            assert isinstance(self.compute, PartCompute)
            self.compute.commit(start, stop)
        self.cuts = cuts
        return (time.perf_counter() - t0) * 1e3

    def abort(self) -> None:
        self._pending = None
        if isinstance(self.compute, PartCompute):
            self.compute.drop_staged()

    @property
    def release_pending(self) -> bool:
        return isinstance(self.compute, PartCompute) and self.compute.release_pending

    def release(self) -> float:
        if not isinstance(self.compute, PartCompute):
            return 0.0
        return self.compute.release()


def prestage_error(stage: int, exc: BaseException) -> str:
    """The NACK reason for a failed pre-stage."""
    if isinstance(exc, SplitlabError):
        return f"stage {stage}: {exc}"
    log.exception("stage %d: pre-stage failed", stage)
    return f"stage {stage}: {type(exc).__name__}: {exc}"
