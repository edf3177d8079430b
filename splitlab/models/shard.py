"""Shard loader: materialise only the blocks (and ends) a stage owns, straight from safetensors.

`load_part` builds the model skeleton on the meta device, prunes it to the stage's `Span`
(`splitlab.models.parts.build_part`), then fills exactly those tensors from the checkpoint with
`load_state_dict(assign=True)`. Two things are asserted, because both fail silently otherwise:
no tensor is left on meta (non-persistent buffers such as rotary `inv_freq` never appear in a
checkpoint: they are recomputed), and every declared key prefix (`model.layers.7.`, ...) matched
at least one checkpoint tensor. A tied head (`lm_head.weight` absent from the checkpoint) reads
the embedding tensor. `load_part_hf` is the legacy path: the whole model, then pruned; it reports
its load in the one line `splitlab.models.load` writes, not transformers' load report.

`CheckpointIndex` caches metadata only (folder, config, key -> file map); `load_blocks` returns
fresh blocks by global index on every call, for migration between neighbouring stages.

    .venv/bin/pytest tests/unit/test_infer_shard.py -q
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PreTrainedConfig

from splitlab.config.enums import DType
from splitlab.errors import AssetError
from splitlab.models.families import FamilyAdapter, family_for_model, family_for_model_type
from splitlab.models.load import load_line
from splitlab.models.parts import Part, build_part
from splitlab.models.plan import Span
from splitlab.telemetry.log import quiet_transformers

log = logging.getLogger(__name__)
_DTYPES = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16}


@dataclass(frozen=True)
class CheckpointIndex:
    """Metadata of one safetensors checkpoint folder (never its weights).

    Attributes:
        folder: the model folder (config.json + *.safetensors).
        config: the transformers config read from it.
        key_files: checkpoint key -> safetensors file that holds it.
        key_dtypes: checkpoint key -> stored dtype (what `dtype=auto` keeps).
    """

    folder: Path
    config: PreTrainedConfig
    key_files: Mapping[str, Path]
    key_dtypes: Mapping[str, str] = field(default_factory=dict)

    @property
    def family(self) -> FamilyAdapter:
        return family_for_model_type(self.config.model_type, where=str(self.folder))


def open_checkpoint(folder: str | Path) -> CheckpointIndex:
    """Read config and safetensors headers of `folder` once (per stage).

    Raises:
        AssetError: no config.json or no safetensors file in `folder`.
    """
    folder = Path(folder)
    try:
        config = AutoConfig.from_pretrained(folder)
    except OSError as exc:
        raise AssetError(f"checkpoint {folder}: cannot read config.json: {exc}") from exc
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / name for name in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise AssetError(f"checkpoint {folder}: no *.safetensors file")
    key_files: dict[str, Path] = {}
    key_dtypes: dict[str, str] = {}
    for path in files:
        header = _safetensors_header(path)
        for key, entry in header.items():
            if key != "__metadata__":
                key_files[key] = path
                key_dtypes[key] = entry["dtype"]
    return CheckpointIndex(folder=folder, config=config, key_files=key_files, key_dtypes=key_dtypes)


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


def torch_dtype(dtype: DType | str, index: CheckpointIndex) -> torch.dtype:
    """fp32/bf16 as asked; auto = the dtype the checkpoint stores its floating tensors in."""
    dtype = DType(dtype)
    if dtype is not DType.auto:
        return _DTYPES[dtype]
    stored = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    for name in index.key_dtypes.values():
        if name in stored:
            return stored[name]
    return torch.float32


def _read(
    index: CheckpointIndex, keys: Iterable[str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors by key, cast to `dtype` when floating; one open per file."""
    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(index.key_files[key], []).append(key)
    out: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in names:
                t = f.get_tensor(name)
                out[name] = t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
    return out


def _skeleton(adapter: FamilyAdapter, config: PreTrainedConfig) -> nn.Module:
    with torch.device("meta"):
        return adapter.model_class(config)(config)


