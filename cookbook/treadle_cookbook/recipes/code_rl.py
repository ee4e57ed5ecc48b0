"""Code RL: reward programs that pass their tests, with a `check_solution` tool between turns.

    python -m treadle_cookbook.recipes.code_rl --model treadle/tiny-1m --log_dir /tmp/code-rl

Each attempt at a problem (cookbook/data/code_problems.jsonl by default, DeepCoder format, see
`treadle_cookbook.code_tasks`) has up to two turns, rendered with the model's chat template.
The first answer may wrap a ```python block in `<check_solution>` tags; the block then runs in
the sandbox on the problem's first `tool_tests` tests, the results follow as a `tool` message,
and the model answers again.
The final answer's first ```python block is run on every test: reward 1 if all pass, 0 if not,
-0.1 without a block. Both turns' sampled tokens are trained with the attempt's advantage (its
reward minus its group's mean, over the group's standard deviation); the prompt and the tool
message are not trained. Groups whose rewards are all equal are dropped unless
`train_constant_groups` is set (their advantages are 0: the step then only exercises the loss).

Sampling overlaps training: `groups_per_step` background tasks each sample one group at a time
with the newest weights and queue it, and the trainer drops a group whose weights are more than
`max_staleness` steps behind its own. The loss defaults to `cispo`; a step's datums are sent in
`sub_batches` forward_backward calls and applied by one optim_step. Sandboxes run one at a time
(they share the sandbox uid's process limit).

Writes config.json, metrics.jsonl (per step: reward, pass_rate, code_block_rate,
tool_call_rate, frac_constant_dropped, stale_dropped, staleness_mean/max, kl_sampler_trainer,
loss), checkpoints.jsonl and reward.png, tools.png to `log_dir`. Interrupted, the same command
continues from the latest checkpoint. On a tiny model nothing gets solved; the loop still runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from rich.progress import Progress

from treadle import SamplingClient, ServiceClient, TrainingClient, types
from treadle_cookbook import checkpoints, code_tasks
from treadle_cookbook.code_tasks import CodeProblem
from treadle_cookbook.config import RecipeConfig
from treadle_cookbook.data import Message
from treadle_cookbook.metrics import MetricsLog
from treadle_cookbook.renderers import Renderer
from treadle_cookbook.rl.datums import PolicyLoss, datum, sampler_trainer_kl
from treadle_cookbook.rl.groups import Sample, advantages
from treadle_cookbook.rl.train import split
from treadle_cookbook.sandbox import Limits

DEFAULT_PROBLEMS = Path(__file__).resolve().parents[2] / "data" / "code_problems.jsonl"


class Config(RecipeConfig):
    model: str = Field(default="treadle/tiny-1m", description="the served base model")
    problems_path: Path = Field(default=DEFAULT_PROBLEMS, description="DeepCoder-format JSONL")
    steps: int = Field(default=20, description="optimizer steps in all (a resumed run included)")
    groups_per_step: int = Field(default=4, description="problems sampled per step")
    group_size: int = Field(default=4, description="attempts sampled per problem")
    learning_rate: float = Field(default=1e-5, description="AdamW learning rate (constant)")
    loss_fn: PolicyLoss = Field(default="cispo", description="the policy loss")
    sub_batches: int = Field(default=2, description="forward_backward calls per optim_step")
    max_staleness: int = Field(default=3, description="oldest weights a group may come from")
    max_tokens: int = Field(default=256, description="tokens sampled per turn")
    temperature: float = Field(default=1.0, description="sampling temperature")
    tool_tests: int = Field(default=1, description="tests check_solution runs (from the first)")
    wall_time_s: float = Field(default=5.0, description="sandbox wall-clock limit per test")
    train_constant_groups: bool = Field(default=False, description="train on equal-reward groups")
    save_every: int = Field(default=5, description="checkpoint every N steps")


@dataclass(frozen=True)
class Attempt:
    """One attempt at a problem: a Sample per turn, each holding the context before it."""

    turns: list[Sample]
    reward: float
    has_code: bool
    called_tool: bool


@dataclass(frozen=True)
class AttemptGroup:
    attempts: list[Attempt]
    sampler_step: int

    @property
    def rewards(self) -> list[float]:
        return [a.reward for a in self.attempts]


class Grader:
    """Runs the sandbox off the event loop, one program at a time."""

    def __init__(self, limits: Limits, tool_tests: int) -> None:
        self._limits, self._tool_tests = limits, tool_tests
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandbox")

    async def tool_message(self, problem: CodeProblem, call: str) -> Message:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, code_tasks.tool_message, problem, call, self._limits, self._tool_tests
        )

    async def reward(self, problem: CodeProblem, answer: str) -> float:
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, code_tasks.reward, problem, answer, self._limits
        )

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


async def sample_turn(
    sampler: SamplingClient,
    context: types.ModelInput,
    cfg: Config,
    renderer: Renderer,
    stop: list[str] | None = None,
) -> tuple[Sample, str]:
    """One sampled turn after `context` (reward filled in later) and its text; `stop` None
    stops at the end of turn only."""
    params = types.SamplingParams(max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=stop)
    response = await sampler.sample_async(context, 1, params)
    sequence = response.sequences[0]
    logprobs = [float(lp) for lp in sequence.logprobs or []]
    sample = Sample(context.to_ints(), list(sequence.tokens), logprobs, 0.0)
    return sample, renderer.decode(sequence.tokens)


def first_turn_stop(renderer: Renderer) -> list[str]:
    """The first turn ends at the tool's closing tag (kept in the sampled text, where
    `code_tasks.tool_call` finds it) or at the end of turn. Stop strings replace the end-of-turn
    token as a stop, so the end-of-turn token's text is one of them."""
    eos = renderer.tokenizer.eos_token
    return [code_tasks.TOOL_CLOSE, eos] if eos else [code_tasks.TOOL_CLOSE]


