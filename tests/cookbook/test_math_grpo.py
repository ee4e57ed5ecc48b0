"""The math GRPO recipe raises held-out accuracy on the arithmetic model, and resumes.

One embedded server per module serves the arithmetic model committed beside this file
(tests/cookbook/arith-1m, 4 MB: `python cookbook/scripts/make_arith_model.py --out
tests/cookbook/arith-1m` rebuilds it; see that script for why its step count lands where
reinforcement learning has room to help) through TREADLE_MODEL_FOLDERS, as an operator
would serve it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import treadle
from tests.server import LiveServer, start_server
from treadle_cookbook import arith, checkpoints, metrics
from treadle_cookbook.recipes import math_grpo

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "cookbook/arith-1m"
MODEL_FOLDER = Path(__file__).resolve().parent / "arith-1m"
REPO = Path(__file__).resolve().parents[2]
EVAL_PROBLEMS = 200
MARGIN = 0.025
"""The least rise in held-out exact match the GRPO test accepts: half the least of ten seeds'
measured rises (see the test)."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from start_server(
        tmp_path_factory.mktemp("server"),
        models=[MODEL],
        model_folders={MODEL: str(MODEL_FOLDER)},
    )


@pytest.fixture(scope="module")
def api_key(server: LiveServer) -> str:
    return server.make_tenant().key


def recipe_args(server: LiveServer, api_key: str, log_dir: Path, *extra: str) -> list[str]:
    return [
        f"--base_url={server.base_url}",
        f"--api_key={api_key}",
        f"--model={MODEL}",
        f"--log_dir={log_dir}",
        *extra,
    ]


def test_the_server_serves_the_character_tokenizer(server: LiveServer, api_key: str) -> None:
    with treadle.ServiceClient(base_url=server.base_url, api_key=api_key) as service:
        sampler = service.create_sampling_client(base_model=MODEL)
        tokenizer = sampler.get_tokenizer()
        assert tokenizer.encode("042+007=") == arith.encode("042+007=")
        assert tokenizer.eos_token_id == arith.VOCAB.index(arith.EOS)
        assert tokenizer.decode(arith.encode("0049")) == "0049"


def test_grpo_raises_held_out_accuracy(server: LiveServer, api_key: str, tmp_path: Path) -> None:
    """Eight steps of 32 problems at a constant 5e-4 (the recipe's other defaults) raise
    held-out accuracy.

    Greedy decoding of fixed problems is deterministic: without training, `after` equals
    `before` exactly. This run (seed 0) and seeds 1 to 9, measured on 200 held-out problems
    from 35.5 %, rose by 7.5, 11.5, 6.0, 9.5, 13.5, 5.5, 8.0, 5.0, 5.5 and 7.5 points (mean
    8.0): MARGIN, 2.5 points (5 more problems turned right than wrong), is half the least of
    them. An update unrelated to the reward turns answers either way alike.
    """
    args = recipe_args(
        server,
        api_key,
        tmp_path,
        "--steps=8",
        "--groups_per_step=32",
        "--eval_every=100",
        f"--eval_problems={EVAL_PROBLEMS}",
        "--save_every=100",
        # A constant rate: the default decays to 0 over the run, here 8 steps.
        "--learning_rate=5e-4",
        "--schedule.kind=constant",
    )
    math_grpo.main(args)
    evals = [r for r in metrics.read(tmp_path) if "held_out_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 8]
    before, after = evals[0]["held_out_accuracy"], evals[-1]["held_out_accuracy"]
    assert after - before >= MARGIN, (before, after)
    assert (tmp_path / "accuracy.png").exists() and (tmp_path / "reward.png").exists()
    rows = [r for r in metrics.read(tmp_path) if "reward" in r]
    # The first minibatch of a step is trained by the weights that sampled it.
    assert all(abs(r.get("kl_sampler_trainer", 0.0)) < 0.05 for r in rows), rows


def test_a_step_without_a_varied_group_saves_no_sampler_weights(
    server: LiveServer, api_key: str, tmp_path: Path, sampler_saves: list[int]
) -> None:
    # Greedy rollouts: the samples of a problem are all alike, so every group is constant.
    extra = ["--steps=2", "--groups_per_step=4", "--group_size=4", "--temperature=0"]
    math_grpo.main(recipe_args(server, api_key, tmp_path, *extra, "--eval_problems=10"))
    rows = [r for r in metrics.read(tmp_path) if "reward" in r]
    assert [r["frac_constant_dropped"] for r in rows] == [1.0, 1.0]
    assert len(sampler_saves) == 1  # the initial weights' snapshot only


def test_overlapped_run_resumes_after_a_kill(
    server: LiveServer, api_key: str, tmp_path: Path
) -> None:
    args = recipe_args(
        server,
        api_key,
        tmp_path,
        "--steps=4",
        "--groups_per_step=4",
        "--group_size=4",
        "--eval_every=100",
        "--eval_problems=20",
        "--save_every=1",
        "--mode=overlapped",
        "--lora_rank=8",
    )
    command = [sys.executable, "-m", "treadle_cookbook.recipes.math_grpo", *args]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while checkpoints.latest(tmp_path) is None:
            assert process.poll() is None, "the recipe ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    killed_at = checkpoints.latest(tmp_path)
    assert killed_at is not None and killed_at["step"] < 4

    math_grpo.main(args)

    steps = [c["step"] for c in checkpoints.read(tmp_path)]
    assert steps[-1] == 4 and steps == sorted(steps)
    trained = [r["step"] for r in metrics.read(tmp_path) if "reward" in r]
    # The rerun starts at the checkpoint: steps before it were trained once only.
    assert trained.count(0) == 1 and set(trained) == {0, 1, 2, 3}
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mode"] == "overlapped" and "api_key" not in config


def test_gsm8k_format_files_load_and_malformed_lines_are_named(tmp_path: Path) -> None:
    problems = arith.load_gsm8k(REPO / "cookbook" / "data" / "gsm8k_sample.jsonl")
    assert problems[0].answer == "25" and problems[0].prompt.startswith("Question: ")
    assert arith.final_answer_match(problems[3], "so 1,250 / 50 = 25\n#### 25")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no final answer"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*'#### <number>'"):
        arith.load_gsm8k(bad)
