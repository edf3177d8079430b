"""Moving blocks mid-generation changes no token: tiny Llama, 3 stages, every shift combo.

In process (threads, in-process control pipes and KV channels) for every (boundary, k), and
over TCP (three stage processes) with one scripted run that makes every combo in turn.
"""

from __future__ import annotations

import gc
import json
import time
import weakref
from types import SimpleNamespace

import pytest
import torch

from splitlab.configure import compose_config
from splitlab.errors import WaitTimeoutError
from splitlab.infer import kv_chunks
from splitlab.infer.compute import PartCompute
from splitlab.infer.migration import Migrator, PrestageReport
from splitlab.infer.planners import Decision, ForcedShift, Scripted, WindowView
from splitlab.infer.ring import GenParams
from splitlab.launch.ring import run_ring
from splitlab.models.plan import Span
from splitlab.models.shard import load_part, open_checkpoint
from splitlab.reference.tiny import local_ring
from splitlab.telemetry.trace import Tracer

PROMPT = torch.tensor([[464, 3290, 286, 4881, 318, 257, 1588, 1748]])
CUTS = [3, 6]
GEN = GenParams(max_new_tokens=30)
COMBOS = [(b, k) for b in (1, 2) for k in (1, -1, 2, -2)]


@pytest.mark.parametrize(("boundary", "k"), COMBOS, ids=[f"b{b}{k:+d}" for b, k in COMBOS])
def test_in_process_shift_keeps_every_token(
    tiny9, noshift, boundary: int, k: int, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(kv_chunks, "KV_CHUNK_BYTES", 512)  # 2-4 positions a frame: 6-12 frames
    tracers = [Tracer.open(tmp_path / f"stage-{i}.jsonl", role="stage", rank=i) for i in range(3)]
    result, computes = local_ring(tiny9, CUTS, PROMPT, GEN, window=5, tracers=tracers,
                                  planner=ForcedShift(at_token=15, shift_k=k, boundary=boundary))  # fmt: skip
    for t in tracers:
        t.close()
    assert result.token_ids == noshift
    expected = list(CUTS)
    expected[boundary - 1] += k
    assert [c.span.start for c in computes[1:]] == expected
    assert all(c.layer_ids == list(range(c.span.start, c.span.stop)) for c in computes)
    moves = [json.loads(x) for i in range(3) for x in (tmp_path / f"stage-{i}.jsonl").open()]
    moves = [r for r in moves if r["kind"] == "migration"]
    assert {r["side"] for r in moves} == {"donor", "receiver"}
    for r in moves:  # 2 x kv heads x head dim x fp32 bytes per block per token
        assert r["kv_bytes_per_block_token"] == 2 * 2 * 8 * 4
        assert r["kv_bytes"] == abs(k) * (8 + 15) * 128  # prompt + 15 decoded tokens deep
    # decided at the barrier of token 10, built while tokens 11-15 decoded
    receiver = next(r for r in moves if r["side"] == "receiver")
    assert receiver["prepared"] and receiver["prepare_ms"] > 0.0


class _Counting:
    """Noop that records the token (and the tokens left) of every view it is asked about."""

    name = "counting"

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.remaining: list[int | None] = []

    def decide(self, view: WindowView) -> Decision:
        self.tokens.append(view.token)
        self.remaining.append(view.remaining)
        return Decision(view.cuts, "noop")


def test_decisions_are_taken_for_the_barriers_held_and_none_past_the_end(tiny9, noshift) -> None:
    planner = _Counting()
    result, _ = local_ring(tiny9, CUTS, PROMPT, GEN, window=5, planner=planner)
    assert result.token_ids == noshift
    # 30 tokens, W = 5: barriers at 5..25, each decided once (token 5's at the barrier, the
    # rest a window ahead); none for token 30, which generation never reaches
    assert planner.tokens == [5, 10, 15, 20, 25]
    assert planner.remaining == [24, 19, 14, 9, 4]  # tokens 6..29 are left after token 5


def test_nack_aborts_the_epoch_and_decoding_goes_on(tiny9, noshift) -> None:
    result, computes = local_ring(tiny9, CUTS, PROMPT, GEN, window=5, faults={1: "nack"},
                                  planner=ForcedShift(at_token=15, shift_k=1, boundary=1))  # fmt: skip
    assert result.token_ids == noshift
    assert all(w["aborted"] for w in result.windows)
    assert [c.span.start for c in computes[1:]] == CUTS  # nothing moved


class _RetryLater(Scripted):
    """Scripted, but it thinks for `pause_s` before proposing its second shift (the head waits
    meanwhile), so the first shift's late KV is on the wire before the second's is asked for."""

    def __init__(self, shifts: list[tuple[int, int, int]], pause_s: float) -> None:
        super().__init__(shifts)
        self.pause_s, self.asked = pause_s, 0

    def decide(self, view: WindowView) -> Decision:
        self.asked += 1
        if self.asked == 2:
            time.sleep(self.pause_s)
        return super().decide(view)


def test_kv_that_misses_the_barrier_is_nacked_and_decoding_goes_on(
    tiny9, noshift, monkeypatch, tmp_path
) -> None:
    """Stage 1 gives block 5 to stage 2, the first chunk of its KV 1.5 timeouts late (a slow
    link): stage 2 and stage 1 NACK about a timeout after PROPOSE, the head (not in the move)
    hears them in time and aborts the epoch instead of declaring a stage lost, and stage 1
    sends no further chunk. The same shift a window later moves the block: stage 2 drops the
    late chunk of the aborted epoch, takes the new one's 5 chunks, and no token changes."""
    monkeypatch.setattr(kv_chunks, "KV_CHUNK_BYTES", 512)  # 4 positions of one block a frame
    tracers = [Tracer.open(tmp_path / f"stage-{i}.jsonl", role="stage", rank=i) for i in range(3)]
    result, computes = local_ring(tiny9, CUTS, PROMPT, GenParams(max_new_tokens=16), window=5,
                                  faults={1: "slow_kv"}, ctrl_timeout_s=0.5, tracers=tracers,
                                  planner=_RetryLater([(5, 2, -1), (10, 2, -1)], pause_s=0.6))  # fmt: skip
    for t in tracers:
        t.close()
    assert result.token_ids == noshift[:16]
    assert [w["aborted"] for w in result.windows] == [True, False]
    assert "refused epoch 1" in result.windows[0]["decision"]  # a NACK, not a lost stage
    assert [c.span.start for c in computes[1:]] == [3, 5]  # the second try moved block 5
    records = [json.loads(x) for x in (tmp_path / "stage-2.jsonl").open()]
    (moved,) = [r for r in records if r["kind"] == "migration"]
    # 8 + 10 positions x 128 B in 512 B frames, after the aborted epoch's one late frame
    assert (moved["epoch"], moved["kv_frames"], moved["kv_stale_frames"]) == (2, 5, 1)
    assert moved["kv_bytes"] == 18 * 128


def test_release_frees_a_given_away_block_without_a_full_collection(tiny9) -> None:
    """Release is off the token path but shares the host's cores: no gc walk of the model."""
    part, _ = load_part(open_checkpoint(tiny9), Span(0, 3, has_embeddings=True, has_head=False))
    compute = PartCompute(part)
    compute.forward(PROMPT, 0)
    block, layer = compute.take_block(2)
    gone = [weakref.ref(block), weakref.ref(layer.keys)]
    del block, layer
    compute.commit(0, 2)  # gives block 2 and its KV away; nothing comes in
    assert compute.release_pending and all(ref() is not None for ref in gone)
    collections: list[str] = []
    record = lambda phase, _info: collections.append(phase)  # noqa: E731
    gc.callbacks.append(record)
    gc.disable()  # no automatic collection: only one release itself asks for would show
    try:
        compute.release()
    finally:
        gc.enable()
        gc.callbacks.remove(record)
    assert all(ref() is None for ref in gone)
    assert collections == [] and not compute.release_pending
    assert compute.forward(torch.tensor([[5]]), PROMPT.shape[1]).shape[1] == 1


def test_warm_up_loads_a_boundary_block_and_keeps_nothing(tiny9) -> None:
    index = open_checkpoint(tiny9)
    part, _ = load_part(index, Span(3, 6, has_embeddings=False, has_head=False))
    compute = PartCompute(part)
    before = compute.layer_ids
    migrator = Migrator(stage=1, compute=compute, cuts=CUTS, num_layers=9, index=index)
    assert migrator.warm_up() > 0.0
    assert compute.layer_ids == before and not compute.release_pending
    assert Migrator(stage=1, compute=compute, cuts=CUTS, num_layers=9).warm_up() == 0.0


def _stage1(tiny9):  # noqa: ANN001, ANN202
    index = open_checkpoint(tiny9)
    compute = PartCompute(load_part(index, Span(3, 6, has_embeddings=False, has_head=False))[0])
    compute.forward(torch.randn(1, PROMPT.shape[1], 32), 0)
    return Migrator(stage=1, compute=compute, cuts=CUTS, num_layers=9, index=index), compute


def test_prepared_blocks_are_taken_only_for_the_cuts_they_were_built_for(tiny9) -> None:
    """A boundary-1 shift of -1 sends block 2 to stage 1 (stage 1 alone here, no KV)."""
    migrator, compute = _stage1(tiny9)
    assert not migrator.prepare([3, 5])  # stage 1 gives block 5 away: nothing comes in
    assert not migrator.prepare([3, 3, 6])  # cannot apply to 3 stages: nothing, no raise
    assert migrator.prepare([2, 6])
    job = migrator._prepared
    assert job is not None and job.layer_ids == (2,)
    job.thread.join(timeout=30)
    assert job.error is None and set(job.blocks) == {2}
    later = time.monotonic() + 30
    assert (
        migrator._take_prepared((2, 5), [2], report := PrestageReport(), deadline=later) is None
    )  # other cuts
    assert migrator._prepared is None and not report.prepared
    assert migrator.prepare([2, 6])
    taken = migrator._take_prepared((2, 6), [2], report, deadline=later)
    assert set(taken) == {2} and report.prepared and report.prepare_ms > 0.0
    assert compute.layer_ids == [3, 4, 5]  # building ahead changed nothing live


def test_a_failed_preparation_is_raised_by_the_prestage_that_takes_it(tiny9) -> None:
    migrator, _ = _stage1(tiny9)
    migrator.index = None  # every later load fails: as a broken checkpoint copy would
    assert not migrator.prepare([2, 6])  # no index: nothing can be prepared
    migrator2, _ = _stage1(tiny9)
    migrator2.index.key_files.clear()  # the read fails inside the thread
    assert migrator2.prepare([2, 6])
    with pytest.raises(Exception, match="load_blocks"):
        migrator2._take_prepared((2, 6), [2], PrestageReport(), deadline=time.monotonic() + 30)


class _Flood:
    """A KV port on which a frame is always there, each taking `frame_s` to read: the late
    frames of an aborted epoch, queued behind each other on a slow link."""

    def __init__(self, frame_s: float) -> None:
        self.frame_s, self.read = frame_s, 0

    def recv(self, *, timeout_s: float) -> SimpleNamespace:
        time.sleep(self.frame_s)
        self.read += 1
        return SimpleNamespace(kind="kv", meta={"epoch": 1}, tensors={}, release=lambda: None)


def test_a_stream_of_frames_cannot_hold_a_receiver_past_its_deadline(tiny9) -> None:
    """Stage 1 takes block 2 (epoch 2) while stage 0's link still delivers epoch 1's late
    frames back to back: it gives up at its timeout, not when the stream ends."""
    migrator, compute = _stage1(tiny9)
    flood = _Flood(frame_s=0.05)
    migrator.kv_prev, migrator.timeout_s = flood, 0.5
    t0 = time.monotonic()
    with pytest.raises(WaitTimeoutError, match="KV from stage 0 not in within timeout_s=0.5"):
        migrator.prestage([2, 6], pos=PROMPT.shape[1], epoch=2)
    assert time.monotonic() - t0 < 0.5 + 3 * flood.frame_s + 1.0  # one frame past, plus load
    assert 5 <= flood.read <= 11
    migrator.abort()
    assert compute.layer_ids == [3, 4, 5]


@pytest.mark.slow
def test_tcp_every_combo_in_one_scripted_run(tiny9, noshift, tmp_path) -> None:
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    shifts = []
    for i, (b, k) in enumerate(
        [(1, 1), (1, -1), (1, 2), (1, -2), (2, 1), (2, -1), (2, 2), (2, -2)]
    ):
        shifts.append([4 + 2 * i, b, k])  # each combo, then its reverse, returns to [3, 6]
    cfg = compose_config([
        "task=infer", "model=tiny_llama", "model.num_layers=9", "model.source=hub",
        f"model.id={tiny9}", f"architecture.cuts=[{CUTS[0]},{CUTS[1]}]", "architecture.window=2",
        f"architecture.peer_hosts=[{','.join(hosts)}]", "task.max_new_tokens=30",
        f"task.prompt_ids=[{','.join(map(str, PROMPT[0].tolist()))}]",
    ])  # fmt: skip
    script = ",".join(f"{t}:{b}:{k}" for t, b, k in shifts)
    group, result = run_ring(cfg, run_dir=tmp_path, timeout_s=240,
                             stage_args={0: ["--scripted-shifts", script]})  # fmt: skip
    assert group.exit_code == 0, group.diagnosis()
    assert result["token_ids"] == noshift
    windows = [json.loads(x) for x in (tmp_path / "traces" / "stage-0.jsonl").open()]
    windows = [w for w in windows if w["kind"] == "window"]
    assert sum(w["decision"].startswith("scripted: b") for w in windows) == 8
    assert not any(w["aborted"] for w in windows)
    moves = [json.loads(x) for i in range(3) for x in (tmp_path / "traces" / f"stage-{i}.jsonl").open()]  # fmt: skip
    receivers = [r for r in moves if r["kind"] == "migration" and r["side"] == "receiver"]
    assert len(receivers) == 8 and all(r["prepared"] for r in receivers)  # built a window ahead
