"""Split vs unsplit on the packaged real models: MiniLM (BERT) and SmolLM2-135M (tied Llama).

Needs the asset cache (fetched once); skipped with SPLITLAB_SKIP_ASSETS=1.

    .venv/bin/pytest -m assets tests/equivalence/test_assets_equivalence.py
"""

from __future__ import annotations

import pytest
import torch
from model_helpers import grads_of, run_split, run_unsplit, twin
from transformers import PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from splitlab.config.enums import DType, ModelSource
from splitlab.config.schema import ModelConfig
from splitlab.models.families import INPUT_IDS, LABELS, PAD_MASK, get_family
from splitlab.models.load import load_model
from splitlab.models.parts import build_parts, build_stages
from splitlab.models.plan import ring_plan, u_shape_plan
from splitlab.models.tokens import positions_from_pad_mask

pytest.importorskip("splitlab.assets", reason="the asset cache module is not there yet")

pytestmark = pytest.mark.assets

TEXTS = ["The film was a quiet delight from start to finish.", "Dull."]
MINILM = ModelConfig(
    name="minilm",
    family="bert",
    source=ModelSource.packaged,
    id="minilm",
    num_layers=6,
    hidden_size=384,
    num_labels=2,
    dtype=DType.fp32,
    dropout=0.0,
)
SMOLLM2 = ModelConfig(
    name="smollm2_135m",
    family="llama",
    source=ModelSource.packaged,
    id="smollm2_135m",
    num_layers=30,
    hidden_size=576,
    dtype=DType.fp32,
    dropout=0.0,
)


@pytest.fixture(scope="module")
def minilm() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    torch.manual_seed(0)  # the classifier on top of MiniLM is freshly initialised
    model, tokenizer = load_model(MINILM)
    assert tokenizer is not None
    return model, tokenizer


@pytest.fixture(scope="module")
def smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    model, tokenizer = load_model(SMOLLM2)
    assert tokenizer is not None
    return model, tokenizer


def encode(tokenizer: PreTrainedTokenizerBase) -> dict[str, torch.Tensor]:
    encoded = tokenizer(TEXTS, padding=True, return_tensors="pt")
    return {INPUT_IDS: encoded["input_ids"], PAD_MASK: encoded["attention_mask"]}


def assert_same(
    ref: tuple[torch.Tensor, torch.Tensor],
    split: tuple[torch.Tensor, torch.Tensor],
    model: PreTrainedModel,
    split_model: PreTrainedModel,
) -> None:
    torch.testing.assert_close(split[0], ref[0])
    torch.testing.assert_close(split[1], ref[1])
    split_grads = grads_of(split_model)
    for name, grad in grads_of(model).items():
        torch.testing.assert_close(split_grads[name], grad, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(("cut_layers", "tail_blocks"), [(1, 0), (2, 2)])
def test_minilm_u_shape_matches_unsplit(
    minilm: tuple[PreTrainedModel, PreTrainedTokenizerBase], cut_layers: int, tail_blocks: int
) -> None:
    model, tokenizer = minilm
    model, split_model = twin(model), twin(model)  # fresh gradients per case
    batch = encode(tokenizer) | {LABELS: torch.tensor([1, 0])}
    plan = u_shape_plan(num_layers=6, cut_layers=cut_layers, tail_blocks=tail_blocks)

    ref = run_unsplit(model, get_family("bert"), batch)
    split = run_split(build_parts(split_model, plan), batch)

    assert_same(ref, split, model, split_model)


def test_smollm2_u_shape_matches_unsplit_with_its_tied_head(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = smollm2
    model, split_model = twin(model), twin(model)
    batch = encode(tokenizer)
    plan = u_shape_plan(num_layers=30, cut_layers=1, tail_blocks=0)

    ref = run_unsplit(model, get_family("llama"), batch)
    front, body, tail = build_parts(split_model, plan)
    split = run_split((front, body, tail), batch)

    assert tail.module("lm_head").weight is front.module("model.embed_tokens").weight
    assert_same(ref, split, model, split_model)


@torch.no_grad()
def test_smollm2_ring_decodes_the_same_tokens_as_generate(
    smollm2: tuple[PreTrainedModel, PreTrainedTokenizerBase],
) -> None:
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    stages = build_stages(model, ring_plan(30, [7, 19, 26]))
    caches = [stage.new_cache() for stage in stages]

    pad_mask, x, tokens = torch.ones_like(ids), ids, []
    for _ in range(8):
        positions = positions_from_pad_mask(pad_mask, query_len=x.shape[1])
        for stage, cache in zip(stages, caches, strict=True):
            x = stage(x, pad_mask, positions, cache)
        x = x[:, -1:, :].argmax(dim=-1)
        tokens.append(x)
        pad_mask = torch.cat([pad_mask, torch.ones_like(x)], dim=1)
    generated = model.generate(ids, max_new_tokens=8, do_sample=False)

    assert torch.equal(torch.cat(tokens, dim=1), generated[:, ids.shape[1] :])
