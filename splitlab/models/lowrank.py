"""Low-rank cut (SFT): the FFN's first projection at a block, replaced by its truncated SVD.

`decompose(model, block, rank)` replaces the first FFN projection W (H -> F) of block `block`
with two trainable linears initialised from the SVD of the pre-trained W = U S V (computed in
float64, then cast to W's dtype):

- `lowrank_in`  (`LowRankIn`,  H -> R, no bias): weight S_R V_R, so its output is the R-dim
  **code** that crosses the wire at a cut;
- `lowrank_out` (`LowRankOut`, R -> F, with W's bias): weight U_R.

With `factors=three` (the paper's u, Sigma, v form) S_R is a factor of its own: `lowrank_in`
holds V_R (orthonormal rows, so the code is x's coordinates in the top singular directions) and
`lowrank_out` a trainable vector `sigma` = S_R applied to the code before U_R, so the scale
trains on the receiver. Both forms compute the same function at initialisation; they differ in
what the gradient moves (the code's scale and the factors' conditioning).

At R = min(F, H) the product reproduces W (fp32 up to rounding). GPT-2's `mlp.c_fc` is a
Conv1D (weight stored H x F); it is handled as its transpose. Llama/Qwen2's gated MLP stacks
`gate_proj` and `up_proj` (2F x H) before the SVD, so one R-dim code feeds both (R values per
token cross, not 2R).

State dict keys (the rest of the model keeps the upstream keys):

    BERT   bert.encoder.layer.N.intermediate.dense.lowrank_in.weight        R x H
           bert.encoder.layer.N.intermediate.dense.lowrank_out.{weight,bias} F x R, F
           (three factors: also ...lowrank_out.sigma                         R)
    GPT-2  transformer.h.N.mlp.c_fc.lowrank_in.weight                       R x H
           transformer.h.N.mlp.c_fc.lowrank_out.{weight,bias}               F x R, F
    Llama  model.layers.N.mlp.gate_proj.lowrank_in.weight                   R x H
           model.layers.N.mlp.gate_proj.lowrank_out.weight                  2F x R ([gate; up])
           (`mlp.up_proj` becomes a parameter-free `LowRankSibling` reading the up half)

`merge_lowrank(model)` folds every decomposition back into the original modules (and keys),
e.g. to save a checkpoint with the original model's key names; `merged_state_dict` does the
same on a state dict alone.

Residual modes at a cut (`splitlab.config.enums.ResidualMode`), per family:

- BERT (post-LN): block output = LayerNorm(FFN(a) + a), a = the attention sublayer's output.
  keep: the code and a (B x T x H) cross. drop: LayerNorm(FFN(a)); only the code crosses.
- GPT-2, Llama (pre-LN): block output = r + FFN(norm(r)), r = the residual stream after
  attention. keep: the code and r cross. drop: the output is FFN(norm(r)) alone, so the whole
  residual stream (embeddings and every earlier block's contribution) ends at the cut.

    .venv/bin/pytest tests/equivalence/test_lowrank_equivalence.py -q
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from splitlab.config.enums import SftFactors
from splitlab.errors import ConfigError
from splitlab.models.families import FamilyAdapter, family_for_model
from splitlab.models.parts import LOWRANK_IN, LOWRANK_OUT
from splitlab.models.plan import PartitionPlan, lowrank_cuts


class LowRankIn(nn.Linear):
    """H -> R, no bias: S_R V_R of the SVD. Its output is the code that crosses a cut."""

    def __init__(self, in_features: int, rank: int, **factory: object) -> None:
        super().__init__(in_features, rank, bias=False, **factory)


class LowRankOut(nn.Linear):
    """R -> sum(splits), with the original bias: U_R, after a trainable per-rank scale `sigma`
    (S_R) in the three-factor form. `splits` are the original projections' output widths
    (Llama: (F, F) for gate and up)."""

    def __init__(self, rank: int, splits: tuple[int, ...], *, bias: bool, sigma: bool = False,
                 **factory: object) -> None:  # fmt: skip
        super().__init__(rank, sum(splits), bias=bias, **factory)
        self.splits = tuple(splits)
        sigma_r = nn.Parameter(torch.ones(rank, **factory)) if sigma else None  # type: ignore[arg-type]
        self.register_parameter("sigma", sigma_r)

    def forward(self, code: torch.Tensor) -> torch.Tensor:
        return super().forward(code if self.sigma is None else code * self.sigma)

    def dense_weight(self) -> torch.Tensor:
        """U_R (times S_R in the three-factor form): what multiplies `lowrank_in`'s output."""
        return self.weight if self.sigma is None else self.weight * self.sigma