async def attempt(
    sampler: SamplingClient,
    problem: CodeProblem,
    cfg: Config,
    renderer: Renderer,
    grader: Grader,
) -> Attempt:
    """Play the two-turn flow of `code_tasks.run_episode` with the policy, at the token level."""
    messages = code_tasks.conversation(problem)
    first, answer = await sample_turn(
        sampler, renderer.prompt(messages), cfg, renderer, first_turn_stop(renderer)
    )
    turns = [first]
    call = code_tasks.tool_call(answer)
    if call is not None:
        tool = await grader.tool_message(problem, call)
        messages += [{"role": "assistant", "content": answer}, tool]
        second, answer = await sample_turn(sampler, renderer.prompt(messages), cfg, renderer)
        turns.append(second)
    reward = await grader.reward(problem, answer)
    turns = [Sample(t.prompt_tokens, t.tokens, t.logprobs, reward) for t in turns]
    has_code = code_tasks.extract_code(answer) is not None
    return Attempt(turns, reward, has_code, call is not None)


class OverlappedAttempts:
    """Background tasks that keep sampling groups with the newest published weights."""

    def __init__(
        self, problems: Iterator[CodeProblem], cfg: Config, renderer: Renderer, grader: Grader
    ) -> None:
        self._problems, self._cfg, self._renderer, self._grader = problems, cfg, renderer, grader
        self._queue: asyncio.Queue[AttemptGroup | BaseException] = asyncio.Queue(
            cfg.groups_per_step
        )
        self._sampler: SamplingClient | None = None
        self._step = 0
        self._tasks: list[asyncio.Task[None]] = []

    def publish(self, sampler: SamplingClient, step: int) -> None:
        self._sampler, self._step = sampler, step
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._work()) for _ in range(self._cfg.groups_per_step)
            ]

    async def _work(self) -> None:
        while True:
            assert self._sampler is not None
            sampler, step, problem = self._sampler, self._step, next(self._problems)
            try:
                attempts = await asyncio.gather(
                    *(
                        attempt(sampler, problem, self._cfg, self._renderer, self._grader)
                        for _ in range(self._cfg.group_size)
                    )
                )
            except Exception as exc:  # handed to the trainer, which raises it
                await self._queue.put(exc)
                return
            await self._queue.put(AttemptGroup(list(attempts), step))

    async def next_groups(self, trainer_step: int) -> tuple[list[AttemptGroup], int]:
        """`groups_per_step` groups at most `max_staleness` steps old, and how many were not."""
        groups: list[AttemptGroup] = []
        stale = 0
        while len(groups) < self._cfg.groups_per_step:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if trainer_step - item.sampler_step <= self._cfg.max_staleness:
                groups.append(item)
            else:
                stale += 1
        return groups, stale

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def train_on(
    training: TrainingClient, groups: Sequence[AttemptGroup], cfg: Config
) -> dict[str, float]:
    """One optim_step over every turn of every attempt, in `sub_batches` forward_backward calls."""
    samples: list[Sample] = []
    data: list[types.Datum] = []
    for group in groups:
        for one, advantage in zip(group.attempts, advantages(group.rewards), strict=True):
            samples += one.turns
            data += [datum(turn, advantage) for turn in one.turns]
    chunks = split(data, cfg.sub_batches)
    passes = [await training.forward_backward_async(chunk, cfg.loss_fn) for chunk in chunks]
    adam = types.AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=1.0)
    optim = await training.optim_step_async(adam)
    outputs = [await p for p in passes]
    await optim
    trainer_logprobs = [
        [float(x) for x in row["logprobs"].tolist()]
        for out in outputs
        for row in out.loss_fn_outputs
    ]
    return {
        "kl_sampler_trainer": sampler_trainer_kl(samples, trainer_logprobs),
        "loss": sum(out.metrics.get("loss:sum", 0.0) for out in outputs),
        "datums": float(len(data)),
    }


