"""Batched decoding with a KV cache, across requests and adapters, plus prompt log-probabilities.

A `Sampler` runs one decode loop for one base model and accepts jobs between steps
(continuous batching): each step prefills the jobs added since the last one (prompts
left-padded, one prefill per request, the cache rows then repeated for `num_samples`), merges
them into the running batch, chooses one token for every row on the device
(`token_choice.choose`: per-row temperature, top-k, top-p, counter-based seeded noise, so a
row's tokens do not depend on the rest of the batch) and feeds the chosen tokens. Finished rows
leave the batch and the cache. Only the chosen ids, their logprobs and the stop flags reach the
CPU, once per step; stop strings are checked on the newly decoded text only.

Reported logprobs are the model's own log-probabilities of the chosen tokens (before
temperature, top-k and top-p), i.e. what `compute_logprobs` returns for the same sequence. The
stop token or the token completing a stop string is kept in the output. Prompt logprobs come
from the prefill pass; full-length logits are computed only for jobs that ask for them.

This module knows nothing of training, optimizers or validation.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.batching import autocast_for, lora_groups
from gpu_worker.lora import LoraAdapter, LoraContext, RowGroup
from gpu_worker.protocol import SampledSequence, SamplingParams, StopReason
from gpu_worker.token_choice import RowParams, choose, row_key

TOPK_EMPTY_ID, TOPK_EMPTY_LOGPROB = 0, -99999.0


@dataclass
class Job:
    """One request as the decode loop sees it; the loop fills the fields after `stop_strings`.

    `adapter` may be replaced between steps (by a frozen copy of the same weights): rows are
    grouped by the adapter their job names at each step. `indices` are the request's sample
    indices this job holds, when it holds a share of them (a worker group splits a request's
    samples over its ranks): sample i's noise is keyed by `indices[i]`, so every share samples
    what the whole request would. None means all of them, 0 to num_samples - 1."""

    prompt: list[int]
    params: SamplingParams
    num_samples: int
    adapter: LoraAdapter | None
    stop_ids: set[int]
    stop_strings: list[str]
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    indices: list[int] | None = None
    sequences: list[SampledSequence] = field(default_factory=list)  # by sample index, once all end
    finished: dict[int, SampledSequence] = field(default_factory=dict)  # by sample index
    prompt_lp: np.ndarray | None = None  # (P,) float32, NaN at 0
    prompt_top: tuple[np.ndarray, np.ndarray] | None = None  # ids (P, k), logprobs (P, k)


class StopText:
    """Incremental detokenization of one row: finds stop strings in the new text only."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.keep = max(len(s) for s in stops) - 1
        self.tail = ""  # the last `keep` characters decoded so far
        self.start = 0  # first token of the window still decoded (its text is `tail`'s end)
        self.read = 0  # tokens before this were already emitted as text

    def push(self, tokens: list[int]) -> bool:
        """Decode what `tokens[-1]` adds to the text; True when a stop string is now complete."""
        before = self.tokenizer.decode(tokens[self.start : self.read])
        window = self.tokenizer.decode(tokens[self.start :])
        if len(window) <= len(before) or window.endswith("\ufffd"):
            return False  # an incomplete character: wait for the next token
        text = self.tail + window[len(before) :]
        self.start, self.read = self.read, len(tokens)
        self.tail = text[len(text) - self.keep :] if self.keep else ""
        return any(s in text for s in self.stops)


@dataclass
class _Row:
    job: Job
    index: int  # the sample's index within its job (its noise: see `Job.indices`)
    stop_text: StopText | None
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


def _groups(adapters: list[LoraAdapter | None]) -> list[RowGroup]:
    """Row groups over consecutive rows that share an adapter."""
    groups: list[RowGroup] = []
    for r, adapter in enumerate(adapters):
        if groups and groups[-1].adapter is adapter:
            groups[-1].end = r + 1
        else:
            groups.append(RowGroup(r, r + 1, adapter))
    return groups


def _by_adapter(adapters: list[LoraAdapter | None]) -> list[int]:
    """A stable order that puts rows of one adapter side by side, so each LoRA layer runs one
    matmul per adapter rather than one per run of alternating rows."""
    first: dict[int, int] = {}
    group = [first.setdefault(id(a), len(first)) for a in adapters]
    return sorted(range(len(group)), key=group.__getitem__)


