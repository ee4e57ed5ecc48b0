"""tinker-cookbook 0.6.1 recipes, their code unchanged, against an embedded Treadle server.

Offline: the tiny model `treadle/tiny-1m` is served under an alias that is a local folder
path, and that folder holds the tokenizer fetched from the server's tokenizer endpoint.
The cookbook's `get_tokenizer(model_name)` loads a local folder without the Hugging Face
hub, and the same string is what the recipes send the server as `base_model`. Recipes run
as subprocesses (`python -m tinker_cookbook.recipes...` with CLI arguments only), talking
to the server over 127.0.0.1 through TINKER_BASE_URL / TINKER_API_KEY.

Install (its tml-renderers requirement is not installable, and not used here):
    pip install --no-deps tinker-cookbook==0.6.1
    pip install chz pillow datasets blobfile termcolor math-verify pylatexenc
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("tinker_cookbook")

from sqlalchemy import select

from core.db import Database
from core.tables import ModelVersion, Operation, SamplingSession, TrainingRun
from scheduler.ops import OpKind, decode_json_payload
from tests.builders import tenant_factory
from tests.server import build_app, running_server
from treadle.wire import decode_forward_backward_request

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SERVED_MODEL = "treadle/tiny-1m"
CHAT_FILE = Path(__file__).resolve().parents[1] / "data" / "cookbook_chat.jsonl"
RECIPE_TIMEOUT_S = 240
SL_RECIPE = "tinker_cookbook.recipes.chat_sl.train"
RL_RECIPE = "tinker_cookbook.recipes.math_rl.train"


@dataclass
class CookbookServer:
    base_url: str
    api_key: str
    tokenizer_dir: Path  # also the model name the recipes use: an alias of SERVED_MODEL
    database: Database
    home: Path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CookbookServer]:
    root = tmp_path_factory.mktemp("cookbook")
    tokenizer_dir = root / "tiny-1m-tokenizer"
    app = build_app(root, model_aliases={str(tokenizer_dir): SERVED_MODEL})
    database = app.state.treadle.database
    with running_server(app) as base_url:
        key = tenant_factory(database, app.state.treadle.settings)().key
        _fetch_tokenizer(base_url, key, tokenizer_dir)
        home = root / "home"
        home.mkdir()
        yield CookbookServer(base_url, key, tokenizer_dir, database, home)


def _fetch_tokenizer(base_url: str, key: str, folder: Path) -> None:
    """Download the served model's tokenizer files (published once the engine has started)."""
    headers = {"X-API-Key": key}
    listing = f"{base_url}/api/v1/models/{SERVED_MODEL}/tokenizer"
    deadline = time.monotonic() + 60
    with httpx.Client(headers=headers, timeout=30) as http:
        while (response := http.get(listing)).status_code == 404:
            assert time.monotonic() < deadline, f"tokenizer never published: {response.text}"
            time.sleep(0.5)
        response.raise_for_status()
        files = response.json()["files"]
        assert "tokenizer.json" in files
        folder.mkdir(parents=True)
        for name in files:
            file = http.get(f"{listing}/{name}")
            file.raise_for_status()
            (folder / name).write_bytes(file.content)