def _source_keys(skeleton: nn.Module, index: CheckpointIndex) -> dict[str, str]:
    """Model key -> checkpoint key; a tied tensor missing from the checkpoint reads its twin."""
    names_of: dict[int, list[str]] = {}
    for name, p in skeleton.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    sources: dict[str, str] = {}
    for names in names_of.values():
        stored = [n for n in names if n in index.key_files]
        for name in names:
            if name in index.key_files:
                sources[name] = name
            elif stored:
                sources[name] = stored[0]
    return sources


def _check_no_meta(module: nn.Module, where: str) -> None:
    left = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:
        raise AssetError(f"{where}: tensors left on the meta device after loading: {left[:8]}")


def _check_prefixes(prefixes: Iterable[str], keys: Iterable[str], where: str) -> None:
    keys = list(keys)
    unmatched = [p for p in prefixes if not any(k.startswith(p + ".") for k in keys)]
    if unmatched:
        raise AssetError(f"{where}: declared prefixes matched no checkpoint tensor: {unmatched}")


def _recompute_meta_buffers(part: Part, config: PreTrainedConfig) -> None:
    """Non-persistent buffers never reach a checkpoint; rebuild their owner modules off meta."""
    for path, module in list(part.named_modules()):
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if not meta:
            continue
        if hasattr(module, "rope_type") or "rotary" in type(module).__name__.lower():
            fresh = type(module)(config=config)
            for name in meta:
                module.register_buffer(name, getattr(fresh, name), persistent=False)
        else:  # e.g. a causal-mask buffer: rebuild with the module's own constructor is unsafe
            raise AssetError(f"{path}: non-persistent buffers {meta} left on meta")


