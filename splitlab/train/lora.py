"""LoRA on parts (peft's in-place injection) and what FedAvg averages in LoRA mode.

`apply_lora` injects peft LoRA layers into each part's target modules (the family adapter's
defaults unless `finetune.lora.targets` names others) and freezes everything else, except the
head of a classification family (its classifier starts random, so it trains in full) and the
factors of a low-rank cut (`lowrank_in` / `lowrank_out`, `splitlab.models.lowrank`), which
train in full as in the SFT paper. Parts
share modules with the loaded model, so injecting into a part changes that model too, and
state dict keys keep their upstream prefixes (`model.layers.3.self_attn.q_proj.lora_A...`).

What FedAvg averages (`finetune.merge_for_fedavg`):
- False (default): the trainable tensors only (`trainable_state`): LoRA A and B and any fully
  trained head. Base weights never change, so they never travel; an update is a few hundred
  KiB instead of the model. Averaging A and B separately is not the average of the products
  B @ A, but every node restarts the round from the same averaged adapter, which is the usual
  federated-LoRA compromise and what keeps the traffic low.
- True: every node sends `merged_state` (base + scale * B @ A under the original key names),
  the dense weights are averaged exactly, and `fold_into_base` loads them as the new base and
  zeroes B, so the next round's adapters start from the averaged model. Exact, but dense-sized.
Checkpoints always hold `merged_state`: original key names, loadable without peft.

    .venv/bin/pytest tests/equivalence/test_train_lora.py -q
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn

from splitlab.config.enums import TaskKind
from splitlab.config.schema import LoraConfig
from splitlab.errors import ConfigError, ProtocolError
from splitlab.models.parts import LOWRANK_IN, LOWRANK_OUT, Part
from splitlab.train.rounds import copy_exact

ADAPTER = "default"
_BASE = ".base_layer."


def peft_config(cfg: LoraConfig, part: Part) -> PeftLoraConfig:
    targets = list(cfg.targets) or list(part.adapter.lora_targets)
    return PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        fan_in_fan_out=part.adapter.lora_fan_in_fan_out,
    )


def _has_target(part: Part, targets: Sequence[str]) -> bool:
    return any(name.rsplit(".", 1)[-1] in targets for name, _ in part.named_modules())


def apply_lora(parts: Sequence[Part], cfg: LoraConfig) -> None:
    """Inject LoRA into every part that has a target module; freeze the rest.

    Raises:
        ConfigError: no part holds any of the target modules (naming `finetune.lora.targets`).
    """
    injected = 0
    for part in parts:
        config = peft_config(cfg, part)
        targets = sorted(config.target_modules)
        if _has_target(part, targets):
            inject_adapter_in_model(config, part, adapter_name=ADAPTER)  # freezes non-adapters
            injected += 1
        else:
            part.requires_grad_(False)
        if part.span.has_head and part.adapter.task is TaskKind.classification:
            for path in part.adapter.head_paths:
                part.get_submodule(path).requires_grad_(True)
        for name, module in part.named_modules():
            if name.rsplit(".", 1)[-1] in (LOWRANK_IN, LOWRANK_OUT):
                module.requires_grad_(True)
    if parts and not injected:
        raise ConfigError(
            f"finetune.lora.targets={list(cfg.targets)}: no module of these parts matches "
            f"{sorted(peft_config(cfg, parts[0]).target_modules)}"
        )


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors LoRA mode trains (and averages): adapters and fully trained heads."""
    return {name: p.detach() for name, p in module.named_parameters() if p.requires_grad}


def load_trainable_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy averaged adapter tensors back in place.

    Raises:
        ProtocolError: `state` lacks one of this module's trainable tensors or holds it with
            another shape.
    """
    params = dict(module.named_parameters())
    mine = [name for name, p in params.items() if p.requires_grad]
    missing = [name for name in mine if name not in state]
    if missing:
        raise ProtocolError(f"adapter update lacks {missing[:5]} (of {len(missing)})")
    copy_exact([(name, params[name], state[name]) for name in mine], "adapter update")


def _lora_layers(module: nn.Module) -> dict[str, LoraLayer]:
    return {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}


def merged_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The dense state under the original key names: base + scale * B @ A, adapters dropped."""
    layers = _lora_layers(module)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in module.state_dict().items():
        if ".lora_" in key:
            continue
        if _BASE not in key:
            out[key] = tensor
            continue
        owner, leaf = key.split(_BASE, 1)
        merged = tensor
        if leaf == "weight" and ADAPTER in layers[owner].lora_A:
            merged = tensor + layers[owner].get_delta_weight(ADAPTER).detach().to(tensor.dtype)
        out[f"{owner}.{leaf}"] = merged
    return out


def fold_into_base(module: nn.Module, dense: Mapping[str, torch.Tensor]) -> None:
    """Load averaged dense weights as the new base and zero B (so the model equals `dense`).

    Raises:
        ProtocolError: `dense` lacks a key this module holds or holds it with another shape.
    """
    layers = _lora_layers(module)
    pairs = []
    for key, tensor in module.state_dict().items():
        if ".lora_" in key:
            continue
        original = key.replace(_BASE, ".")
        if original not in dense:
            raise ProtocolError(f"merged update lacks {original!r}")
        pairs.append((original, tensor, dense[original]))
    copy_exact(pairs, "merged update")
    with torch.no_grad():
        for layer in layers.values():
            if ADAPTER in layer.lora_B:
                layer.lora_B[ADAPTER].weight.zero_()