def problem_stream(problems: list[CodeProblem], seed: int, skip: int) -> Iterator[CodeProblem]:
    """The problems shuffled by `seed` and cycled, after the first `skip` (a resumed run's)."""
    order = list(problems)
    random.Random(seed).shuffle(order)
    return itertools.islice(itertools.cycle(order), skip, None)


def step_metrics(
    groups: Sequence[AttemptGroup], kept: int, stale: int, trainer_step: int
) -> dict[str, float]:
    """What the step's groups scored and how old their weights were; `kept` groups varied."""
    attempts = [a for g in groups for a in g.attempts]
    staleness = [trainer_step - g.sampler_step for g in groups]
    return {
        "reward": sum(a.reward for a in attempts) / len(attempts),
        "pass_rate": sum(a.reward == 1.0 for a in attempts) / len(attempts),
        "code_block_rate": sum(a.has_code for a in attempts) / len(attempts),
        "tool_call_rate": sum(a.called_tool for a in attempts) / len(attempts),
        "frac_constant_dropped": 1 - kept / len(groups),
        "stale_dropped": float(stale),
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": float(max(staleness)),
    }


async def run(cfg: Config) -> None:
    cfg.save(cfg.log_dir)
    log = MetricsLog(cfg.log_dir, cfg.mlflow_uri)
    service = ServiceClient(base_url=cfg.base_url, api_key=cfg.api_key)
    training, start = checkpoints.resume(service, cfg.log_dir, cfg)
    renderer = Renderer(training.get_tokenizer())
    problems = code_tasks.load_problems(cfg.problems_path)
    stream = problem_stream(problems, cfg.seed, start * cfg.groups_per_step)
    grader = Grader(Limits(wall_time_s=cfg.wall_time_s), cfg.tool_tests)
    rollouts = OverlappedAttempts(stream, cfg, renderer, grader)
    rollouts.publish(await training.save_weights_and_get_sampling_client_async(), start)

    with Progress() as progress:
        bar = progress.add_task("code RL", total=cfg.steps, completed=start)
        for step in range(start, cfg.steps):
            started = time.monotonic()
            groups, stale = await rollouts.next_groups(step)
            varied = [g for g in groups if max(g.rewards) != min(g.rewards)]
            trained = groups if cfg.train_constant_groups else varied
            metrics = step_metrics(groups, len(varied), stale, step)
            if trained:  # every group constant: nothing to learn from, the weights stay
                metrics |= await train_on(training, trained, cfg)
            rollouts.publish(await training.save_weights_and_get_sampling_client_async(), step + 1)
            metrics["step_seconds"] = time.monotonic() - started
            log.log(step, metrics)
            if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
                checkpoints.save(training, cfg.log_dir, step + 1, name=f"step-{step + 1:06d}")
            progress.update(bar, advance=1, description=f"code RL reward {metrics['reward']:.2f}")

    await rollouts.close()
    grader.close()
    log.plot(["reward", "pass_rate"], "reward")
    log.plot(["code_block_rate", "tool_call_rate"], "tools")
    log.close()
    service.close().result()


def main(argv: list[str] | None = None) -> None:
    asyncio.run(run(Config.from_cli(argv)))


if __name__ == "__main__":
    main()