def _run_recipe(server: CookbookServer, module: str, log_path: Path, *args: str) -> str:
    """Run a cookbook recipe as `python -m module key=value...`; returns its output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKER_", "HF_"))}
    env.update(
        HOME=str(server.home),  # no stored credentials, no HF cache of the developer
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TINKER_TELEMETRY="0",
        TINKER_BASE_URL=server.base_url,
        TINKER_API_KEY=server.api_key,
        OMP_NUM_THREADS="1",
    )
    command = [
        sys.executable, "-m", module,
        f"model_name={server.tokenizer_dir}", "renderer_name=role_colon", "lora_rank=8",
        f"log_path={log_path}", *args,
    ]  # fmt: skip
    done = subprocess.run(
        command, env=env, cwd=server.home, capture_output=True, text=True,
        timeout=RECIPE_TIMEOUT_S, check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr
    (log_path.parent / f"{log_path.name}.out").write_text(output)
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{output[-6000:]}"
    return output


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _step_rows(log_path: Path) -> dict[int, dict[str, Any]]:
    """metrics.jsonl rows of training steps (the final totals row has no optimizer metrics)."""
    return {row["step"]: row for row in _jsonl(log_path / "metrics.jsonl") if "step:max" in row}


def _run_id(tinker_path: str) -> str:
    return tinker_path.removeprefix("tinker://").split("/")[0]


def _ops(server: CookbookServer, run_id: str) -> list[Operation]:
    with server.database.reader() as db:
        rows = db.scalars(
            select(Operation).where(Operation.target_id == run_id).order_by(Operation.seq_id)
        )
        return list(rows)


def _count(ops: list[Operation], kind: OpKind) -> int:
    return sum(op.kind == kind.value for op in ops)


def _loss_fns(ops: list[Operation]) -> set[str]:
    losses = set()
    for op in ops:
        if op.kind == OpKind.FORWARD_BACKWARD.value:
            encoding = op.payload_codec.split("+")[1]
            losses.add(decode_forward_backward_request(op.payload, encoding).loss_fn)
    return losses


def _run(server: CookbookServer, run_id: str) -> TrainingRun:
    with server.database.reader() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        return run


def test_chat_sl_on_a_jsonl_file_trains_and_resumes_with_its_optimizer_state(
    server: CookbookServer, tmp_path: Path
) -> None:
    log_path = tmp_path / "chat_sl"
    # 48 chats / batch 8 = 6 steps; a checkpoint every 2 steps.
    args = [
        f"dataset={CHAT_FILE}", "batch_size=8", "learning_rate=2e-3", "lr_schedule=constant",
        "save_every=2", "eval_every=0", "infrequent_eval_every=0",
    ]  # fmt: skip
    _run_recipe(server, SL_RECIPE, log_path, *args, "behavior_if_log_dir_exists=delete")

    first = _step_rows(log_path)
    assert sorted(first) == [0, 1, 2, 3, 4, 5]
    nll = [first[step]["train_mean_nll"] for step in range(6)]
    assert nll[-1] < nll[0] - 0.3, f"SFT loss did not fall: {nll}"
    assert [first[step]["step:max"] for step in range(6)] == [1, 2, 3, 4, 5, 6]

    records = _jsonl(log_path / "checkpoints.jsonl")
    assert [r["name"] for r in records] == ["000002", "000004", "final"]
    run_id = _run_id(records[0]["state_path"])
    ops = _ops(server, run_id)
    assert all(op.status == "done" for op in ops)
    assert _count(ops, OpKind.FORWARD_BACKWARD) == _count(ops, OpKind.OPTIM_STEP) == 6
    assert _loss_fns(ops) == {"cross_entropy"}
    # The local tokenizer path is what the recipe sends as base_model: an alias of tiny-1m.
    assert _run(server, run_id).base_model == str(server.tokenizer_dir)

    # Resume from the step-2 checkpoint, as if the run had died after saving it: re-append
    # that record so it is the last one (the final record marks the epoch as complete).
    resume_from = records[0]
    with (log_path / "checkpoints.jsonl").open("a") as f:
        f.write(json.dumps(resume_from) + "\n")
    output = _run_recipe(server, SL_RECIPE, log_path, *args, "behavior_if_log_dir_exists=resume")
    assert f"Resumed training from {resume_from['state_path']}" in output
    # GET training_runs/{id} returned the renderer name the first run stored in user_metadata.
    assert f"Renderer metadata matches for checkpoint {resume_from['state_path']}" in output

    # The server created the new run by loading that checkpoint with its optimizer state.
    resumed_id = _run_id(_jsonl(log_path / "checkpoints.jsonl")[-1]["state_path"])
    assert resumed_id != run_id
    resumed_ops = _ops(server, resumed_id)
    assert resumed_ops[0].kind == OpKind.LOAD_WEIGHTS.value
    load = decode_json_payload(resumed_ops[0].payload, resumed_ops[0].payload_codec)
    assert (load["path"], load["optimizer"]) == (resume_from["state_path"], True)
    assert all(op.status == "done" for op in resumed_ops)
    assert _count(resumed_ops, OpKind.OPTIM_STEP) == 4  # batches 2..5

    # The loop continues at batch 2, and the optimizer's step counter continues from the one
    # saved in the checkpoint (the cookbook saves after submitting the next step, so that
    # counter can be ahead of the checkpoint's batch; a fresh optimizer would report 1).
    with server.database.reader() as db:
        saved = db.scalar(
            select(ModelVersion).where(ModelVersion.tinker_path == resume_from["state_path"])
        )
        assert saved is not None and saved.step is not None
        saved_steps = saved.step
    assert saved_steps >= 2
    second = _step_rows(log_path)
    assert sorted(second) == [0, 1, 2, 3, 4, 5]
    assert [second[step]["step:max"] for step in range(2, 6)] == [
        saved_steps + i for i in range(1, 5)
    ]
    assert [second[step]["train_mean_nll"] for step in (0, 1)] == nll[:2]  # kept rows
    assert second[5]["train_mean_nll"] < nll[0] - 0.3
    # The server's own count follows: the resumed run's final checkpoint is at step saved + 4.
    assert _run(server, resumed_id).optim_steps == saved_steps + 4
    with server.database.reader() as db:
        final = db.scalar(
            select(ModelVersion).where(
                ModelVersion.tinker_path == f"tinker://{resumed_id}/weights/final"
            )
        )
        assert final is not None and final.step == saved_steps + 4


def _math_rl_args(steps: int, loss_fn: str = "importance_sampling") -> list[str]:
    # math_rl defaults to loss_fn=stable_reinforce, which needs record_stability_info on
    # samples and provenance spans; Treadle rejects that with a clear error, so these runs
    # choose another loss through the recipe's own config.
    return [
        "env=arithmetic", f"loss_fn={loss_fn}", "groups_per_batch=2", "group_size=2",
        "max_tokens=5", f"max_steps={steps}", "eval_every=0", "save_every=0",
        "behavior_if_log_dir_exists=delete",
    ]  # fmt: skip


def _check_rl_run(
    server: CookbookServer, log_path: Path, steps: int, loss_fn: str = "importance_sampling"
) -> tuple[str, dict[int, dict[str, Any]]]:
    rows = _step_rows(log_path)
    assert sorted(rows) == list(range(steps))
    for step, row in rows.items():
        assert row["step:max"] == step + 1
        assert row["env/all/total_episodes"] == 4  # 2 groups of 2
        assert row["tokens/sampled"] > 0
        assert "optim/kl_sample_train_v1" in row  # needs per-token logprobs from the loss
    records = _jsonl(log_path / "checkpoints.jsonl")
    assert records[-1]["name"] == "final"
    run_id = _run_id(records[-1]["state_path"])
    ops = _ops(server, run_id)
    assert all(op.status == "done" for op in ops)
    assert _count(ops, OpKind.FORWARD_BACKWARD) == _count(ops, OpKind.OPTIM_STEP) == steps
    assert _loss_fns(ops) == {loss_fn}
    return run_id, rows


def test_math_rl_arithmetic_sync(server: CookbookServer, tmp_path: Path) -> None:
    log_path = tmp_path / "math_rl_sync"
    _run_recipe(server, RL_RECIPE, log_path, *_math_rl_args(2))
    run_id, rows = _check_rl_run(server, log_path, 2)
    # On-policy: the sampler and the trainer score the sampled tokens alike.
    for row in rows.values():
        assert abs(row["optim/kl_sample_train_v1"]) < 1e-3
    with server.database.reader() as db:
        samplers = list(
            db.scalars(select(SamplingSession).where(SamplingSession.training_run_id == run_id))
        )
        samples = db.scalars(
            select(Operation).where(
                Operation.target_id.in_([s.id for s in samplers]),
                Operation.kind == OpKind.SAMPLE.value,
            )
        ).all()
    # Each step samples its 4 rollouts (one request each) from a fresh nameless snapshot.
    assert len(samples) == 2 * 4
    assert all(op.status == "done" for op in samples)
    assert len({op.target_id for op in samples}) == 2


def test_math_rl_arithmetic_with_gspo_and_no_sequence_ratio_mask(
    server: CookbookServer, tmp_path: Path
) -> None:
    log_path = tmp_path / "math_rl_gspo"
    _run_recipe(server, RL_RECIPE, log_path, *_math_rl_args(1, "gspo"))
    run_id, _ = _check_rl_run(server, log_path, 1, "gspo")
    # The cookbook sends no sequence_ratio_mask, so the server's default was what ran.
    for op in _ops(server, run_id):
        if op.kind == OpKind.FORWARD_BACKWARD.value:
            encoding = op.payload_codec.split("+")[1]
            request = decode_forward_backward_request(op.payload, encoding)
            assert request.data
            assert all("sequence_ratio_mask" not in d.loss_fn_inputs for d in request.data)


def test_math_rl_arithmetic_async(server: CookbookServer, tmp_path: Path) -> None:
    log_path = tmp_path / "math_rl_async"
    _run_recipe(server, RL_RECIPE, log_path, *_math_rl_args(3), "max_steps_off_policy=1")
    run_id, rows = _check_rl_run(server, log_path, 3)
    assert all("async/staleness_max" in row for row in rows.values())
    # Async rollouts sample from named sampler checkpoints (create_sampling_client(model_path)).
    with server.database.reader() as db:
        from_paths = db.scalars(
            select(SamplingSession.model_path).where(
                SamplingSession.model_path.is_not(None),
                SamplingSession.model_path.startswith(f"tinker://{run_id}/sampler_weights/"),
            )
        ).all()
    assert from_paths
