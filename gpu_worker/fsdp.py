"""A frozen base model's weights sharded over a worker group's ranks with FSDP2 (`fully_shard`).

Each rank keeps 1/N of every base weight and all-gathers one unit at a time while it runs:
every decoder layer is a unit, then the decoder itself (embeddings and final norm), then the
unembedding, which the engine calls apart from the decoder. LoRA adapters stay outside the
module tree, replicated on every rank; base weights never get gradients, so nothing is
reduce-scattered.

Every unit's all-gather is a collective, so the ranks must run in lockstep: the same passes,
in the same order, each with the same structure. The engine makes the pass counts agree
(`agree_max`, then `dummy_pass` on a rank that is short), and `shard_model` makes every
backward pass go through every unit: the embeddings' output is made to require a gradient, so
a pass whose adapters train only the unembedding, or a dummy pass with no adapter at all,
gathers in the backward exactly what a pass through fully adapted layers gathers. A rank that
skipped a unit, or ran one twice, would block in the other ranks' collectives until their
timeout, or pair with the wrong one.

This module knows nothing of runs, optimizers or the worker group's messages.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from gpu_worker.batching import autocast_for, lora_groups
from gpu_worker.lora import LoraContext, RowGroup


def mesh_over_group(device: torch.device) -> DeviceMesh:
    """One shard per rank of the default process group (which every rank must have joined)."""
    if not dist.is_initialized():
        raise RuntimeError("sharding a base model needs init_process_group on every rank first")
    if device.type == "cuda" and device.index is not None:
        # fully_shard puts the shards on the current CUDA device, not on the engine's
        torch.cuda.set_device(device)
    return init_device_mesh(device.type, (dist.get_world_size(),))


def shard_model(model: Any, mesh: DeviceMesh, device: torch.device) -> None:
    """Shard `model`'s weights over `mesh`, in place (after LoRA injection), and put what is
    not sharded on `device`.

    The model may sit on the CPU: `fully_shard` moves a unit's weights to the mesh's device
    and replaces each by this rank's shard before the next unit is moved, so the device holds
    at most one whole unit besides its shards (the unembedding, or one decoder layer). Moving
    the whole model first would need a device that holds all of it, which is what sharding is
    for. Buffers and any weight outside the units (rotary frequencies, say) follow after."""
    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(
            "a model whose unembedding is tied to its embeddings cannot be sharded by unit "
            "(the engine calls the two apart); serve it with a replicated base"
        )
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"{type(decoder).__name__} has no `layers` to shard one by one")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(decoder, mesh=mesh)
    fully_shard(model.get_output_embeddings(), mesh=mesh)
    model.get_input_embeddings().register_forward_hook(_through_every_unit)
    _move_unsharded(model, device)


def _move_unsharded(model: Any, device: torch.device) -> None:
    """Move the parameters and buffers that are not sharded to `device` (the sharded ones
    are there already; `Module.to` would visit those too)."""
    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                if not isinstance(p, DTensor) and p.device != device:
                    p.data = p.data.to(device)
            for name, b in module.named_buffers(recurse=False):
                if b.device != device:
                    module._buffers[name] = b.to(device)


def _through_every_unit(module: Any, args: Any, output: torch.Tensor) -> torch.Tensor | None:
    """In a backward pass, the embeddings' output requires a gradient, so the backward runs
    (and all-gathers) through every unit whatever the adapters in the pass train."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.detach().requires_grad_()
    return None


def local_bytes(model: Any) -> int:
    """Bytes of the model's weights held on this rank: its shards of the sharded ones."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a sharded weight is all-gathered (every rank must ask for it, in the same
    order), any other tensor is returned as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def agree_max(counts: list[int], device: torch.device) -> list[int]:
    """Each count's maximum over the ranks (one small all-reduce on the default group)."""
    t = torch.tensor(counts, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(c) for c in t.tolist()]


def dummy_pass(
    model: Any,
    ctx: LoraContext,
    *,
    backward: bool,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> None:
    """A pass that runs the collectives of a real one and changes nothing: one token through
    the decoder and the unembedding with no adapter, and (when `backward`) a backward of zero
    times its logits, which reaches no adapter."""
    tokens = torch.zeros((1, 1), dtype=torch.long, device=device)
    with torch.set_grad_enabled(backward), autocast_for(device, autocast_dtype):
        with lora_groups(ctx, [RowGroup(0, 1, None)]):
            hidden_TC = model.get_decoder()(input_ids=tokens).last_hidden_state[0]
            logits_TV = model.get_output_embeddings()(hidden_TC)
        if backward:
            (logits_TV.float().sum() * 0.0).backward()
