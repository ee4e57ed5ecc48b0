"""Code RL: reward programs that pass their tests, with a `check_solution` tool between turns.

    python -m treadle_cookbook.recipes.code_rl --model treadle/tiny-1m --log_dir /tmp/code-rl

Each attempt at a problem (cookbook/data/code_problems.jsonl by default, DeepCoder format, see
`treadle_cookbook.code_tasks`) has up to two turns, rendered with the model's chat template.
The first answer may wrap a ```python block in `<check_solution>` tags; the block then runs in
the sandbox on the problem's first `tool_tests` tests, the results follow as a `tool` message,
and the model answers again.
The final answer's first ```python block is run on every test: reward 1 if all pass, 0 if not,
-0.1 without a block. An attempt is one sequence, both turns with the tool message between
them (`treadle_cookbook.rl.episodes.Transcript`), trained as one datum with the attempt's
advantage (its reward minus its group's mean, over the group's standard deviation) on the
sampled tokens only: the prompt and the tool message are not trained. Groups whose rewards are
all equal are dropped unless `train_constant_groups` is set (their advantages are 0: the step
then only exercises the loss).

The loop is the RL core's (`treadle_cookbook.rl`), as in math_grpo's overlapped mode:
`groups_per_step` background tasks each sample one group at a time with the newest weights and
queue it, and the trainer drops a group whose weights are more than `max_staleness` steps
behind its own. The loss defaults to `cispo`; a step's datums are sent in `sub_batches`
forward_backward calls and applied by one optim_step; a step that trained nothing saves no new
sampler weights. Sandboxes run one at a time (they share the sandbox uid's process limit).

Writes config.json, metrics.jsonl (per step: reward, pass_rate, code_block_rate,
tool_call_rate, frac_constant_dropped, stale_dropped, staleness_mean/max; on steps that train,
kl_sampler_trainer, loss, datums, advantage_abs_mean, grad_norm), checkpoints.jsonl and
reward.png, tools.png to `log_dir`. Interrupted, the same command continues from the latest
checkpoint. A base model that never writes a ```python block scores -0.1 on every attempt and
nothing trains; `--load_checkpoint_path` starts from weights that do (an SFT run's checkpoint),
and `--answer_prefix` writes the start of the first answer for the model.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field
from rich.progress import Progress

from treadle import SamplingClient, ServiceClient, types
from treadle_cookbook import checkpoints, code_tasks
from treadle_cookbook.code_tasks import CodeProblem
from treadle_cookbook.config import RecipeConfig
from treadle_cookbook.data import Message
from treadle_cookbook.metrics import MetricsLog
from treadle_cookbook.renderers import Renderer
from treadle_cookbook.rl.datums import PolicyLoss
from treadle_cookbook.rl.episodes import Transcript
from treadle_cookbook.rl.groups import Group, Sample, drop_constant
from treadle_cookbook.rl.rollouts import OverlappedRollouts, RolloutBatch
from treadle_cookbook.rl.train import train_step
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
    sub_batches: int = Field(default=2, ge=1, description="forward_backward calls per optim_step")
    max_staleness: int = Field(default=3, description="oldest weights a group may come from")
    max_tokens: int = Field(default=256, description="tokens sampled per turn")
    temperature: float = Field(default=1.0, description="sampling temperature")
    tool_tests: int = Field(default=1, description="tests check_solution runs (from the first)")
    answer_prefix: str = Field(
        default="",
        description="text the first answer starts with, put in the prompt after the assistant "
        "header (neither sampled nor trained), e.g. '```python\\n' to steer toward a code block",
    )
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
    seed: int | None = None,
) -> Sample:
    """Play the two-turn flow of `code_tasks.run_episode` with the policy, at the token level:
    one sample holding both turns, the tool's answer between them untrained."""
    messages = code_tasks.conversation(problem)
    prefix = renderer.tokenizer.encode(cfg.answer_prefix, add_special_tokens=False)
    transcript = Transcript(renderer.prompt(messages).to_ints() + prefix)

    def params(stop: list[str] | None, turn: int) -> types.SamplingParams:
        turn_seed = None if seed is None else seed * 2 + turn
        return types.SamplingParams(
            max_tokens=cfg.max_tokens, temperature=cfg.temperature, stop=stop, seed=turn_seed
        )

    first = prefix + await transcript.sample_turn(sampler, params(first_turn_stop(renderer), 0))
    answer = renderer.decode(first)
    call = code_tasks.tool_call(answer)
    if call is not None:
        tool = await grader.tool_message(problem, call)
        transcript.observe(renderer.between_turns(messages, first, [tool]))
        answer = renderer.decode(await transcript.sample_turn(sampler, params(None, 1)))
    reward = await grader.reward(problem, answer)
    has_code = code_tasks.extract_code(answer) is not None
    info = {"has_code": float(has_code), "called_tool": float(call is not None)}
    return transcript.sample(reward, info)


