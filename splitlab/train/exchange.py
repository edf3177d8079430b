"""What a node hands to FedAvg, how it takes the average back, and what a checkpoint holds.

One `Exchange` per fine-tuning mode, so the round code never branches on the method:

- `FULL`: the partition's whole state dict; loaded back in place; checkpointed as is.
- `ADAPTERS` (LoRA, the default): only the trainable tensors (LoRA A/B and any fully trained
  head) travel and are averaged; the frozen base never changes, so it never travels.
- `MERGED` (LoRA with `finetune.merge_for_fedavg`): the dense base + B @ A under the original
  keys; the average becomes the new base and B is zeroed (exact, dense-sized traffic).

Checkpoints always take `dense(module)`: original key names, no adapter keys.

    .venv/bin/pytest tests/unit/test_reference_rounds.py -q
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from splitlab.config.enums import FinetuneMethod
from splitlab.train.lora import fold_into_base, load_trainable_state, merged_state, trainable_state
from splitlab.train.rounds import redistribute

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Exchange:
    name: str
    export: Callable[[nn.Module], State]  # what the node sends at round end
    load: Callable[[nn.Module, Mapping[str, torch.Tensor]], None]  # take the average back
    dense: Callable[[nn.Module], State]  # the checkpoint view: original keys, dense weights
    restore: Callable[[nn.Module, Mapping[str, torch.Tensor]], None]  # load a checkpoint


def _full_state(module: nn.Module) -> State:
    return dict(module.state_dict())


def _full_load(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    redistribute(state, [module])


FULL = Exchange("full", _full_state, _full_load, _full_state, _full_load)
# A LoRA resume folds the checkpoint's dense weights into the base and restarts B at zero.
ADAPTERS = Exchange("adapters", trainable_state, load_trainable_state, merged_state, fold_into_base)
MERGED = Exchange("merged", merged_state, fold_into_base, merged_state, fold_into_base)


def exchange_for(method: FinetuneMethod | str, *, merge_for_fedavg: bool = False) -> Exchange:
    """The exchange for `finetune.method` and `finetune.merge_for_fedavg`."""
    if FinetuneMethod(method) is FinetuneMethod.full:
        return FULL
    return MERGED if merge_for_fedavg else ADAPTERS