class LowRankLinear(nn.Module):
    """Stands in for the first FFN projection: `lowrank_out(lowrank_in(x))`, first split."""

    def __init__(self, lowrank_in: LowRankIn, lowrank_out: LowRankOut, *, conv1d: bool) -> None:
        super().__init__()
        self.lowrank_in = lowrank_in
        self.lowrank_out = lowrank_out
        self.conv1d = conv1d  # the replaced modules were GPT-2 Conv1D (merge restores them)

    @property
    def rank(self) -> int:
        return self.lowrank_in.out_features

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every replaced projection's output for input `x` (one code, split once)."""
        return self.lowrank_out(self.lowrank_in(x)).split(self.lowrank_out.splits, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projections(x)[0]


class LowRankSibling(nn.Module):
    """Stands in for a further stacked projection (Llama `up_proj`): no parameters of its own.

    In an unsplit forward it recomputes the code from its owner (the same function, so the
    same values and gradients); a split part never calls it, it expands the code once.
    """

    def __init__(self, owner: LowRankLinear, index: int) -> None:
        super().__init__()
        self._owner = [owner]  # a list, so the owner is not registered twice (no duplicate keys)
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._owner[0].projections(x)[self.index]


def _weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
    """(W as out x in, bias, is_conv1d) of an nn.Linear or a GPT-2 Conv1D."""
    if isinstance(module, Conv1D):
        return module.weight.t(), module.bias, True
    if isinstance(module, nn.Linear):
        return module.weight, module.bias, False
    raise ConfigError(f"low-rank cut: cannot decompose a {type(module).__name__} (already cut?)")


def decompose(
    model: nn.Module,
    block: int,
    rank: int,
    *,
    adapter: FamilyAdapter | None = None,
    factors: SftFactors | str = SftFactors.two,
) -> LowRankLinear:
    """Replace block `block`'s first FFN projection(s) with their rank-`rank` SVD, in place,
    in the two- or three-factor form (module docstring).

    Raises:
        ConfigError: naming `finetune.sft.rank` when R is outside [1, min(F, H)], or the block
            when it is already decomposed or out of range.
    """
    adapter = adapter or family_for_model(model)
    num_layers = adapter.num_layers(model.config)
    if not 0 <= block < num_layers:
        raise ConfigError(f"low-rank cut at block {block}: the model has {num_layers} blocks")
    block_module = model.get_submodule(adapter.block_path(block))
    originals = [block_module.get_submodule(path) for path in adapter.ffn_in_paths]
    parts = [_weight_and_bias(m) for m in originals]
    weight = torch.cat([w for w, _, _ in parts], dim=0)  # (sum F) x H
    full_rank = min(weight.shape)
    if not 1 <= rank <= full_rank:
        raise ConfigError(
            f"finetune.sft.rank={rank}: must be in [1, {full_rank}] (min of the FFN's "
            f"{weight.shape[0]} outputs and {weight.shape[1]} inputs at block {block})"
        )
    u, s, vh = torch.linalg.svd(weight.detach().to(torch.float64), full_matrices=False)
    factory = {"device": weight.device, "dtype": weight.dtype}
    splits = tuple(w.shape[0] for w, _, _ in parts)
    has_bias = any(b is not None for _, b, _ in parts)
    lowrank_in = LowRankIn(weight.shape[1], rank, **factory)
    three = SftFactors(factors) is SftFactors.three
    lowrank_out = LowRankOut(rank, splits, bias=has_bias, sigma=three, **factory)
    with torch.no_grad():
        if three:
            lowrank_in.weight.copy_(vh[:rank])
            lowrank_out.sigma.copy_(s[:rank])
        else:
            lowrank_in.weight.copy_(s[:rank, None] * vh[:rank])
        lowrank_out.weight.copy_(u[:, :rank])
        if has_bias:
            biases = [b if b is not None else weight.new_zeros(w.shape[0]) for w, b, _ in parts]
            lowrank_out.bias.copy_(torch.cat([b.detach() for b in biases]))
    owner = LowRankLinear(lowrank_in, lowrank_out, conv1d=parts[0][2])
    block_module.set_submodule(adapter.ffn_in_paths[0], owner)
    for index, path in enumerate(adapter.ffn_in_paths[1:], start=1):
        block_module.set_submodule(path, LowRankSibling(owner, index))
    return owner


def decompose_plan(
    model: nn.Module, plan: PartitionPlan, *, adapter: FamilyAdapter | None = None
) -> dict[int, LowRankLinear]:
    """Decompose every block the plan cuts at (`splitlab.models.plan.with_lowrank_cuts`)."""
    adapter = adapter or family_for_model(model)
    return {
        cut.block: decompose(model, cut.block, cut.rank, adapter=adapter, factors=cut.factors)
        for cut in lowrank_cuts(plan)
    }


def lowrank_at(model: nn.Module, block: int, *, adapter: FamilyAdapter | None = None) -> nn.Module:
    """The `LowRankLinear` at block `block` of `model` (or of a part holding that path)."""
    adapter = adapter or family_for_model(model)
    return model.get_submodule(f"{adapter.block_path(block)}.{adapter.ffn_in_paths[0]}")


def decomposed_blocks(model: nn.Module) -> dict[str, LowRankLinear]:
    """Module path -> `LowRankLinear` for every decomposition in `model`."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LowRankLinear)}


def _merged(owner: LowRankLinear) -> list[nn.Module]:
    weight = owner.lowrank_out.dense_weight() @ owner.lowrank_in.weight  # (sum F) x H
    bias = owner.lowrank_out.bias
    modules: list[nn.Module] = []
    offset = 0
    for width in owner.lowrank_out.splits:
        w = weight[offset : offset + width].detach()
        b = None if bias is None else bias[offset : offset + width].detach()
        if owner.conv1d:
            module = Conv1D(width, w.shape[1]).to(device=w.device, dtype=w.dtype)
            with torch.no_grad():
                module.weight.copy_(w.t())
                module.bias.copy_(b if b is not None else torch.zeros_like(module.bias))
        else:
            module = nn.Linear(
                w.shape[1], width, bias=b is not None, device=w.device, dtype=w.dtype
            )
            with torch.no_grad():
                module.weight.copy_(w)
                if b is not None:
                    module.bias.copy_(b)
        modules.append(module)
        offset += width
    return modules


def merge_lowrank(model: nn.Module, *, adapter: FamilyAdapter | None = None) -> nn.Module:
    """Fold every decomposition back into dense projections (original types and keys), in place.

    The merged weight is U_R S_R V_R as trained (either form), so a rank-R cut merges to a
    rank-R matrix.
    """
    adapter = adapter or family_for_model(model)
    for path, owner in decomposed_blocks(model).items():
        block_path = path[: -len(adapter.ffn_in_paths[0]) - 1]
        block_module = model.get_submodule(block_path)
        for sub_path, module in zip(adapter.ffn_in_paths, _merged(owner), strict=True):
            block_module.set_submodule(sub_path, module)
    return model


def merged_state_dict(
    state_dict: Mapping[str, torch.Tensor], *, adapter: FamilyAdapter
) -> dict[str, torch.Tensor]:
    """A state dict with every `lowrank_in`/`lowrank_out` pair (and `sigma`, three factors)
    folded to the original keys."""
    first = adapter.ffn_in_paths[0]
    suffix = f".{first}.{LOWRANK_IN}.weight"
    out = {k: v for k, v in state_dict.items() if f".{LOWRANK_IN}." not in k}
    out = {k: v for k, v in out.items() if f".{LOWRANK_OUT}." not in k}
    for key in state_dict:
        if not key.endswith(suffix):
            continue
        block_path = key[: -len(suffix)]
        prefix = f"{block_path}.{first}.{LOWRANK_OUT}"
        out_weight = state_dict[f"{prefix}.weight"]
        sigma = state_dict.get(f"{prefix}.sigma")
        weight = (out_weight if sigma is None else out_weight * sigma) @ state_dict[key]
        bias = state_dict.get(f"{prefix}.bias")
        chunks = weight.chunk(len(adapter.ffn_in_paths), dim=0)
        biases = bias.chunk(len(chunks)) if bias is not None else [None] * len(chunks)
        for path, w, b in zip(adapter.ffn_in_paths, chunks, biases, strict=True):
            out[f"{block_path}.{path}.weight"] = w.t().contiguous() if adapter.ffn_conv1d else w
            if b is not None:
                out[f"{block_path}.{path}.bias"] = b
    return out
