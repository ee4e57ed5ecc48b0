"""Independent plain-PyTorch references: LoRA through forward hooks, losses written out per datum.

Nothing here imports the engine's LoRA layer, batching or losses: the tests compare the
engine against these.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn


@contextmanager
def hooked_lora(
    model: nn.Module, weights: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float
) -> Iterator[None]:
    """Add scale · x Aᵀ Bᵀ to the output of each named Linear."""
    handles = []
    for name, (a, b) in weights.items():

        def hook(_mod, inputs, output, a=a, b=b):  # type: ignore[no-untyped-def]
            return output + (inputs[0] @ a.T @ b.T) * scale

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def target_logprobs(model: nn.Module, tokens: np.ndarray, targets: np.ndarray) -> torch.Tensor:
    logits = model(input_ids=torch.tensor(tokens)[None]).logits[0].float()
    logp_all = torch.log_softmax(logits, dim=-1)
    t = torch.tensor(targets)
    if t.dim() == 1:
        return logp_all[torch.arange(len(tokens)), t]
    return torch.gather(logp_all, 1, t)


def datum_loss(
    loss_fn: str, logp: torch.Tensor, inputs: dict[str, np.ndarray], config: dict[str, float]
) -> torch.Tensor:
    f = {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items() if k != "target_tokens"}
    # A datum's own clip thresholds (one value or one per token) override the config's.
    lo = f.get("clip_low_threshold", torch.tensor(config.get("clip_low_threshold", 0.8)))
    hi = f.get("clip_high_threshold", torch.tensor(config.get("clip_high_threshold", 1.2)))
    if loss_fn == "cross_entropy":
        return -(f["weights"] * logp).sum()
    q, adv = f["logprobs"], f["advantages"]
    if loss_fn == "importance_sampling":
        return -(torch.exp(logp - q) * adv).sum()
    if loss_fn == "ppo":
        r = torch.exp(logp - q)
        return -torch.min(r * adv, torch.clamp(r, lo, hi) * adv).sum()
    if loss_fn == "cispo":
        r = torch.exp(logp - q).detach()
        return -(torch.clamp(r, lo, hi) * logp * adv).sum()
    if loss_fn == "dro":
        beta = config["beta"]
        return -(logp * adv - 0.5 * beta * (logp - q) ** 2).sum()
    if loss_fn == "gspo":
        # Without a mask, the ratio is taken over the positions with nonzero advantages.
        m = f["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in f else adv != 0
        seq = (logp.detach() - q)[m].mean() if bool(m.any()) else torch.tensor(0.0)
        s = torch.exp(seq) * torch.exp(logp - logp.detach())
        return -torch.min(s * adv, torch.clamp(s, lo, hi) * adv).sum()
    raise ValueError(loss_fn)
