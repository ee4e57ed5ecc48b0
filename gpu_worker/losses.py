"""The Tinker loss functions over one op's target log-probabilities.

Every loss is a sum over tokens and datums (never a mean), computed from `logp_N` — the
current policy's log-probability of each target token, flattened over the op's datums in
order — and the op's loss_fn_inputs flattened the same way. `datum_N` names each token's
datum so sequence-level terms (GSPO's ratio) can be taken per datum.

Formulas (tinker-wire §7; `r = exp(logp − q)`, `q` = sampler logprobs, `A` = advantages):
  cross_entropy        −Σ w · logp                      (targets (N,) or top-K (N, K))
  importance_sampling  −Σ r · A
  ppo                  −Σ min(r·A, clip(r, lo, hi)·A)
  cispo                −Σ sg(clip(r, lo, hi)) · logp · A
  dro                  −Σ (logp·A − ½·β·(logp − q)²)
  gspo                 GSPO-token: s = exp(mean over masked tokens of (sg(logp) − q)) per datum,
                       s_t = sg(s)·exp(logp − sg(logp)); −Σ min(s_t·A, clip(s_t, lo, hi)·A)
`lo`/`hi` are loss_fn_config's thresholds, or for a datum that sends `clip_low_threshold` /
`clip_high_threshold` in its loss_fn_inputs, those values (validation spreads them to one per
token). A gspo datum without `sequence_ratio_mask` uses its positions with nonzero advantages
(filled in by validation).
`stable_reinforce` needs per-sequence information recorded by the sampler (the public docs
do not define its objective beyond that), so validation rejects it before it gets here.

This module knows nothing of models, adapters or batching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
# Optional loss_fn_inputs: per-datum or per-token clip thresholds for the clipped losses.
LOSS_OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    "ppo": CLIP_KEYS,
    "cispo": CLIP_KEYS,
    "gspo": CLIP_KEYS,
}
CLIP_DEFAULTS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": dict(CLIP_DEFAULTS),
    "cispo": dict(CLIP_DEFAULTS),
    "dro": {},
    "gspo": dict(CLIP_DEFAULTS),
}
LOSS_CONFIG_REQUIRED: dict[str, tuple[str, ...]] = {"dro": ("beta",)}


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    elementwise_N: torch.Tensor  # per-token loss, detached (N,) (summed over K for top-K)
    metrics: dict[str, float]


LossFn = Callable[
    [torch.Tensor, dict[str, torch.Tensor], torch.Tensor, int, dict[str, float]], LossOutput
]


def _finish(elementwise: torch.Tensor, extra: dict[str, float] | None = None) -> LossOutput:
    loss = elementwise.sum()
    per_token = elementwise.detach()
    if per_token.dim() == 2:
        per_token = per_token.sum(dim=1)
    metrics = {"loss:sum": float(loss.detach())}
    metrics.update(extra or {})
    return LossOutput(loss=loss, elementwise_N=per_token, metrics=metrics)


def cross_entropy(
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    datum_N: torch.Tensor,
    num_datums: int,
    config: dict[str, float],
) -> LossOutput:
    return _finish(-inputs["weights"] * logp)


def importance_sampling(
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    datum_N: torch.Tensor,
    num_datums: int,
    config: dict[str, float],
) -> LossOutput:
    ratio = torch.exp(logp - inputs["logprobs"])
    return _finish(-ratio * inputs["advantages"])


Threshold = float | torch.Tensor


def _thresholds(
    inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> tuple[Threshold, Threshold]:
    """Per-token thresholds where the datums sent them, else loss_fn_config's."""
    lo = inputs.get("clip_low_threshold")
    hi = inputs.get("clip_high_threshold")
    return (
        config["clip_low_threshold"] if lo is None else lo,
        config["clip_high_threshold"] if hi is None else hi,
    )


def _clamp(ratio: torch.Tensor, lo: Threshold, hi: Threshold) -> torch.Tensor:
    if isinstance(lo, torch.Tensor) or isinstance(hi, torch.Tensor):
        lo_t = torch.as_tensor(lo, dtype=ratio.dtype, device=ratio.device)
        hi_t = torch.as_tensor(hi, dtype=ratio.dtype, device=ratio.device)
        return torch.minimum(torch.maximum(ratio, lo_t), hi_t)
    return torch.clamp(ratio, lo, hi)


def _clipped(
    ratio: torch.Tensor, adv: torch.Tensor, lo: Threshold, hi: Threshold
) -> tuple[torch.Tensor, dict[str, float]]:
    unclipped = ratio * adv
    clipped = _clamp(ratio, lo, hi) * adv
    objective = torch.minimum(unclipped, clipped)
    frac = float(((clipped < unclipped) & (adv != 0)).sum())
    return -objective, {"clipped_tokens:sum": frac}


def ppo(
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    datum_N: torch.Tensor,
    num_datums: int,
    config: dict[str, float],
) -> LossOutput:
    ratio = torch.exp(logp - inputs["logprobs"])
    elementwise, extra = _clipped(ratio, inputs["advantages"], *_thresholds(inputs, config))
    return _finish(elementwise, extra)


def cispo(
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    datum_N: torch.Tensor,
    num_datums: int,
    config: dict[str, float],
) -> LossOutput:
    ratio = torch.exp(logp.detach() - inputs["logprobs"])
    weight = _clamp(ratio, *_thresholds(inputs, config))
    return _finish(-weight * logp * inputs["advantages"])


def dro(
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    datum_N: torch.Tensor,
    num_datums: int,
    config: dict[str, float],
) -> LossOutput:
    diff = logp - inputs["logprobs"]
    return _finish(-(logp * inputs["advantages"] - 0.5 * config["beta"] * diff * diff))


def gspo(
    logp: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    datum_N: torch.Tensor,
    num_datums: int,
    config: dict[str, float],
) -> LossOutput:
    in_ratio = (inputs["sequence_ratio_mask"] != 0).to(logp.dtype)
    log_ratio_N = (logp.detach() - inputs["logprobs"]) * in_ratio
    total_D = torch.zeros(num_datums, dtype=logp.dtype, device=logp.device)
    total_D.index_add_(0, datum_N, log_ratio_N)
    count_D = torch.zeros(num_datums, dtype=logp.dtype, device=logp.device)
    count_D.index_add_(0, datum_N, in_ratio)
    # A datum with an empty mask has sequence ratio 1 (log-ratio 0), not NaN.
    seq_log_ratio_D = total_D / count_D.clamp(min=1.0)
    ratio = torch.exp(seq_log_ratio_D[datum_N] + logp - logp.detach())
    elementwise, extra = _clipped(ratio, inputs["advantages"], *_thresholds(inputs, config))
    return _finish(elementwise, extra)


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}
