"""Shard loader: only the owned tensors, nothing left on meta, tied heads, dtype, fresh blocks."""

from __future__ import annotations

import json
import logging
import logging.handlers

import pytest
import torch
from model_helpers import model_option
from safetensors.torch import load_file, save_file

from splitlab.errors import AssetError
from splitlab.models.plan import Span, ring_plan
from splitlab.models.shard import (
    load_blocks,
    load_part,
    load_part_hf,
    open_checkpoint,
    owned_bytes,
    resident_bytes,
)
from splitlab.reference.tiny import save_tiny


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny(model_option("tiny_llama"), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return save_tiny(model_option("tiny_gpt2"), tmp_path_factory.mktemp("gpt2"))


def _no_meta(module: torch.nn.Module) -> bool:
    return not any(t.is_meta for t in [*module.parameters(), *module.buffers()])


@pytest.mark.parametrize("span", ring_plan(4, [1, 3]), ids=["head", "middle", "tail"])
def test_resident_bytes_match_owned_bytes(llama, span: Span) -> None:
    index = open_checkpoint(llama)
    part, report = load_part(index, span)
    owned = owned_bytes(index, span)
    assert _no_meta(part)
    assert abs(report.resident_weight_bytes - owned) <= 0.1 * owned
    assert report.peak_weight_bytes == owned  # nothing beyond its own tensors was read


def test_middle_stage_holds_no_embedding(llama) -> None:
    part, _ = load_part(open_checkpoint(llama), Span(1, 3))
    assert not any(k.startswith(("model.embed_tokens", "lm_head")) for k in part.state_dict())


def test_rotary_inv_freq_is_recomputed(llama) -> None:
    part, _ = load_part(open_checkpoint(llama), Span(1, 3))
    inv_freq = part.aux["rotary"].inv_freq
    assert not inv_freq.is_meta and torch.isfinite(inv_freq).all()


def test_tied_tail_reads_the_embedding_tensor(gpt2) -> None:
    index = open_checkpoint(gpt2)
    assert "lm_head.weight" not in index.key_files  # tied: the checkpoint stores wte only
    tail, _ = load_part(index, Span(3, 4, has_head=True))
    wte = load_file(str(gpt2 / "model.safetensors"))["transformer.wte.weight"]
    torch.testing.assert_close(tail.module("lm_head").weight, wte)


def test_hf_loader_materialises_the_whole_model(llama) -> None:
    index = open_checkpoint(llama)
    span = Span(1, 3)
    part, report = load_part_hf(llama, span)
    shard, _ = load_part(index, span)
    assert report.peak_weight_bytes > 10 * report.resident_weight_bytes  # embeddings dominate
    assert report.resident_weight_bytes == resident_bytes(shard)


def test_hf_loader_reports_in_one_splitlab_line_not_transformers_report(
    llama, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = load_file(str(llama / "model.safetensors"))
    tensors["model.extra.weight"] = torch.zeros(2)  # transformers' report: UNEXPECTED
    (tmp_path / "config.json").write_text((llama / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf_root = logging.getLogger("transformers")  # its own handler; it does not propagate
    hf_root.addHandler(hf_records := logging.handlers.BufferingHandler(1000))
    try:
        with caplog.at_level("INFO", logger="splitlab.models.shard"):
            load_part_hf(tmp_path, Span(1, 3))
    finally:
        hf_root.removeHandler(hf_records)

    lines = [r.getMessage() for r in caplog.records if r.name == "splitlab.models.shard"]
    assert len(lines) == 1
    assert lines[0].startswith(f"loaded llama weights from {tmp_path} in ")
    assert lines[0].endswith("; nothing newly initialised; unused in the folder: model.extra")
    assert not [r for r in hf_records.buffer if r.levelno >= logging.WARNING]


def test_bf16_dtype(llama) -> None:
    part, report = load_part(open_checkpoint(llama), Span(1, 3), dtype="bf16")
    assert {p.dtype for p in part.parameters()} == {torch.bfloat16}
    assert report.resident_weight_bytes * 2 == pytest.approx(
        load_part(open_checkpoint(llama), Span(1, 3))[1].resident_weight_bytes, rel=0.01
    )


def test_unmatched_prefix_is_an_error(llama, tmp_path) -> None:
    tensors = load_file(str(llama / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.startswith("model.layers.2.")}
    (tmp_path / "config.json").write_text((llama / "config.json").read_text())
    save_file(kept, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AssetError, match="model.layers.2"):
        load_part(open_checkpoint(tmp_path), Span(1, 3))


def test_load_blocks_returns_fresh_blocks_each_call(llama) -> None:
    index = open_checkpoint(llama)
    first, second = load_blocks(index, [2]), load_blocks(index, [2])
    assert first[2] is not second[2]
    assert _no_meta(first[2])
    expected = load_file(str(llama / "model.safetensors"))["model.layers.2.mlp.up_proj.weight"]
    torch.testing.assert_close(first[2].mlp.up_proj.weight, expected)


def test_load_blocks_refuses_a_retained_block(llama) -> None:
    index = open_checkpoint(llama)
    kept = load_blocks(index, [1])[1]
    with pytest.raises(AssertionError, match="fresh"):
        load_blocks(index, [1], block_factory=lambda config, i: kept)


def test_index_caches_metadata_only(llama) -> None:
    index = open_checkpoint(llama)
    assert all(isinstance(v, type(llama)) for v in index.key_files.values())
    assert json.loads((llama / "config.json").read_text())["num_hidden_layers"] == 4
