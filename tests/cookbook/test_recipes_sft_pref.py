"""The chat SFT, DPO, KTO and distillation recipes run end to end against one embedded server.

Each recipe's `main` runs in this process with command-line arguments, on treadle/tiny-1m for
a few steps, and the test reads back what it wrote to its log folder: the loss falls (SFT), the
preference margin rises above zero from exactly zero (DPO, KTO), the student's KL to its teacher
falls (distill), a rerun with more steps continues from the last checkpoint (SFT), and a rerun on
other pairs is refused (DPO, KTO).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from tests.server import LiveServer, start_server
from treadle_cookbook import checkpoints, metrics
from treadle_cookbook.recipes import distill, dpo, kto, sft_chat

pytestmark = pytest.mark.e2e

STUDENT = "treadle/tiny-1m"
TEACHER = "treadle/tiny-qwen-1m"  # same tokenizer as the student, other weights


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from start_server(tmp_path_factory.mktemp("server"), models=[STUDENT, TEACHER])


@pytest.fixture(scope="module")
def connection(server: LiveServer) -> list[str]:
    return ["--base_url", server.base_url, "--api_key", server.make_tenant().key]


def _values(log_dir: Path, key: str) -> list[tuple[int, float]]:
    return [(row["step"], row[key]) for row in metrics.read(log_dir) if key in row]


def test_sft_chat_loss_falls_and_a_rerun_resumes(connection: list[str], tmp_path: Path) -> None:
    log_dir = tmp_path / "sft"
    args = [*connection, "--model", STUDENT, "--log_dir", str(log_dir), "--eval_every", "10"]
    sft_chat.main([*args, "--steps", "2"])
    assert [c["step"] for c in checkpoints.read(log_dir)] == [2]
    assert [step for step, _ in _values(log_dir, "train_loss")] == [1, 2]

    sft_chat.main([*args, "--steps", "6"])
    recorded = checkpoints.read(log_dir)
    assert [c["step"] for c in recorded] == [2, 6]
    assert recorded[0]["path"] != recorded[1]["path"]  # the rerun trained a run of its own
    assert [step for step, _ in _values(log_dir, "train_loss")] == [1, 2, 3, 4, 5, 6]
    held_out = _values(log_dir, "held_out_loss")
    assert [step for step, _ in held_out] == [0, 2, 6]
    assert held_out[-1][1] < held_out[0][1] - 1.0, held_out
    assert json.loads((log_dir / "config.json").read_text())["steps"] == 6
    assert (log_dir / "loss.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("recipe", "key"), [(dpo, "dpo_margin"), (kto, "kto_margin")], ids=["dpo", "kto"]
)
def test_preference_recipes_raise_the_margin(
    connection: list[str], tmp_path: Path, recipe: ModuleType, key: str
) -> None:
    log_dir = tmp_path / key
    args = ["--model", STUDENT, "--log_dir", str(log_dir), "--steps", "8", "--eval_every", "8"]
    recipe.main([*connection, *args])
    margins = _values(log_dir, "train_margin")
    assert [step for step, _ in margins] == [0, 8]
    # The reference is the trainer's own forward on the initial weights, so the policy starts
    # exactly at it: no sampler/trainer difference shifts the margins.
    assert margins[0][1] == 0.0
    assert _values(log_dir, "held_out_margin")[0][1] == 0.0
    assert margins[-1][1] > 0.2, margins
    assert len(_values(log_dir, key)) == 8
    reference = json.loads((log_dir / "reference.json").read_text())
    assert reference.keys() == {"options", "tokens_sha256", "train", "held_out"}
    assert (log_dir / "margin.png").exists()

    # A resume on other pairs would pair the reference with the wrong replies: it is refused.
    saved = checkpoints.read(log_dir)
    with pytest.raises(SystemExit, match=r"with --seed 0 \(this run: 1\)"):
        recipe.main([*connection, *args, "--steps", "10", "--seed", "1"])
    assert checkpoints.read(log_dir) == saved  # it stopped before training


def test_distill_lowers_the_kl_to_the_teacher(connection: list[str], tmp_path: Path) -> None:
    log_dir = tmp_path / "distill"
    distill.main(
        [
            *connection,
            "--model", STUDENT,
            "--teacher_model", TEACHER,
            "--log_dir", str(log_dir),
            "--steps", "8",
            "--eval_every", "8",
        ]
    )  # fmt: skip
    held_out = _values(log_dir, "held_out_kl")
    assert [step for step, _ in held_out] == [0, 8]
    assert held_out[1][1] < 0.9 * held_out[0][1], held_out
    kl = [value for _, value in _values(log_dir, "kl")]
    assert kl[-1] < kl[0], kl
    assert (log_dir / "kl.png").exists()
