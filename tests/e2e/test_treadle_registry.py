"""The registry through the treadle SDK's RestClient and the `treadle registry` commands,
against a live server whose engine saved real checkpoints."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from rich.console import Console
from typer.testing import CliRunner

import treadle
from tests.server import LiveServer
from treadle import cli

pytestmark = pytest.mark.e2e

MODEL = "treadle/tiny-1m"


@pytest.fixture(scope="module")
def account(live_server: LiveServer) -> Iterator[tuple[str, str, str]]:
    """A tenant whose run saved two checkpoints: (base URL, key, run id)."""
    key = live_server.make_tenant().key
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=2, seed=1)
        for name in ("first", "second"):
            trainer.save_state(name).result(timeout=120)
        yield live_server.base_url, key, trainer.model_id


@pytest.fixture(autouse=True)
def _environment(monkeypatch: pytest.MonkeyPatch, account: tuple[str, str, str]) -> None:
    for name, stderr in (("console", False), ("errors", True)):
        wide = Console(width=300, stderr=stderr, emoji=False, highlight=False)
        monkeypatch.setattr(cli, name, wide)
    monkeypatch.setenv("TREADLE_BASE_URL", account[0])
    monkeypatch.setenv("TREADLE_API_KEY", account[1])


def _invoke(*args: str, exit_code: int = 0) -> str:
    result = CliRunner().invoke(cli.app, ["registry", *args])
    assert result.exit_code == exit_code, result.output
    return result.output


def test_the_sdk_manages_packages_versions_and_aliases(account: tuple[str, str, str]) -> None:
    url, key, run_id = account
    with treadle.RestClient(base_url=url, api_key=key) as rest:
        versions = rest.list_versions(run_id).result(timeout=60).versions
        assert [v.version for v in versions] == [2, 1]
        assert versions[0].files and versions[0].sha256 and versions[0].aliases == ["latest"]
        package = rest.create_package("sdk-prod", MODEL, tags=["sdk"]).result(timeout=60)
        assert (package.name, package.tags, package.version_count) == ("sdk-prod", ["sdk"], 0)
        promoted = rest.promote_version(run_id, 1, "sdk-prod").result(timeout=60)
        assert (promoted.version, promoted.source_version) == (1, f"{run_id}:1")
        assert promoted.sha256 == versions[1].sha256
        alias = rest.set_alias("sdk-prod", "production", 1).result(timeout=60)
        assert (alias.name, alias.version) == ("production", 1)
        with pytest.raises(treadle.BadRequestError, match="production"):
            rest.delete_version("sdk-prod", 1).result(timeout=60)
        graph = rest.get_lineage("sdk-prod").result(timeout=60)
        assert {e.relation for e in graph.edges} == {"saved", "promoted"}
        assert rest.list_packages(tag="sdk").result(timeout=60).cursor.total_count == 1
        rest.delete_alias("sdk-prod", "production").result(timeout=60)
        rest.delete_version("sdk-prod", 1).result(timeout=60)
        assert rest.get_package("sdk-prod").result(timeout=60).version_count == 0
        rest.delete_package("sdk-prod").result(timeout=60)
        with pytest.raises(treadle.NotFoundError):
            rest.get_package("sdk-prod").result(timeout=60)


def test_the_cli_commands(account: tuple[str, str, str]) -> None:
    _, _, run_id = account
    created = _invoke("create", "cli-prod", "--base-model", MODEL, "--tag", "x")
    assert "created package cli-prod" in created
    taken = _invoke("create", "cli-prod", "--base-model", MODEL, exit_code=1)
    assert "is taken" in taken
    # The run already saves into its own package.
    assert "already saves into" in _invoke("create", "other", "--run", run_id, exit_code=1)
    assert "promoted" in _invoke("promote", run_id, "2", "cli-prod")
    assert "cli-prod@stable" in _invoke("alias", "cli-prod", "stable", "1")
    listed = json.loads(_invoke("packages", "--tag", "x", "--json"))
    assert [p["name"] for p in listed["packages"]] == ["cli-prod"]
    lines = _invoke("versions", "cli-prod", "--plain").splitlines()
    assert [line.split("\t")[0] for line in lines] == ["1"]
    assert "latest, stable" in lines[0]
    assert "production" not in _invoke("package", "cli-prod")
    shown = json.loads(_invoke("version", "cli-prod", "1", "--json"))
    assert shown["source_version"] == f"{run_id}:2"
    assert "promoted" in _invoke("lineage", "cli-prod", "--plain")
    assert "renamed" in _invoke("rename", "cli-prod", "cli-main")
    refused = _invoke("delete", "cli-main", exit_code=1)
    assert "stable" in refused
    _invoke("unalias", "cli-main", "stable")
    assert "deleted package cli-main" in _invoke("delete", "cli-main")


def test_concurrent_saves_and_promotions_get_distinct_consecutive_versions(
    live_server: LiveServer,
) -> None:
    """Twenty saves submitted at once, while twenty promotions land in the same package from
    other threads, number the package's versions 1..40 with no gap and no repeat."""
    key = live_server.make_tenant().key
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=key) as service:
        donor = service.create_lora_training_client(MODEL, rank=2, seed=3)
        donor.save_state("donor").result(timeout=120)
        trainer = service.create_lora_training_client(MODEL, rank=2, seed=4)
        trainer.save_state("first").result(timeout=120)
        rest = service.create_rest_client()
        saves = [trainer.save_state(f"save-{i}") for i in range(19)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            promotions = [
                pool.submit(
                    lambda: rest.promote_version(donor.model_id, 1, trainer.model_id).result(
                        timeout=120
                    )
                )
                for _ in range(20)
            ]
            promoted = [future.result().version for future in promotions]
        for save in saves:
            save.result(timeout=120)
        listed = rest.list_versions(trainer.model_id, limit=100).result(timeout=60).versions
    numbers = sorted(v.version for v in listed)
    assert numbers == list(range(1, 41))
    assert len(set(promoted)) == 20
    saved = sorted(v.version for v in listed if v.tinker_path is not None)
    assert len(saved) == 20 and saved[0] == 1
