"""Groups of samples for one prompt, their group-relative advantages, and which to train on.

GRPO samples several completions of the same prompt and scores each against the group: a
completion's advantage is its reward minus the group's mean, divided by the group's standard
deviation. A group whose rewards are all equal has zero advantage everywhere and teaches
nothing, so it is dropped rather than trained on; so is a group sampled by weights more than
`max_staleness` optimizer steps older than the trainer's (overlapped mode), whose importance
ratios would be too far from 1 to trust.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

ADVANTAGE_EPS = 1e-4
"""Added to the group's standard deviation so that nearly constant groups stay finite."""


@dataclass(frozen=True)
class Sample:
    """One sampled completion of a prompt, in one turn or several.

    `tokens` follow `prompt_tokens`: the sampled ids, the stop token included, and in a
    multi-turn episode also what came between the turns (a tool's answer, the next turn's
    header), which the policy did not sample. `mask` is True on sampled tokens and False on
    those (None: every token was sampled); only sampled tokens are trained. `logprobs` holds the
    sampler's logprob of each token, 0.0 where nothing was sampled. `info` holds what the
    episode measured besides its reward (whether it called a tool, ...) for the recipe's metrics.
    """

    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    reward: float
    mask: list[bool] | None = None
    info: Mapping[str, float] = field(default_factory=dict)

    @property
    def sampled(self) -> list[bool]:
        """Per token of `tokens`: whether the policy sampled it."""
        return self.mask if self.mask is not None else [True] * len(self.tokens)


@dataclass(frozen=True)
class Group:
    """The samples of one prompt, drawn with the weights after optimizer step `sampler_step`."""

    samples: list[Sample]
    sampler_step: int

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


def advantages(rewards: Sequence[float], eps: float = ADVANTAGE_EPS) -> list[float]:
    """`(r - mean) / (std + eps)` per reward, with the group's population standard deviation."""
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / (std + eps) for r in rewards]


def is_constant(group: Group) -> bool:
    return max(group.rewards) == min(group.rewards)


def drop_constant(groups: Sequence[Group]) -> list[Group]:
    """The groups whose rewards differ (the others carry no learning signal)."""
    return [g for g in groups if not is_constant(g)]


def staleness(group: Group, trainer_step: int) -> int:
    """How many optimizer steps the trainer is ahead of the weights that sampled `group`."""
    return trainer_step - group.sampler_step


def drop_stale(groups: Sequence[Group], trainer_step: int, max_staleness: int) -> list[Group]:
    """The groups sampled at most `max_staleness` steps before `trainer_step`."""
    return [g for g in groups if staleness(g, trainer_step) <= max_staleness]
