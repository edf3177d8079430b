"""Real stage processes over TCP on 127.0.0.1/.2/.3: tokens, parity refusal, a killed stage."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from model_helpers import model_option

from splitlab.config.schema import Config
from splitlab.configure import compose_config
from splitlab.errors import ExitCode
from splitlab.infer.ring import GenParams
from splitlab.launch.ring import run_ring, spawn_stages
from splitlab.reference.tiny import reference_tokens, save_tiny

HOSTS = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny(model_option("tiny_llama"), tmp_path_factory.mktemp("tiny_llama"))


def _config(model: Path, cuts: list[int], max_new_tokens: int) -> Config:
    """tiny_llama's saved weights with the GPT-2 tokenizer, no control plane, no chat template."""
    return compose_config([
        "task=infer", "model=tiny_llama", "model.source=hub", f"model.id={model}",
        f"architecture.cuts=[{','.join(map(str, cuts))}]", "architecture.window=0",
        f"architecture.peer_hosts=[{','.join(HOSTS)}]", f"architecture.ctrl_host={HOSTS[0]}",
        f"task.max_new_tokens={max_new_tokens}", "task.chat=false",
    ])  # fmt: skip


def test_tcp_ring_matches_one_process(tiny_llama, tmp_path) -> None:
    group, result = run_ring(_config(tiny_llama, [1, 3], 16), run_dir=tmp_path, timeout_s=120)
    assert group.exit_code == 0, group.diagnosis()
    from transformers import AutoTokenizer

    from splitlab import assets

    tokenizer = AutoTokenizer.from_pretrained(assets.resolve("gpt2_tokenizer"))
    prompt = torch.tensor([tokenizer("What is the capital of France?")["input_ids"]])
    assert result["token_ids"] == reference_tokens(tiny_llama, prompt, GenParams(max_new_tokens=16))
    traces = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert traces == ["stage-0.jsonl", "stage-1.jsonl", "stage-2.jsonl"]


def test_sigkill_mid_decode_fails_the_others_with_a_diagnosis(tiny_llama, tmp_path) -> None:
    procs = spawn_stages(_config(tiny_llama, [1, 3], 100000), run_dir=tmp_path)
    trace = tmp_path / "traces" / "stage-0.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (trace.is_file() and trace.read_text().count('"kind":"token"') >= 10):
            assert time.monotonic() < deadline, "the ring never started decoding"
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        codes = [p.wait(timeout=30) for p in (procs[0], procs[2])]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [ExitCode.PEER_LOST, ExitCode.PEER_LOST]
    for i in (0, 2):
        assert "lost stage-1" in (tmp_path / "logs" / f"stage-{i}.log").read_text()


@pytest.mark.slow
def test_check_multinode_passes() -> None:
    done = subprocess.run([sys.executable, str(TOOLS / "check_multinode.py")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