@dataclass(frozen=True)
class CodeEpisodes:
    """`group_size` two-turn attempts at a problem (the `Episodes` the rollouts play)."""

    cfg: Config
    renderer: Renderer
    grader: Grader

    async def group(
        self,
        sampler: SamplingClient,
        problem: CodeProblem,
        sampler_step: int,
        seed: int | None = None,
    ) -> Group:
        size = self.cfg.group_size
        attempts = await asyncio.gather(
            *(
                attempt(
                    sampler, problem, self.cfg, self.renderer, self.grader,
                    None if seed is None else seed * size + i,
                )
                for i in range(size)
            )
        )  # fmt: skip
        return Group(list(attempts), sampler_step)


def problem_stream(problems: list[CodeProblem], seed: int, skip: int) -> Iterator[CodeProblem]:
    """The problems shuffled by `seed` and cycled, after the first `skip` (a resumed run's)."""
    order = list(problems)
    random.Random(seed).shuffle(order)
    return itertools.islice(itertools.cycle(order), skip, None)


def step_metrics(batch: RolloutBatch, kept: int) -> dict[str, float]:
    """What the step's groups scored and how old their weights were; `kept` groups varied."""
    attempts = [a for g in batch.groups for a in g.samples]
    return {
        "reward": sum(a.reward for a in attempts) / len(attempts),
        "pass_rate": sum(a.reward == 1.0 for a in attempts) / len(attempts),
        "code_block_rate": sum(a.info["has_code"] for a in attempts) / len(attempts),
        "tool_call_rate": sum(a.info["called_tool"] for a in attempts) / len(attempts),
        "frac_constant_dropped": 1 - kept / len(batch.groups),
        "stale_dropped": float(batch.stale_dropped),
        "staleness_mean": sum(batch.staleness) / len(batch.staleness),
        "staleness_max": float(max(batch.staleness)),
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
    episodes = CodeEpisodes(cfg, renderer, grader)
    adam = types.AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=1.0)
    rollouts = OverlappedRollouts(stream, episodes, cfg.groups_per_step, cfg.max_staleness)
    sampler = await training.save_weights_and_get_sampling_client_async()
    rollouts.publish(sampler, start)
    rollouts.start()

    with Progress() as progress:
        bar = progress.add_task("code RL", total=cfg.steps, completed=start)
        for step in range(start, cfg.steps):
            started = time.monotonic()
            batch = await rollouts.next_batch(step)
            varied = drop_constant(batch.groups)
            trained = batch.groups if cfg.train_constant_groups else varied
            metrics = step_metrics(batch, len(varied))
            if trained:  # every group constant: nothing to learn from, the weights stay
                metrics |= await train_step(
                    training, trained, loss_fn=cfg.loss_fn, adam=adam, sub_batches=cfg.sub_batches
                )
                sampler = await training.save_weights_and_get_sampling_client_async()
            rollouts.publish(sampler, step + 1)
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
