"""`task=infer` end to end: the runner composes, saves a random-init checkpoint, runs 3 stages."""

from __future__ import annotations

import re

from splitlab.configure import compose_config
from splitlab.launch.ring import run_infer


def test_task_infer_tiny_llama_prints_text(tmp_path, capsys) -> None:
    cfg = compose_config(["task=infer", "model=tiny_llama", "task.max_new_tokens=6",
                          "architecture.peer_hosts=[127.0.0.1,127.0.0.2,127.0.0.3]"])  # fmt: skip
    cfg.run_dir = str(tmp_path)
    assert run_infer(cfg) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == f"prompt: {cfg.task.prompt}"
    assert len(out) == 3 and out[1].startswith("answer: ")  # the answer once
    figures = r"\d+ tokens \((max_new_tokens|eos)\): TTFT [\d.]+ ms, TPOT median [\d.]+ ms, "
    assert re.fullmatch(figures + r"[\d.]+ tokens/s", out[2]), out[2]
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [
        "stage-0.jsonl", "stage-1.jsonl", "stage-2.jsonl",
    ]  # fmt: skip
