"""Episodes: how a group of attempts at one problem is played, in one turn or in several.

`Episodes` is what the rollouts (`treadle_cookbook.rl.rollouts`) call to sample and grade one
group; `RolloutSpec` there plays single-turn groups, one sampling request per group. An
episode of several turns (a tool called between them) keeps its tokens in a `Transcript`:
each turn is sampled after everything before it, and what the environment answers between
turns is appended unsampled, so the episode is one sequence, one datum, in which only the
policy's own tokens are trained. This module knows nothing of chat templates or tools: the
recipe turns its observations into tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from treadle import SamplingClient, types
from treadle_cookbook.rl.groups import Group, Sample

ProblemT_contra = TypeVar("ProblemT_contra", contravariant=True)


class Episodes(Protocol[ProblemT_contra]):
    """Samples and grades one group of attempts at a problem."""

    async def group(
        self,
        sampler: SamplingClient,
        problem: ProblemT_contra,
        sampler_step: int,
        seed: int | None = None,
    ) -> Group:
        """The attempts, sampled with `sampler` (the weights after `sampler_step` steps); a
        `seed` makes the draw repeatable."""
        ...


@dataclass
class Transcript:
    """The tokens of one multi-turn episode as it is played, after its `prompt`."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)

    def context(self) -> types.ModelInput:
        """Everything so far: what the next turn is sampled after."""
        return types.ModelInput.from_ints(self.prompt + self.tokens)

    async def sample_turn(self, sampler: SamplingClient, params: types.SamplingParams) -> list[int]:
        """Sample one turn after the context, append it, and return its tokens."""
        response = await sampler.sample_async(self.context(), 1, params)
        sequence = response.sequences[0]
        tokens = list(sequence.tokens)
        logprobs = [float(lp) for lp in sequence.logprobs or []]
        if len(logprobs) != len(tokens):
            raise ValueError(
                f"the sampler returned {len(logprobs)} logprobs for {len(tokens)} tokens; "
                "a turn is trained on its sampled logprobs, so the server must return them"
            )
        self.tokens += tokens
        self.logprobs += logprobs
        self.mask += [True] * len(tokens)
        return tokens

    def observe(self, tokens: Sequence[int]) -> None:
        """Append tokens the policy did not sample (a tool's answer, the next turn's header)."""
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.mask += [False] * len(tokens)

    def sample(self, reward: float, info: Mapping[str, float] | None = None) -> Sample:
        """The finished episode as one sample: every turn, trained where it was sampled."""
        return Sample(
            list(self.prompt),
            list(self.tokens),
            list(self.logprobs),
            reward,
            list(self.mask),
            dict(info or {}),
        )
