"""Choosing the next token of every active decode row at once, on the device.

Each row has its own temperature, top-k, top-p and seed. Randomness is counter-based: the
Gumbel noise of (row key, step, token id) is an integer hash computed on the device, so a row's
choice depends only on its own logits, key and step — never on which rows share the batch or
in which order — and no per-row `torch.Generator` forces a Python loop. Gumbel-max over the
tempered, top-k/top-p-masked logits draws exactly from the renormalised distribution that
`torch.multinomial` would. Temperature 0 is greedy: the argmax of the raw logits.

The hash works on 32-bit values held in int64 tensors with multipliers below 2³¹, so no
product overflows and CPU and CUDA compute the same bits.

This module knows nothing of models, caches or stop conditions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.protocol import SamplingParams

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """An avalanche hash of int64 tensors holding values in [0, 2³²)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_key(seed: int, sample_index: int) -> tuple[int, int]:
    """Two 32-bit words that name the random stream of one sample of one request."""
    k = _splitmix64((seed * 1_000_003 + sample_index) & _MASK64)
    return k & _MASK32, k >> 32


@dataclass
class RowParams:
    """The sampling parameters of the active rows, one entry per row, on the device."""

    temperature_A: torch.Tensor  # float32; 0 = greedy
    top_k_A: torch.Tensor  # int64; ≤ 0 = no limit
    top_p_A: torch.Tensor  # float32; 1 = no limit
    key_A2: torch.Tensor  # int64 words of `row_key`
    any_sampled: bool  # some row has temperature > 0
    any_filtered: bool  # some row has a top-k or top-p limit

    @staticmethod
    def of(
        params: list[SamplingParams], keys: list[tuple[int, int]], device: torch.device
    ) -> RowParams:
        return RowParams(
            temperature_A=torch.tensor([p.temperature for p in params], device=device),
            top_k_A=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            top_p_A=torch.tensor([p.top_p for p in params], device=device),
            key_A2=torch.tensor(keys, dtype=torch.long, device=device).reshape(-1, 2),
            any_sampled=any(p.temperature > 0 for p in params),
            any_filtered=any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params),
        )

    def select(self, index_A: torch.Tensor, params: list[SamplingParams]) -> RowParams:
        """The rows at `index_A`; `params` are those rows' parameters (for the flags)."""
        return RowParams(
            self.temperature_A[index_A],
            self.top_k_A[index_A],
            self.top_p_A[index_A],
            self.key_A2[index_A],
            any(p.temperature > 0 for p in params),
            any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params),
        )

    def cat(self, other: RowParams) -> RowParams:
        return RowParams(
            torch.cat([self.temperature_A, other.temperature_A]),
            torch.cat([self.top_k_A, other.top_k_A]),
            torch.cat([self.top_p_A, other.top_p_A]),
            torch.cat([self.key_A2, other.key_A2]),
            self.any_sampled or other.any_sampled,
            self.any_filtered or other.any_filtered,
        )


def gumbel_noise(key_A2: torch.Tensor, step_A: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise (A, V), a pure function of each row's key, its step and token id."""
    row_A = _mix32(key_A2[:, 0] ^ _mix32(key_A2[:, 1] ^ _mix32(step_A & _MASK32)))
    token_V = _mix32(torch.arange(vocab, device=key_A2.device, dtype=torch.long) + 0x5BD1E995)
    bits_AV = _mix32(row_A[:, None] ^ token_V[None, :]) >> 8  # 24 uniform bits
    u_AV = (bits_AV.float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u_AV))


def _filter(scaled_AV: torch.Tensor, top_k_A: torch.Tensor, top_p_A: torch.Tensor) -> torch.Tensor:
    """-inf outside each row's top-k, then outside the smallest prefix whose mass reaches top-p."""
    V = scaled_AV.shape[-1]
    sorted_AV, order_AV = torch.sort(scaled_AV, dim=-1, descending=True)
    k_A = torch.where((top_k_A > 0) & (top_k_A < V), top_k_A, V)
    kth_A1 = sorted_AV.gather(1, (k_A - 1)[:, None])
    keep_AV = sorted_AV >= kth_A1  # ties with the k-th value stay
    probs_AV = torch.softmax(sorted_AV.masked_fill(~keep_AV, float("-inf")), dim=-1)
    # mass strictly before each token; the first token always stays
    before_AV = torch.cumsum(probs_AV, dim=-1) - probs_AV
    limit_A = torch.where(top_p_A < 1, top_p_A, float("inf"))
    keep_AV &= before_AV < limit_A[:, None]
    keep_AV = torch.zeros_like(keep_AV).scatter(1, order_AV, keep_AV)
    return scaled_AV.masked_fill(~keep_AV, float("-inf"))


def choose(logits_AV: torch.Tensor, rows: RowParams, step_A: torch.Tensor) -> torch.Tensor:
    """The next token id of every row (A,), given its float32 logits and its step."""
    greedy_A = logits_AV.argmax(dim=-1)
    if not rows.any_sampled:
        return greedy_A
    is_greedy_A = rows.temperature_A == 0
    temperature_A = torch.where(is_greedy_A, 1.0, rows.temperature_A)
    scaled_AV = logits_AV / temperature_A[:, None]
    if rows.any_filtered:
        scaled_AV = _filter(scaled_AV, rows.top_k_A, rows.top_p_A)
    noise_AV = gumbel_noise(rows.key_A2, step_A, logits_AV.shape[-1])
    sampled_A = (scaled_AV + noise_AV).argmax(dim=-1)
    return torch.where(is_greedy_A, greedy_A, sampled_A)
