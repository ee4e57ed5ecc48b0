"""The code RL recipe trains on groups whose rewards differ, end to end against an embedded
server, and resumes after a kill.

treadle/tiny-1m writes no code, so on it every reward is -0.1 and nothing would train. The test
starts the way one starts RL on a model that has not seen the format: a few sft_chat steps on
the answer "```python\n```" (an empty program, which passes the problem "print nothing"),
then code_rl from that checkpoint (`--load_checkpoint_path`) with the first answer opened by
"```python\n" (`--answer_prefix`). The model then closes the block at once (reward 1.0),
after some code (0.0) or not at all (-0.1), so rewards differ inside groups. (Measured: 15 SFT
steps put 64 samples at 34 x 1.0, 9 x 0.0, 21 x -0.1; without the prefix all 64 were -0.1.) The
two-turn path at the token level is tested with a scripted sampler and the tiny models'
tokenizer and chat template, no model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers

from tests.server import LiveServer, start_server
from treadle import types
from treadle.tokenizer import Tokenizer
from treadle_cookbook import checkpoints, code_tasks, metrics
from treadle_cookbook.recipes import code_rl, sft_chat
from treadle_cookbook.renderers import Renderer
from treadle_cookbook.rl.datums import datum

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECIPE_TIMEOUT_S = 120
STEPS = 4
SFT_STEPS = 15
PREFIX = "```python\n"
SILENT = {
    "id": "print-nothing",
    "problem": "Write a program that prints nothing.",
    "tests": [{"input": "", "output": "", "testtype": "stdin"}],
}
EMPTY_PROGRAM = "```python\n```"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from start_server(tmp_path_factory.mktemp("server"))


def warm_start(server: LiveServer, api_key: str, folder: Path) -> tuple[Path, str]:
    """The problem file, and the checkpoint of a short SFT run on its empty-program answer."""
    problems = folder / "problems.jsonl"
    problems.write_text(json.dumps(SILENT) + "\n")
    problem = code_tasks.from_deepcoder(SILENT)
    answer = {"role": "assistant", "content": EMPTY_PROGRAM}
    chats = folder / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [*code_tasks.conversation(problem), answer]}) + "\n")
    sft_chat.main(
        [
            f"--base_url={server.base_url}", f"--api_key={api_key}", "--model=treadle/tiny-1m",
            f"--log_dir={folder / 'sft'}", f"--data={chats}", "--held_out_fraction=0",
            f"--steps={SFT_STEPS}", "--batch_size=1", "--learning_rate=5e-3",
            f"--save_every={SFT_STEPS}",
        ]
    )  # fmt: skip
    checkpoint = checkpoints.latest(folder / "sft")
    assert checkpoint is not None
    return problems, checkpoint["path"]


def recipe(
    server: LiveServer, api_key: str, log_dir: Path, problems: Path, start: str
) -> subprocess.Popen[str]:
    args = [
        "--model=treadle/tiny-1m",
        f"--log_dir={log_dir}",
        f"--problems_path={problems}",
        f"--load_checkpoint_path={start}",
        f"--answer_prefix={PREFIX}",
        f"--steps={STEPS}",
        "--groups_per_step=4",
        "--group_size=4",
        "--max_tokens=16",
        "--save_every=1",
        "--wall_time_s=2",
    ]
    env = os.environ | {"TREADLE_BASE_URL": server.base_url, "TREADLE_API_KEY": api_key}
    return subprocess.Popen(
        [sys.executable, "-m", "treadle_cookbook.recipes.code_rl", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_recipe_trains_on_differing_rewards_and_resumes_after_a_kill(
    server: LiveServer, tmp_path: Path
) -> None:
    api_key = server.make_tenant().key
    problems, start = warm_start(server, api_key, tmp_path)
    log_dir = tmp_path / "run"
    first = recipe(server, api_key, log_dir, problems, start)
    deadline = time.monotonic() + RECIPE_TIMEOUT_S
    while checkpoints.latest(log_dir) is None:
        assert first.poll() is None, first.communicate()[0]
        assert time.monotonic() < deadline, "no checkpoint was written"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed_at = checkpoints.latest(log_dir)
    assert killed_at is not None and killed_at["step"] < STEPS

    second = recipe(server, api_key, log_dir, problems, start)
    output, _ = second.communicate(timeout=RECIPE_TIMEOUT_S)
    assert second.returncode == 0, output

    rows = [row for row in metrics.read(log_dir) if "reward" in row]
    assert {row["step"] for row in rows} == set(range(STEPS))
    resumed = rows[[row["step"] for row in rows].index(killed_at["step"]) :]
    assert [row["step"] for row in resumed] == list(range(killed_at["step"], STEPS))
    # Steps whose groups all scored alike train nothing; the others train every attempt of
    # their varied groups, with advantages that are not zero, and the update moves weights.
    trained = [row for row in rows if "datums" in row]
    assert trained, rows
    for row in trained:
        varied_groups = round(4 * (1 - row["frac_constant_dropped"]))
        assert row["datums"] == 4 * varied_groups and row["advantage_abs_mean"] > 0.5
        assert row["grad_norm"] > 0 and row["staleness_max"] <= 3
        assert row["code_block_rate"] > 0  # without a block every reward is -0.1
        # The trainer's logprobs of the sampled tokens are the sampler's: each datum is the
        # sequence that was sampled (prefix and any tool message untrained), not re-rendered.
        assert abs(row["kl_sampler_trainer"]) < 0.05
    assert checkpoints.read(log_dir)[-1]["step"] == STEPS
    config = json.loads((log_dir / "config.json").read_text())
    assert config["loss_fn"] == "cispo" and "api_key" not in config
    assert (log_dir / "reward.png").stat().st_size > 0 and (log_dir / "tools.png").exists()


def test_a_step_without_a_varied_group_saves_no_sampler_weights(
    server: LiveServer, tmp_path: Path, sampler_saves: list[int]
) -> None:
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps(SILENT) + "\n")
    # Greedy attempts at one problem are all alike, so every group is constant (and the base
    # model writes no code: each scores -0.1).
    code_rl.main(
        [
            f"--base_url={server.base_url}", f"--api_key={server.make_tenant().key}",
            "--model=treadle/tiny-1m", f"--log_dir={tmp_path / 'run'}",
            f"--problems_path={problems}", "--steps=2", "--groups_per_step=2", "--group_size=2",
            "--max_tokens=8", "--temperature=0", "--save_every=2",
        ]
    )  # fmt: skip
    rows = [row for row in metrics.read(tmp_path / "run") if "reward" in row]
    assert [row["frac_constant_dropped"] for row in rows] == [1.0, 1.0]
    assert not any("datums" in row for row in rows)
    assert len(sampler_saves) == 1  # the initial weights' snapshot only


# -- the two-turn flow at the token level ---------------------------------------------------


ASSETS = Path(__file__).resolve().parents[2] / "gpu_worker" / "assets" / "bpe-1k"


@pytest.fixture(scope="module")
def renderer() -> Renderer:
    """The tiny models' own tokenizer and ChatML template, read from the repository's assets."""
    backend = tokenizers.Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    config = json.loads((ASSETS / "tokenizer_config.json").read_text())
    return Renderer(Tokenizer(backend, config, (ASSETS / "chat_template.jinja").read_text()))


class ScriptedSampler:
    """Answers each sample call with the next scripted text, remembering prompts and params."""

    def __init__(self, renderer: Renderer, *answers: str) -> None:
        self.tokenizer = renderer.tokenizer
        self.answers = list(answers)
        self.prompts: list[list[int]] = []
        self.params: list[types.SamplingParams] = []

    async def sample_async(
        self, prompt: types.ModelInput, num_samples: int, params: types.SamplingParams
    ) -> SimpleNamespace:
        self.prompts.append(prompt.to_ints())
        self.params.append(params)
        tokens = self.tokenizer.encode(self.answers.pop(0), add_special_tokens=False)
        tokens.append(self.tokenizer.eos_token_id)
        sequence = SimpleNamespace(tokens=tokens, logprobs=[-1.0] * len(tokens))
        return SimpleNamespace(sequences=[sequence])


PROBLEM = code_tasks.CodeProblem(
    "sum", "Print a + b.", (code_tasks.Case("1 2\n", "3\n", "stdin"),) * 2
)


def test_an_attempt_trains_both_turns_but_not_the_tool_message(renderer: Renderer) -> None:
    wrong = "<check_solution>\n```python\nprint(0)\n```\n</check_solution>"
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    sampler = ScriptedSampler(renderer, wrong, right)
    cfg = code_rl.Config(log_dir=Path("unused"), max_tokens=64)
    grader = code_rl.Grader(code_rl.Limits(wall_time_s=2.0), tool_tests=1)
    try:
        one = asyncio.run(code_rl.attempt(sampler, PROBLEM, cfg, renderer, grader))
    finally:
        grader.close()
    assert one.reward == 1.0 and one.info == {"has_code": 1.0, "called_tool": 1.0}
    # The first turn stops at the tool's closing tag or the end of turn; the second at the end.
    assert [p.stop for p in sampler.params] == [["</check_solution>", "<|im_end|>"], None]
    # The second turn is sampled after the prompt, the first turn's tokens as sampled, and
    # the tool message: one sequence, which is what is trained.
    first_prompt, second_prompt = sampler.prompts
    assert first_prompt == one.prompt_tokens
    assert second_prompt == one.prompt_tokens + one.tokens[: len(second_prompt) - len(first_prompt)]
    assert renderer.tokenizer.decode(one.prompt_tokens + one.tokens).endswith(
        f"{wrong}<|im_end|>\n<|im_start|>tool\n0/1 tests passed.\n"
        "Test 1: failed, input '1 2\\n': expected '3\\n', got '0\\n'<|im_end|>\n"
        f"<|im_start|>assistant\n{right}<|im_end|>"
    )
    # Trained: both turns' sampled tokens, each with its logprob; not the tool message.
    assert one.mask is not None
    sampled = [t for t, m in zip(one.tokens, one.mask, strict=True) if m]
    between = [t for t, m in zip(one.tokens, one.mask, strict=True) if not m]
    turns = [renderer.tokenizer.encode(a, add_special_tokens=False) for a in (wrong, right)]
    eos = renderer.tokenizer.eos_token_id
    assert sampled == turns[0] + [eos] + turns[1] + [eos]
    assert "0/1 tests passed" in renderer.tokenizer.decode(between)
    inputs = datum(one, 0.5).loss_fn_inputs
    advantages, logprobs = inputs["advantages"].tolist(), inputs["logprobs"].tolist()
    completion = [0.0] * (len(one.prompt_tokens) - 1) + [0.5 if m else 0.0 for m in one.mask]
    assert advantages == completion
    assert logprobs == [-1.0 if a else 0.0 for a in completion]


def test_an_attempt_without_a_tool_call_is_one_turn(renderer: Renderer) -> None:
    sampler = ScriptedSampler(renderer, "I do not know.")
    cfg = code_rl.Config(log_dir=Path("unused"), max_tokens=64)
    grader = code_rl.Grader(code_rl.Limits(wall_time_s=2.0), tool_tests=1)
    try:
        one = asyncio.run(code_rl.attempt(sampler, PROBLEM, cfg, renderer, grader))
    finally:
        grader.close()
    assert one.reward == code_tasks.NO_CODE_REWARD and len(sampler.prompts) == 1
    assert one.info == {"has_code": 0.0, "called_tool": 0.0} and one.mask == [True] * len(
        one.tokens
    )


def test_an_answer_prefix_is_prompted_and_graded_but_not_trained(renderer: Renderer) -> None:
    sampler = ScriptedSampler(renderer, "a, b = map(int, input().split())\nprint(a + b)\n```")
    cfg = code_rl.Config(log_dir=Path("unused"), max_tokens=64, answer_prefix=PREFIX)
    grader = code_rl.Grader(code_rl.Limits(wall_time_s=2.0), tool_tests=1)
    try:
        one = asyncio.run(code_rl.attempt(sampler, PROBLEM, cfg, renderer, grader))
    finally:
        grader.close()
    prefix = renderer.tokenizer.encode(PREFIX, add_special_tokens=False)
    assert one.reward == 1.0 and one.info["has_code"] == 1.0
    assert sampler.prompts == [one.prompt_tokens] and one.prompt_tokens[-len(prefix) :] == prefix
    assert one.mask == [True] * len(one.tokens)