def resident_bytes(module: nn.Module) -> int:
    """Bytes of the distinct storages behind every parameter and buffer of `module`."""
    seen: dict[int, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_meta:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@dataclass
class LoadReport:
    """What a loader did, for the stage_meta trace record."""

    loader: str
    construct_ms: float = 0.0
    weights_ms: float = 0.0
    total_ms: float = 0.0
    num_tensors: int = 0
    peak_weight_bytes: int = 0  # bytes materialised during the load (hf: the whole model)
    resident_weight_bytes: int = 0  # what the part keeps


def load_part(
    index: CheckpointIndex, span: Span, *, dtype: DType | str = DType.auto
) -> tuple[Part, LoadReport]:
    """The stage `span` with only its own tensors materialised (shard loader).

    Raises:
        AssetError: a declared prefix matched nothing, a key is missing, or a tensor stayed on meta.
    """
    t0 = time.perf_counter()
    adapter = index.family
    config = index.config
    skeleton = _skeleton(adapter, config)
    sources = _source_keys(skeleton, index)
    part = build_part(skeleton, span, adapter=adapter)
    del skeleton  # pruned: the part holds only its modules (meta tensors cost nothing)
    t1 = time.perf_counter()
    where = f"shard load of blocks [{span.start}, {span.stop}) from {index.folder}"
    persistent = [k for k in part.state_dict(keep_vars=True) if not k.startswith("aux.")]
    missing = [k for k in persistent if k not in sources]
    if missing:
        raise AssetError(f"{where}: checkpoint has no tensor for {missing[:8]}")
    # Declared = every owned module that carries state (dropout has none); a tied head counts
    # as matched through its twin.
    declared = [p for p in part.paths if part.get_submodule(p).state_dict()]
    _check_prefixes(declared, [k for k in persistent if k in sources], where)
    tensors = _read(index, sorted({sources[k] for k in persistent}), torch_dtype(dtype, index))
    part.load_state_dict({k: tensors[sources[k]] for k in persistent}, strict=False, assign=True)
    _recompute_meta_buffers(part, config)
    _check_no_meta(part, where)
    t2 = time.perf_counter()
    weight_bytes = resident_bytes(part)
    report = LoadReport(
        loader="shard", construct_ms=(t1 - t0) * 1e3, weights_ms=(t2 - t1) * 1e3,
        total_ms=(t2 - t0) * 1e3, num_tensors=len(tensors),
        peak_weight_bytes=sum(t.untyped_storage().nbytes() for t in tensors.values()),
        resident_weight_bytes=weight_bytes,
    )  # fmt: skip
    return part.eval(), report


def load_part_hf(
    folder: str | Path, span: Span, *, dtype: DType | str = DType.auto
) -> tuple[Part, LoadReport]:
    """Legacy path: `from_pretrained` the whole model, then prune it to `span`."""
    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(folder)
    adapter = family_for_model_type(config.model_type, where=str(folder))
    dtype = DType(dtype)
    kwargs = {"dtype": "auto" if dtype is DType.auto else _DTYPES[dtype]}
    with quiet_transformers():  # one splitlab line instead of transformers' load report
        model, info = adapter.model_class(config).from_pretrained(
            folder, output_loading_info=True, **kwargs
        )
    t1 = time.perf_counter()
    log.info("%s", load_line(config.model_type, str(folder), info, elapsed_s=t1 - t0))
    whole = resident_bytes(model)
    part = build_part(model, span, adapter=family_for_model(model))
    del model
    t2 = time.perf_counter()
    report = LoadReport(
        loader="hf", construct_ms=(t1 - t0) * 1e3, weights_ms=0.0, total_ms=(t2 - t0) * 1e3,
        num_tensors=len(part.state_dict()), peak_weight_bytes=whole,
        resident_weight_bytes=resident_bytes(part),
    )  # fmt: skip
    return part.eval(), report


def owned_bytes(index: CheckpointIndex, span: Span, *, dtype: DType | str = DType.auto) -> int:
    """The checkpoint bytes of what `span` owns (its blocks, plus embedding/head if held).

    Computed from the safetensors headers alone: the figure resident bytes are checked against.
    A tied head counts the embedding table once more on the tail (it holds its own reference).
    """
    adapter = index.family
    prefixes = [adapter.block_path(i) for i in span.layer_ids]
    if span.has_embeddings:
        prefixes += list(adapter.embedding_paths)
    if span.has_head:
        prefixes += list(adapter.head_paths)
    itemsize = torch_dtype(dtype, index).itemsize
    total = 0
    keys = set(index.key_files)
    skeleton = _skeleton(adapter, index.config)
    sources = _source_keys(skeleton, index)
    counted: set[str] = set()
    for name, p in skeleton.state_dict(keep_vars=True).items():
        if not any(name.startswith(pre + ".") for pre in prefixes) or name not in sources:
            continue
        src = sources[name]
        if src in counted or src not in keys:
            continue
        counted.add(src)
        total += p.numel() * itemsize
    return total


def load_blocks(
    index: CheckpointIndex,
    layer_ids: Iterable[int],
    *,
    dtype: DType | str = DType.auto,
    block_factory=None,
) -> dict[int, nn.Module]:
    """Fresh blocks by global index, filled from the checkpoint (for migration).

    `block_factory(config, layer_idx)` defaults to the family's; it must return a new module on
    the meta device every call. A block handed back from a retained skeleton would be filled in
    place, keeping every migrated block alive inside it; that is asserted here.
    """
    adapter = index.family
    factory = block_factory or adapter.block_factory
    target = torch_dtype(dtype, index)
    blocks: dict[int, nn.Module] = {}
    for layer_idx in layer_ids:
        with torch.device("meta"):
            block = factory(index.config, layer_idx)
        assert all(p.is_meta for p in block.parameters()), (
            f"block_factory returned an already-materialised block {layer_idx}: it must be fresh"
        )
        prefix = adapter.block_path(layer_idx) + "."
        keys = [k for k in index.key_files if k.startswith(prefix)]
        where = f"load_blocks({layer_idx}) from {index.folder}"
        _check_prefixes([prefix[:-1]], keys, where)
        tensors = _read(index, keys, target)
        block.load_state_dict({k[len(prefix) :]: v for k, v in tensors.items()}, assign=True)
        _check_no_meta(block, where)
        blocks[layer_idx] = block.eval()
    return blocks
