"""Batched sampling with a KV cache, across requests and adapters, plus prompt log-probabilities.

All requests of one call share one decode loop: prompts are left-padded and prefilled once per
request, the cache rows are repeated for `num_samples`, and each row samples with its own
seeded generator, so a row's tokens do not depend on what else is in the batch. Finished rows
leave the batch. Reported logprobs are the model's own log-probabilities of the chosen tokens
(before temperature, top-k and top-p), i.e. what `compute_logprobs` returns for the same
sequence. The stop token or the token completing a stop string is kept in the output.

This module knows nothing of training, optimizers or validation.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_worker.batching import autocast_for, lora_groups
from gpu_worker.lora import LoraAdapter, LoraContext, RowGroup
from gpu_worker.protocol import SampledSequence, SamplingParams

TOPK_EMPTY_ID, TOPK_EMPTY_LOGPROB = 0, -99999.0


@dataclass
class Job:
    """One request as the decode loop sees it."""

    prompt: list[int]
    params: SamplingParams
    num_samples: int
    adapter: LoraAdapter | None
    stop_ids: set[int]
    stop_strings: list[str]
    sequences: list[SampledSequence] = field(default_factory=list)


@dataclass
class _Row:
    job: int
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


def resolve_stop(
    stop: list[str] | list[int] | str | None, eos_ids: list[int]
) -> tuple[set[int], list[str]]:
    if stop is None:
        return set(eos_ids), []
    if isinstance(stop, str):
        return set(), [stop]
    ids = {int(s) for s in stop if not isinstance(s, str)}
    strings = [s for s in stop if isinstance(s, str)]
    return ids, strings


def _groups(job_of_row: list[int], jobs: list[Job]) -> list[RowGroup]:
    groups: list[RowGroup] = []
    for r, j in enumerate(job_of_row):
        if groups and job_of_row[r - 1] == j:
            groups[-1].end = r + 1
        else:
            groups.append(RowGroup(r, r + 1, jobs[j].adapter))
    return groups


def _choose(logits_V: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    if params.temperature == 0:
        return int(torch.argmax(logits_V))
    scaled = logits_V / params.temperature
    if params.top_k > 0 and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.no_grad()
def sample_jobs(
    model: Any,
    ctx: LoraContext,
    tokenizer: object,
    jobs: list[Job],
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> int:
    """Fill each job's `sequences`; returns the number of sampled tokens."""
    from transformers import DynamicCache

    R = len(jobs)
    P = max(len(j.prompt) for j in jobs)
    tokens_RP = torch.zeros((R, P), dtype=torch.long)
    mask_RP = torch.zeros((R, P), dtype=torch.long)
    for r, job in enumerate(jobs):
        tokens_RP[r, P - len(job.prompt) :] = torch.tensor(job.prompt)
        mask_RP[r, P - len(job.prompt) :] = 1
    pos_RP = (mask_RP.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    with autocast_for(device, autocast_dtype), lora_groups(ctx, _groups(list(range(R)), jobs)):
        out = model(
            input_ids=tokens_RP.to(device),
            attention_mask=mask_RP.to(device),
            position_ids=pos_RP.to(device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    last_RV = out.logits[:, -1].float().cpu()

    rows: list[_Row] = []
    expand: list[int] = []
    for j, job in enumerate(jobs):
        base_seed = job.params.seed if job.params.seed is not None else secrets.randbits(62)
        for i in range(job.num_samples):
            gen = torch.Generator().manual_seed((base_seed * 1_000_003 + i) % (1 << 63))
            rows.append(_Row(job=j, generator=gen))
            expand.append(j)
    index = torch.tensor(expand, device=device)
    cache.batch_select_indices(index)
    mask = mask_RP.to(device)[index]
    next_pos = torch.tensor([len(jobs[j].prompt) for j in expand], device=device)
    last = last_RV[torch.tensor(expand)]
    sampled = 0

    while rows:
        keep: list[int] = []
        fed: list[int] = []
        logp_AV = torch.log_softmax(last, dim=-1)
        for a, row in enumerate(rows):
            job = jobs[row.job]
            tok = _choose(last[a], job.params, row.generator)
            row.tokens.append(tok)
            row.logprobs.append(float(logp_AV[a, tok]))
            sampled += 1
            stop = tok in job.stop_ids or (
                bool(job.stop_strings)
                and any(s in tokenizer.decode(row.tokens) for s in job.stop_strings)  # type: ignore[attr-defined]
            )
            if stop or len(row.tokens) >= job.params.max_tokens:
                job.sequences.append(
                    SampledSequence(
                        tokens=row.tokens,
                        logprobs=row.logprobs,
                        stop_reason="stop" if stop else "length",
                    )
                )
            else:
                keep.append(a)
                fed.append(tok)
        if not keep:
            break
        if len(keep) < len(rows):
            keep_t = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep_t)
            mask, next_pos = mask[keep_t], next_pos[keep_t]
            rows = [rows[a] for a in keep]
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step_tokens = torch.tensor(fed, device=device)[:, None]
        groups = _groups([row.job for row in rows], jobs)
        with autocast_for(device, autocast_dtype), lora_groups(ctx, groups):
            out = model(
                input_ids=step_tokens,
                attention_mask=mask,
                position_ids=next_pos[:, None],
                cache=cache,
                use_cache=True,
            )
        last = out.logits[:, -1].float().cpu()
        next_pos = next_pos + 1
    return sampled


@torch.no_grad()
def prompt_scores(
    model: Any,
    ctx: LoraContext,
    adapter: LoraAdapter | None,
    prompt: list[int],
    topk: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """logprob of each prompt token given the ones before (NaN at 0), and optional top-k."""
    tokens = torch.tensor([prompt], device=device)
    with autocast_for(device, autocast_dtype), lora_groups(ctx, [RowGroup(0, 1, adapter)]):
        logits_PV = model(input_ids=tokens).logits[0].float()
    logp_PV = torch.log_softmax(logits_PV[:-1], dim=-1)  # row i predicts prompt[i + 1]
    P = len(prompt)
    lp = np.full(P, np.nan, dtype=np.float32)
    if P > 1:
        target = tokens[0, 1:]
        lp[1:] = logp_PV.gather(1, target[:, None])[:, 0].cpu().numpy()
    top: tuple[np.ndarray, np.ndarray] | None = None
    if topk > 0:
        k = min(topk, logp_PV.shape[-1])
        ids = np.full((P, topk), TOPK_EMPTY_ID, dtype=np.int64)
        vals = np.full((P, topk), TOPK_EMPTY_LOGPROB, dtype=np.float32)
        if P > 1:
            best = torch.topk(logp_PV, k, dim=-1)
            ids[1:, :k] = best.indices.cpu().numpy()
            vals[1:, :k] = best.values.cpu().numpy()
        top = (ids, vals)
    return lp, top