def _full_attention(cache: Any) -> bool:
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _pad_left(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return x
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def prompt_scores_of(
    logits_PV: torch.Tensor, prompt: list[int], topk: int
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray] | None]:
    """logprob of each prompt token given the ones before (NaN at 0), and optional top-k."""
    logp_PV = torch.log_softmax(logits_PV[:-1].float(), dim=-1)  # row i predicts prompt[i + 1]
    P = len(prompt)
    lp = np.full(P, np.nan, dtype=np.float32)
    if P > 1:
        target = torch.tensor(prompt[1:], device=logits_PV.device)
        lp[1:] = logp_PV.gather(1, target[:, None])[:, 0].cpu().numpy()
    top: tuple[np.ndarray, np.ndarray] | None = None
    if topk > 0:
        k = min(topk, logits_PV.shape[-1])
        ids = np.full((P, topk), TOPK_EMPTY_ID, dtype=np.int64)
        vals = np.full((P, topk), TOPK_EMPTY_LOGPROB, dtype=np.float32)
        if P > 1:
            best = torch.topk(logp_PV, k, dim=-1)
            ids[1:, :k] = best.indices.cpu().numpy()
            vals[1:, :k] = best.values.cpu().numpy()
        top = (ids, vals)
    return lp, top


class Sampler:
    """One decode loop over one base model; `add` jobs at any time, `step` until `idle`."""

    def __init__(
        self,
        model: Any,
        ctx: LoraContext,
        tokenizer: Any,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        self.model, self.ctx, self.tokenizer = model, ctx, tokenizer
        self.device, self.autocast_dtype = device, autocast_dtype
        self._pending: list[Job] = []
        self._rows: list[_Row] = []
        # per active row, on the device (None while no row is active):
        self._cache: Any = None
        self._mask_AL: torch.Tensor | None = None  # attention mask over the cache
        self._pos_A: torch.Tensor | None = None  # position of the next token
        self._next_AV: torch.Tensor | None = None  # float32 logits of the next token
        self._params: RowParams | None = None
        self._stop_AS: torch.Tensor | None = None  # stop token ids, -1 padded

    def add(self, job: Job) -> None:
        """Queue a job; it is prefilled at the next `step` (for a model whose cache layers are
        not all full-attention, at the first step the loop is idle)."""
        self._pending.append(job)

    def drop(self, jobs: Collection[Job]) -> None:
        """Remove unfinished `jobs`, queued or running, freeing their cache rows."""
        gone = {id(job) for job in jobs}
        self._pending = [job for job in self._pending if id(job) not in gone]
        keep = [a for a, row in enumerate(self._rows) if id(row.job) not in gone]
        if len(keep) < len(self._rows):
            self._select(keep)

    def progress(self, job: Job) -> list[list[int]]:
        """Tokens chosen so far for each of `job`'s samples, by sample index (copies)."""
        tokens: list[list[int]] = [[] for _ in range(job.num_samples)]
        for i, seq in job.finished.items():
            tokens[i] = list(seq.tokens)
        for row in self._rows:
            if row.job is job:
                tokens[row.index] = list(row.tokens)
        return tokens

    @property
    def idle(self) -> bool:
        return not self._pending and not self._rows

    @torch.no_grad()
    def step(self) -> list[Job]:
        """Prefill new jobs, choose one token per row, feed them; returns the jobs completed."""
        # a sliding-window cache cannot be left-padded to merge, so those loops admit when idle
        if self._pending and (not self._rows or _full_attention(self._cache)):
            jobs, self._pending = self._pending, []
            self._admit(jobs)
        if not self._rows:
            return []
        assert self._next_AV is not None and self._params is not None
        assert self._stop_AS is not None
        logits_AV = self._next_AV
        step_A = torch.tensor([len(r.tokens) for r in self._rows], device=self.device)
        token_A = choose(logits_AV, self._params, step_A)
        logp_A = torch.log_softmax(logits_AV, dim=-1).gather(1, token_A[:, None])[:, 0]
        stop_A = (token_A[:, None] == self._stop_AS).any(dim=1)
        # one transfer per step: ids (exact in float64), logprobs, stop flags
        back_3A = torch.stack([token_A.double(), logp_A.double(), stop_A.double()]).cpu()
        tokens, logprobs, stops = back_3A.tolist()

        keep: list[int] = []
        completed: list[Job] = []
        for a, row in enumerate(self._rows):
            tok = int(tokens[a])
            row.tokens.append(tok)
            row.logprobs.append(logprobs[a])
            stop = stops[a] > 0 or (row.stop_text is not None and row.stop_text.push(row.tokens))
            job = row.job
            if stop or len(row.tokens) >= job.params.max_tokens:
                reason: StopReason = "stop" if stop else "length"
                job.finished[row.index] = SampledSequence(row.tokens, row.logprobs, reason)
                if len(job.finished) == job.num_samples:
                    job.sequences = [job.finished[i] for i in range(job.num_samples)]
                    completed.append(job)
            else:
                keep.append(a)
        self._next_AV = None  # used up
        if len(keep) < len(self._rows):
            self._select(keep)
        if self._rows:
            self._feed(token_A[torch.tensor(keep, device=self.device)])
        return completed

    # --- the batch ----------------------------------------------------------------------

    def _admit(self, jobs: list[Job]) -> None:
        """Prefill `jobs` and append their rows (num_samples each) to the running batch."""
        from transformers import DynamicCache

        jobs = [jobs[j] for j in _by_adapter([job.adapter for job in jobs])]
        R, P = len(jobs), max(len(j.prompt) for j in jobs)
        tokens_RP = torch.zeros((R, P), dtype=torch.long)
        mask_RP = torch.zeros((R, P), dtype=torch.long)
        for r, job in enumerate(jobs):
            tokens_RP[r, P - len(job.prompt) :] = torch.tensor(job.prompt)
            mask_RP[r, P - len(job.prompt) :] = 1
        pos_RP = (mask_RP.cumsum(1) - 1).clamp(min=0)
        mask_RP = mask_RP.to(self.device)
        cache = DynamicCache(config=self.model.config)
        head = self.model.get_output_embeddings()
        groups = _groups([j.adapter for j in jobs])
        with autocast_for(self.device, self.autocast_dtype):
            with lora_groups(self.ctx, groups):
                hidden_RPC = self.model.get_decoder()(
                    input_ids=tokens_RP.to(self.device),
                    attention_mask=mask_RP,
                    position_ids=pos_RP.to(self.device),
                    cache=cache,
                    use_cache=True,
                ).last_hidden_state
                last_RV = head(hidden_RPC[:, -1]).float()
            for r, job in enumerate(jobs):
                if job.prompt_logprobs or job.topk_prompt_logprobs > 0:
                    n = len(job.prompt)
                    with lora_groups(self.ctx, [RowGroup(0, n, job.adapter)]):
                        logits_PV = head(hidden_RPC[r, P - n :])
                    job.prompt_lp, job.prompt_top = prompt_scores_of(
                        logits_PV, job.prompt, job.topk_prompt_logprobs
                    )

        rows: list[_Row] = []
        expand: list[int] = []
        keys: list[tuple[int, int]] = []
        for r, job in enumerate(jobs):
            seed = job.params.seed if job.params.seed is not None else secrets.randbits(62)
            for i in range(job.num_samples):
                stop_text = StopText(self.tokenizer, job.stop_strings) if job.stop_strings else None
                rows.append(_Row(job, i, stop_text))
                expand.append(r)
                keys.append(row_key(seed, i if job.indices is None else job.indices[i]))
        index_B = torch.tensor(expand, device=self.device)
        cache.batch_select_indices(index_B)
        mask_BP = mask_RP[index_B]
        stop_ids = [sorted(row.job.stop_ids) for row in rows]
        width = max(1, max(len(s) for s in stop_ids))
        stop_BS = torch.tensor([s + [-1] * (width - len(s)) for s in stop_ids], device=self.device)
        new = (
            torch.tensor([len(row.job.prompt) for row in rows], device=self.device),
            last_RV[index_B],
            RowParams.of([row.job.params for row in rows], keys, self.device),
        )
        if not self._rows:
            self._cache, self._mask_AL = cache, mask_BP
            self._pos_A, self._next_AV, self._params = new
            self._stop_AS = stop_BS
        else:
            self._merge(cache, mask_BP, stop_BS, *new)
        self._rows += rows
        order = _by_adapter([row.job.adapter for row in self._rows])
        if order != list(range(len(order))):
            self._select(order)

    def _merge(
        self,
        cache: Any,
        mask_BP: torch.Tensor,
        stop_BS: torch.Tensor,
        pos_B: torch.Tensor,
        next_BV: torch.Tensor,
        params: RowParams,
    ) -> None:
        """Append new rows to the running batch, left-padding the shorter cache."""
        assert self._mask_AL is not None and self._stop_AS is not None
        assert self._pos_A is not None and self._next_AV is not None
        assert self._params is not None
        L, P = self._mask_AL.shape[1], mask_BP.shape[1]
        T = max(L, P)
        if not (_full_attention(self._cache) and _full_attention(cache)):
            raise NotImplementedError(
                "adding jobs to a running decode loop needs full-attention cache layers; "
                "add this model's jobs while the loop is idle"
            )
        for old, new in zip(self._cache.layers, cache.layers, strict=True):
            for name in ("keys", "values"):
                o, n = getattr(old, name), getattr(new, name)
                setattr(old, name, torch.cat([_pad_left(o, T - L, 2), _pad_left(n, T - P, 2)]))
        self._mask_AL = torch.cat(
            [_pad_left(self._mask_AL, T - L, 1), _pad_left(mask_BP, T - P, 1)]
        )
        S = max(self._stop_AS.shape[1], stop_BS.shape[1])
        self._stop_AS = torch.cat(
            [
                F.pad(self._stop_AS, (0, S - self._stop_AS.shape[1]), value=-1),
                F.pad(stop_BS, (0, S - stop_BS.shape[1]), value=-1),
            ]
        )
        self._pos_A = torch.cat([self._pos_A, pos_B])
        self._next_AV = torch.cat([self._next_AV, next_BV])
        self._params = self._params.cat(params)

    def _select(self, keep: list[int]) -> None:
        """Keep the rows at `keep`, in that order: their cache rows, masks and parameters."""
        assert self._mask_AL is not None and self._params is not None
        assert self._stop_AS is not None and self._pos_A is not None
        self._rows = [self._rows[a] for a in keep]
        if not keep:
            self._cache = self._mask_AL = self._pos_A = self._next_AV = None
            self._params = self._stop_AS = None
            return
        index_A = torch.tensor(keep, device=self.device)
        self._cache.batch_select_indices(index_A)
        self._mask_AL = self._mask_AL[index_A]
        self._pos_A = self._pos_A[index_A]
        self._stop_AS = self._stop_AS[index_A]
        self._params = self._params.select(index_A, [r.job.params for r in self._rows])
        if self._next_AV is not None:
            self._next_AV = self._next_AV[index_A]
        # columns that are padding for every remaining row are dropped from the cache (a
        # sliding-window layer keeps fewer columns than the mask: such caches stay as they are)
        first = int(self._mask_AL.any(dim=0).int().argmax())
        if first > 0 and _full_attention(self._cache):
            self._mask_AL = self._mask_AL[:, first:]
            for layer in self._cache.layers:
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def _feed(self, token_A: torch.Tensor) -> None:
        """One forward step of the chosen tokens; sets the next logits."""
        assert self._mask_AL is not None and self._pos_A is not None
        self._mask_AL = torch.cat([self._mask_AL, torch.ones_like(self._mask_AL[:, :1])], dim=1)
        groups = _groups([r.job.adapter for r in self._rows])
        with autocast_for(self.device, self.autocast_dtype), lora_groups(self.ctx, groups):
            out = self.model(
                input_ids=token_A[:, None],
                attention_mask=self._mask_AL,
                position_ids=self._pos_A[:, None],
                cache=self._cache,
                use_cache=True,
                logits_to_keep=1,
            )
        self._next_AV = out.logits[:, -1].float()
        self._pos_A = self._pos_A + 1
