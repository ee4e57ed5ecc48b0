"""Multi-LoRA: many runs' adapters beside one frozen copy of a base model.

Each targeted `nn.Linear` of the base model is swapped for a `MultiLoraLinear` that keeps the
same `weight`/`bias` parameters (so state-dict names stay Hugging Face's) and owns no adapter
weights itself. Before a pass, the caller sets the model's `LoraContext` to a list of row
groups — contiguous row ranges of the batch, each with the adapter of the run it belongs to —
and every wrapped layer adds `scale · (x_g Aᵀ) Bᵀ` to the rows of each group. Runs of
different ranks share one pass; gradients reach only the adapters present in the batch.

This module does not know about losses, optimizers or files. Adapter names are the Hugging
Face module names ("model.layers.0.self_attn.q_proj", "lm_head"), which are also PEFT's.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.protocol import LoraSpec

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGET = "lm_head"


class LoraAdapter:
    """One run's LoRA weights: per module name, A (r, in) and B (out, r) fp32 Parameters."""

    def __init__(
        self, spec: LoraSpec, shapes: dict[str, tuple[int, int]], device: torch.device
    ) -> None:
        self.spec = spec
        self.scale = spec.alpha / spec.rank
        self.weights: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}
        gen = torch.Generator(device="cpu").manual_seed(spec.seed)
        for name in sorted(shapes):
            fan_out, fan_in = shapes[name]
            a_rI = torch.empty(spec.rank, fan_in)
            # PEFT's default init: kaiming-uniform A (a=√5), zero B, so a new adapter is a no-op.
            bound = 1.0 / math.sqrt(fan_in)
            a_rI.uniform_(-bound, bound, generator=gen)
            b_Or = torch.zeros(fan_out, spec.rank)
            self.weights[name] = (nn.Parameter(a_rI.to(device)), nn.Parameter(b_Or.to(device)))

    def frozen_copy(self) -> LoraAdapter:
        """The weights as they are now, detached and without gradients or optimizer state: what
        a sample still running keeps while the run's own weights change."""
        frozen = copy.copy(self)
        frozen.weights = {
            name: (
                nn.Parameter(a.detach().clone(), requires_grad=False),
                nn.Parameter(b.detach().clone(), requires_grad=False),
            )
            for name, (a, b) in self.weights.items()
        }
        return frozen

    def parameters(self) -> list[nn.Parameter]:
        return [p for name in sorted(self.weights) for p in self.weights[name]]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, (a, b) in self.weights.items():
            out[f"{name}.lora_A.weight"] = a.detach()
            out[f"{name}.lora_B.weight"] = b.detach()
        return out

    def load_named_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, (a, b) in self.weights.items():
                a.copy_(tensors[f"{name}.lora_A.weight"])
                b.copy_(tensors[f"{name}.lora_B.weight"])

    def num_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None


@dataclass
class RowGroup:
    """Rows [start, end) of the current batch use `adapter` (None = base model only)."""

    start: int
    end: int
    adapter: LoraAdapter | None


@dataclass
class LoraContext:
    """The row-to-adapter assignment every wrapped layer of one model reads during a pass.

    Groups must tile the batch's first dimension in order: [0, e1), [e1, e2), … [ek, B).
    """

    groups: list[RowGroup] = field(default_factory=list)


class MultiLoraLinear(nn.Module):
    """A frozen base Linear plus the per-row-group LoRA deltas named by `LoraContext`."""

    def __init__(self, base: nn.Linear, name: str, ctx: LoraContext) -> None:
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.in_features = base.in_features
        self.out_features = base.out_features
        self.name = name
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        groups = self.ctx.groups
        present = [self._has(g) for g in groups]
        if not any(present):
            return y
        if len(groups) == 1:
            return y + self._delta(x, groups[0].adapter)
        # Groups tile the batch in order. split() (not per-group slicing) keeps the backward
        # to one concatenation instead of one full-size zero-filled gradient per group.
        xs = x.split([g.end - g.start for g in groups], dim=0)
        deltas = [
            self._delta(x_g, g.adapter)
            if has
            else x_g.new_zeros(*x_g.shape[:-1], self.out_features)
            for x_g, g, has in zip(xs, groups, present, strict=True)
        ]
        return y + torch.cat(deltas, dim=0)

    def _has(self, g: RowGroup) -> bool:
        return g.adapter is not None and self.name in g.adapter.weights

    def _delta(self, x: torch.Tensor, adapter: LoraAdapter | None) -> torch.Tensor:
        assert adapter is not None
        a_rI, b_Or = adapter.weights[self.name]
        # scale the rank-sized intermediate, not the (larger) output
        return F.linear(F.linear(x, a_rI.to(x.dtype)) * adapter.scale, b_Or.to(x.dtype))

    def extra_repr(self) -> str:
        return f"{self.name}: in={self.in_features}, out={self.out_features}"


def inject(model: nn.Module) -> tuple[LoraContext, dict[str, MultiLoraLinear]]:
    """Swap every LoRA-targetable Linear of a causal LM for a MultiLoraLinear, in place."""
    ctx = LoraContext()
    wrapped: dict[str, MultiLoraLinear] = {}
    short_names = set(ATTN_TARGETS + MLP_TARGETS + (UNEMBED_TARGET,))
    targets = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.rsplit(".", 1)[-1] in short_names
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = MultiLoraLinear(module, name, ctx)
        setattr(parent, child, layer)
        wrapped[name] = layer
    for p in model.parameters():
        p.requires_grad_(False)
    return ctx, wrapped


def adapter_shapes(
    wrapped: dict[str, MultiLoraLinear], spec: LoraSpec
) -> dict[str, tuple[int, int]]:
    """(out, in) of each module this spec's flags select."""
    chosen: set[str] = set()
    if spec.train_attn:
        chosen |= set(ATTN_TARGETS)
    if spec.train_mlp:
        chosen |= set(MLP_TARGETS)
    if spec.train_unembed:
        chosen.add(UNEMBED_TARGET)
    return {
        name: (m.out_features, m.in_features)
        for name, m in wrapped.items()
        if name.rsplit(".", 1)[-1] in chosen
    }


def parameters_per_rank(model: nn.Module) -> dict[str, int]:
    """LoRA parameters per unit of rank of each part a run may train ("attn", "mlp",
    "unembed"), for the Linear layers `inject` wraps: a rank-r adapter on a Linear(in, out)
    holds A (r, in) and B (out, r), r·(in + out) parameters. Works on a meta-device model."""
    parts = {"attn": 0, "mlp": 0, "unembed": 0}
    part_of = {name: "attn" for name in ATTN_TARGETS} | {name: "mlp" for name in MLP_TARGETS}
    part_of[UNEMBED_TARGET] = "unembed"
    for name, module in model.named_modules():
        part = part_of.get(name.rsplit(".", 1)[-1])
        if part is not None and isinstance(module, nn.Linear | MultiLoraLinear):
            parts[part] += module.in_features + module.out_features
    return parts


def target_module_names(spec: LoraSpec) -> list[str]:
    names: list[str] = []
    if spec.train_attn:
        names += ATTN_TARGETS
    if spec.train_mlp:
        names += MLP_TARGETS
    if spec.train_unembed:
        names.append(UNEMBED_TARGET)
    return names
