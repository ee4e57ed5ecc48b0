"""One multi-LoRA forward pass over the datums of several runs: target log-probabilities.

Sequences of all segments (one segment = one run's op) are right-padded into one batch:
with causal attention, padding at the end never influences real positions, so no attention
mask is needed and each row computes exactly what it would alone. Rows of a segment are
contiguous, which is what `LoraContext` row groups describe. The unembedding runs only on
real tokens (padding never reaches the B·T·V logits), again grouped per segment.

This module knows nothing of losses, optimizers or validation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.lora import LoraAdapter, LoraContext, RowGroup
from gpu_worker.validation import CheckedDatum


@dataclass
class Segment:
    adapter: LoraAdapter | None
    datums: list[CheckedDatum]


@dataclass
class SegmentLogprobs:
    logp: torch.Tensor  # (N,) or (N, K): flattened over the segment's datums
    inputs: dict[str, torch.Tensor]  # loss_fn_inputs flattened the same way
    datum_N: torch.Tensor  # datum index of each token
    lengths: list[int]


def autocast_for(
    device: torch.device, dtype: torch.dtype | None
) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@contextlib.contextmanager
def lora_groups(ctx: LoraContext, groups: list[RowGroup]) -> Iterator[None]:
    ctx.groups = groups
    try:
        yield
    finally:
        ctx.groups = []


def forward_logprobs(
    model: Any,
    ctx: LoraContext,
    segments: list[Segment],
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> list[SegmentLogprobs]:
    """Target logprobs of every segment; differentiable when grad mode is on."""
    rows = [d for seg in segments for d in seg.datums]
    lengths = [d.tokens.size for d in rows]
    B, T = len(rows), max(lengths)
    tokens_BT = np.zeros((B, T), dtype=np.int64)
    for b, d in enumerate(rows):
        tokens_BT[b, : d.tokens.size] = d.tokens
    tokens = torch.from_numpy(tokens_BT).to(device)

    row_groups, tok_groups = [], []
    row, tok = 0, 0
    for seg in segments:
        n_tok = sum(d.tokens.size for d in seg.datums)
        row_groups.append(RowGroup(row, row + len(seg.datums), seg.adapter))
        tok_groups.append(RowGroup(tok, tok + n_tok, seg.adapter))
        row += len(seg.datums)
        tok += n_tok

    decoder = model.get_decoder()
    with autocast_for(device, autocast_dtype):
        with lora_groups(ctx, row_groups):
            hidden_BTC = decoder(input_ids=tokens).last_hidden_state
        lengths_B = torch.tensor(lengths, device=device)
        mask_BT = torch.arange(T, device=device)[None, :] < lengths_B[:, None]
        hidden_NC = hidden_BTC[mask_BT]
        with lora_groups(ctx, tok_groups):
            logits_NV = model.get_output_embeddings()(hidden_NC)
    logits_NV = logits_NV.float()

    out: list[SegmentLogprobs] = []
    for seg, g in zip(segments, tok_groups, strict=True):
        logits = logits_NV[g.start : g.end]
        inputs = {
            k: torch.from_numpy(np.concatenate([d.inputs[k] for d in seg.datums])).to(device)
            for k in seg.datums[0].inputs
        }
        target = inputs["target_tokens"]
        if target.dim() == 1:
            logp = -F.cross_entropy(logits, target, reduction="none")
        else:
            logp = torch.log_softmax(logits, dim=-1).gather(1, target)
        seg_lengths = [d.tokens.size for d in seg.datums]
        datum_N = torch.repeat_interleave(
            torch.arange(len(seg_lengths), device=device), torch.tensor(seg_lengths, device=device)
        )
        out.append(SegmentLogprobs(logp=logp, inputs=inputs, datum_N=datum_N, lengths=seg_lengths))
    return out
