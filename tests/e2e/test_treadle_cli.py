"""The `treadle` command in scripts: --json and --plain listings, global options, paging."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from rich.console import Console
from typer.testing import CliRunner

import treadle
from tests.server import LiveServer
from treadle import cli, types

pytestmark = pytest.mark.e2e

MODEL = "treadle/tiny-1m"


@pytest.fixture(scope="module")
def account(live_server: LiveServer) -> Iterator[tuple[str, str, str, list[str]]]:
    """A tenant with one run, three checkpoints (oldest first) and some billed tokens."""
    key = live_server.make_tenant().key
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=2, seed=1)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
        trainer.forward_backward([datum]).result(timeout=120)
        paths = [trainer.save_state(f"step-{i}").result(timeout=120).path for i in range(3)]
        yield live_server.base_url, key, trainer.model_id, paths


def _invoke(*args: str, monkeypatch: pytest.MonkeyPatch | None = None) -> str:
    result = CliRunner().invoke(cli.app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture(autouse=True)
def _narrow_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tables wrap at this width; --plain and --json must not.
    monkeypatch.setattr(cli, "console", Console(width=40, emoji=False, highlight=False))
    monkeypatch.delenv("TREADLE_BASE_URL", raising=False)
    monkeypatch.delenv("TREADLE_API_KEY", raising=False)


def test_global_options_before_the_command(account: tuple[str, str, str, list[str]]) -> None:
    url, key, run_id, _ = account
    listed = json.loads(_invoke("--base-url", url, "--api-key", key, "runs", "--json"))
    assert [run["training_run_id"] for run in listed["training_runs"]] == [run_id]
    assert listed["cursor"]["total_count"] == 1


def test_an_option_after_the_command_wins_over_one_before(
    account: tuple[str, str, str, list[str]],
) -> None:
    url, key, run_id, _ = account
    result = CliRunner().invoke(
        cli.app,
        [
            "--base-url",
            url,
            "--api-key",
            "tml-000000000000-wrong",
            "runs",
            "--api-key",
            key,
            "--plain",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.output.split("\t")[0] == run_id
    refused = CliRunner().invoke(
        cli.app, ["--base-url", url, "--api-key", key, "runs", "--api-key", "tml-000000000000-no"]
    )
    assert refused.exit_code == 1


def test_checkpoints_plain_is_one_unwrapped_line_per_item_and_pages_with_offset(
    account: tuple[str, str, str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, key, run_id, paths = account
    monkeypatch.setenv("TREADLE_BASE_URL", url)
    monkeypatch.setenv("TREADLE_API_KEY", key)
    lines = _invoke("checkpoints", "--plain").splitlines()
    assert [line.split("\t")[0] for line in lines] == paths[::-1]  # newest first
    assert all(len(line.split("\t")) == 6 for line in lines)
    second = _invoke("checkpoints", "--plain", "--offset", "1", "--limit", "1").splitlines()
    assert [line.split("\t")[0] for line in second] == [paths[1]]
    in_run = _invoke("checkpoints", "--run", run_id, "--plain", "--offset", "2").splitlines()
    assert len(in_run) == 1 and in_run[0].split("\t")[0] in paths
    document = json.loads(_invoke("checkpoints", "--json", "--offset", "2"))
    assert [c["tinker_path"] for c in document["checkpoints"]] == [paths[0]]


def test_usage_until_and_both_outputs(
    account: tuple[str, str, str, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, key, _, _ = account
    monkeypatch.setenv("TREADLE_BASE_URL", url)
    monkeypatch.setenv("TREADLE_API_KEY", key)
    everything = json.loads(_invoke("usage", "--json"))
    assert everything["lines"], everything
    assert json.loads(_invoke("usage", "--json", "--until", "2000-01-01"))["lines"] == []
    assert _invoke("usage", "--plain", "--until", "2000-01-01") == ""
    plain = [line.split("\t") for line in _invoke("usage", "--plain").splitlines()]
    assert sorted((line[1], int(line[2])) for line in plain) == sorted(
        (line["kind"], line["quantity"]) for line in everything["lines"]
    )
    both = CliRunner().invoke(cli.app, ["usage", "--json", "--plain"])
    assert both.exit_code == 2 and "not both" in both.output
