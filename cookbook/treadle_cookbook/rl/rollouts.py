"""Sampling and grading groups of completions, in step with training or ahead of it.

A rollout here is one problem attempted `group_size` times and each attempt graded, as its
`Episodes` (`treadle_cookbook.rl.episodes`) plays it: `RolloutSpec` samples a single turn per
attempt, a recipe's own episodes may play several (code RL calls a tool between two turns).
Problems are whatever those episodes take. `SyncRollouts` samples a step's
groups when the step asks, with the newest weights, so training is on-policy.
`OverlappedRollouts` keeps sampling in background tasks while the trainer works, always with
the newest weights it was given, so the next step's groups are mostly ready when the current
step ends; a group sampled by weights more than `max_staleness` steps old is discarded when
the trainer reaches it.

Both are used the same way: `publish(sampler, step)` after each optimizer step, then
`await next_batch(step)`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from treadle import SamplingClient, types
from treadle_cookbook.arith import Problem
from treadle_cookbook.rl.episodes import Episodes
from treadle_cookbook.rl.groups import Group, Sample, drop_stale, staleness

ProblemT = TypeVar("ProblemT")


class Codec(Protocol):
    """The part of a tokenizer rollouts use (`treadle.Tokenizer` has it)."""

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


@dataclass(frozen=True)
class RolloutSpec:
    """How to turn a problem into a prompt, sample it, and grade a completion's text."""

    codec: Codec
    grade: Callable[[Problem, str], bool]
    group_size: int
    max_tokens: int
    temperature: float = 1.0

    def completion(self, tokens: Sequence[int]) -> str:
        """The text of sampled tokens, a final end-of-sequence token left out."""
        if tokens and tokens[-1] == self.codec.eos_token_id:
            tokens = tokens[:-1]
        return self.codec.decode(tokens)

    async def group(
        self, sampler: SamplingClient, problem: Problem, sampler_step: int, seed: int | None = None
    ) -> Group:
        """Single-turn episodes (see `Episodes`): `sample_group`."""
        return await sample_group(sampler, problem, self, sampler_step, seed)


async def sample_group(
    sampler: SamplingClient,
    problem: Problem,
    spec: RolloutSpec,
    sampler_step: int,
    seed: int | None = None,
) -> Group:
    """`spec.group_size` graded completions of `problem` (reward 1.0 if correct, else 0.0)."""
    prompt = spec.codec.encode(problem.prompt)
    params = types.SamplingParams(
        max_tokens=spec.max_tokens, temperature=spec.temperature, seed=seed
    )
    response = await sampler.sample_async(
        types.ModelInput.from_ints(prompt), spec.group_size, params
    )
    samples = [
        Sample(
            prompt_tokens=prompt,
            tokens=list(seq.tokens),
            logprobs=[float(lp) for lp in seq.logprobs or []],
            reward=1.0 if spec.grade(problem, spec.completion(seq.tokens)) else 0.0,
        )
        for seq in response.sequences
    ]
    return Group(samples, sampler_step)


async def greedy_accuracy(
    sampler: SamplingClient, problems: Sequence[Problem], spec: RolloutSpec
) -> float:
    """The fraction of `problems` whose greedy (temperature 0) completion grades correct."""
    params = types.SamplingParams(max_tokens=spec.max_tokens, temperature=0.0)

    async def correct(problem: Problem) -> bool:
        prompt = types.ModelInput.from_ints(spec.codec.encode(problem.prompt))
        response = await sampler.sample_async(prompt, 1, params)
        return spec.grade(problem, spec.completion(response.sequences[0].tokens))

    results = await asyncio.gather(*(correct(p) for p in problems))
    return sum(results) / len(results)


@dataclass
class RolloutBatch:
    """A step's groups, and what was thrown away to get them."""

    groups: list[Group]
    stale_dropped: int = 0
    staleness: list[int] = field(default_factory=list)


class SyncRollouts(Generic[ProblemT]):
    """Samples each step's groups when asked, with the weights of the latest `publish`."""

    def __init__(
        self,
        problems: Iterator[ProblemT],
        episodes: Episodes[ProblemT],
        groups_per_step: int,
        seed: int,
    ) -> None:
        self._problems = problems
        self._episodes = episodes
        self._groups_per_step = groups_per_step
        self._seed = seed
        self._sampler: SamplingClient | None = None
        self._step = 0

    def publish(self, sampler: SamplingClient, step: int) -> None:
        """Sample from now on with `sampler`: the weights after `step` optimizer steps."""
        self._sampler, self._step = sampler, step

    async def next_batch(self, trainer_step: int) -> RolloutBatch:
        if self._sampler is None:
            raise RuntimeError("publish a sampler before asking for a batch")
        sampler, step = self._sampler, self._step
        problems = [next(self._problems) for _ in range(self._groups_per_step)]
        # A seed per (run seed, step, group) makes a rerun draw the same samples.
        base = (self._seed * 1_000_003 + trainer_step) * self._groups_per_step
        groups = await asyncio.gather(
            *(self._episodes.group(sampler, p, step, base + i) for i, p in enumerate(problems))
        )
        return RolloutBatch(list(groups), 0, [staleness(g, trainer_step) for g in groups])

    async def close(self) -> None:
        """Nothing runs in the background."""


class OverlappedRollouts(Generic[ProblemT]):
    """Samples groups in `groups_per_step` background tasks while the trainer trains.

    Each task samples one group at a time with the newest published weights and queues it;
    the queue holds one step's groups, so sampling runs about one step ahead. `next_batch`
    takes queued groups, discarding those sampled more than `max_staleness` steps before the
    trainer's step, until it has `groups_per_step`. Call `start()` after the first `publish`,
    and `close()` at the end.
    """

    def __init__(
        self,
        problems: Iterator[ProblemT],
        episodes: Episodes[ProblemT],
        groups_per_step: int,
        max_staleness: int = 3,
    ) -> None:
        self._problems = problems
        self._episodes = episodes
        self._groups_per_step = groups_per_step
        self._max_staleness = max_staleness
        self._queue: asyncio.Queue[Group | BaseException] = asyncio.Queue(groups_per_step)
        self._workers: list[asyncio.Task[None]] = []
        self._sampler: SamplingClient | None = None
        self._step = 0

    def publish(self, sampler: SamplingClient, step: int) -> None:
        """Sample from now on with `sampler`: the weights after `step` optimizer steps."""
        self._sampler, self._step = sampler, step

    def start(self) -> None:
        if self._sampler is None:
            raise RuntimeError("publish a sampler before starting the rollout tasks")
        self._workers = [asyncio.create_task(self._work()) for _ in range(self._groups_per_step)]

    async def _work(self) -> None:
        while True:
            assert self._sampler is not None
            sampler, step = self._sampler, self._step
            try:
                group = await self._episodes.group(sampler, next(self._problems), step)
            except Exception as exc:  # handed to the trainer, which raises it
                await self._queue.put(exc)
                return
            await self._queue.put(group)

    async def next_batch(self, trainer_step: int) -> RolloutBatch:
        batch = RolloutBatch([])
        while len(batch.groups) < self._groups_per_step:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if drop_stale([item], trainer_step, self._max_staleness):
                batch.groups.append(item)
                batch.staleness.append(staleness(item, trainer_step))
            else:
                batch.stale_dropped += 1
        return batch

    async def close(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
