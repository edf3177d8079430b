"""Low-rank cuts in U-shape over real loopback TCP, owner and worker schedulers in threads.

For each family, with the cut at both ends (front -> body and body -> tail, residual drop):
- the trained parameters equal the unsplit decomposed model's (AdamW, fp32);
- bytes on the wire, read from the owner's transport counters, drop by about H/R at each cut
  against the same run without a low-rank cut.

.venv/bin/pytest tests/equivalence/test_train_sft_tcp.py -q
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from model_helpers import adapter_of, tiny_config, twin
from test_train_engine import adamw, assert_same_parameters
from test_train_sft import train_chained

from splitlab.config.enums import ResidualMode, SftCut
from splitlab.config.schema import SftConfig
from splitlab.models.families import INPUT_IDS, LABELS, PAD_MASK
from splitlab.models.load import load_model
from splitlab.models.plan import u_shape_plan
from splitlab.train import loopback
from splitlab.train.loopback import run_loopback
from splitlab.train.nodes import OwnerNode, WorkerNode, partition_parameters
from splitlab.train.parts import build_training_parts

HIDDEN, RANK = 64, 4  # H / R = 16
PLAN = u_shape_plan(num_layers=4, cut_layers=1, tail_blocks=1)
NUM_MICROBATCHES, WINDOW = 4, 2
FRONT_CUT = ("activation.bytes_sent", "gradient.bytes_recv")  # owner side of front -> body
TAIL_CUT = ("activation.bytes_recv", "gradient.bytes_sent")  # owner side of body -> tail


def wide_model(family: str) -> torch.nn.Module:
    cfg = tiny_config(family)
    cfg.hidden_size, cfg.intermediate_size = HIDDEN, 2 * HIDDEN
    torch.manual_seed(0)
    return load_model(cfg, load_tokenizer=False)[0]


def data(family: str) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(NUM_MICROBATCHES):
        batch = {
            INPUT_IDS: torch.randint(0, 90, (8, 32), generator=gen),
            PAD_MASK: torch.ones(8, 32, dtype=torch.long),
        }
        if adapter_of(family).name == "bert":
            batch[LABELS] = torch.randint(0, 3, (8,), generator=gen)
        out.append(batch)
    return out


def run_tcp(model: torch.nn.Module, sft: SftConfig, batches: list) -> dict[str, float]:
    front, body, tail = build_training_parts(model, PLAN, sft=sft)
    owner = OwnerNode("o0", front, tail, adamw(partition_parameters(front, tail)))
    worker = WorkerNode("w0", body, adamw(partition_parameters(body)))
    windows = [batches[i : i + WINDOW] for i in range(0, len(batches), WINDOW)]
    counters = run_loopback(owner, worker, windows).owner_counters
    return {
        "front": sum(counters[k] for k in FRONT_CUT) / len(batches),
        "tail": sum(counters[k] for k in TAIL_CUT) / len(batches),
    }


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_low_rank_cuts_over_tcp_match_unsplit_and_cut_bytes_by_h_over_r(family: str) -> None:
    base, batches = wide_model(family), data(family)
    ref, split, plain = twin(base), twin(base), twin(base)
    sft = SftConfig(enabled=True, rank=RANK, residual=ResidualMode.drop, cuts=SftCut.both)
    train_chained(build_training_parts(ref, PLAN, sft=sft), batches, window=WINDOW)

    compressed = run_tcp(split, sft, batches)
    uncompressed = run_tcp(plain, SftConfig(enabled=False), batches)

    assert_same_parameters(ref, split)
    ratio = {cut: uncompressed[cut] / compressed[cut] for cut in ("front", "tail")}
    # body -> tail frames hold only the code (or hidden) and a JSON header; front -> body
    # frames also carry the int64 padding mask (8 bytes a token), which keeps that ratio lower.
    assert 0.9 * HIDDEN / RANK <= ratio["tail"] <= HIDDEN / RANK, (compressed, uncompressed)
    assert 0.6 * HIDDEN / RANK <= ratio["front"] <= HIDDEN / RANK, (compressed, uncompressed)
    print(f"{family}: bytes per microbatch {uncompressed} -> {compressed}, ratio {ratio}")


def loopback_nodes() -> tuple[OwnerNode, WorkerNode, list[list]]:
    front, body, tail = build_training_parts(wide_model("bert"), PLAN, sft=SftConfig())
    owner = OwnerNode("o0", front, tail, adamw(partition_parameters(front, tail)))
    worker = WorkerNode("w0", body, adamw(partition_parameters(body)))
    batches = data("bert")
    return owner, worker, [batches[i : i + 1] for i in range(len(batches))]


def test_a_slow_run_outlasts_the_stall_timeout_while_windows_finish(monkeypatch) -> None:
    """The stall timeout counts from the last finished window, not from the start: four windows
    of ~0.6 s each run 2.4 s, past a 1 s timeout, and finish."""
    monkeypatch.setattr(loopback, "STALL_TIMEOUT_S", 1.0)
    owner, worker, windows = loopback_nodes()
    result = run_loopback(owner, worker, windows, on_window=lambda _: time.sleep(0.6))
    assert len(result.losses) == len(windows)


def test_a_window_that_never_finishes_is_named_after_the_stall_timeout(monkeypatch) -> None:
    monkeypatch.setattr(loopback, "STALL_TIMEOUT_S", 1.0)
    owner, worker, windows = loopback_nodes()
    release = threading.Event()
    try:
        with pytest.raises(
            RuntimeError, match=r"no window finished in 1 s \(1 microbatches done of 4\)"
        ):
            run_loopback(owner, worker, windows, on_window=lambda _: release.wait(30))
    finally:
        release.set()
