"""tinker's RestClient against an embedded server: runs, checkpoints, publishing, TTLs and
downloads through signed URLs, with two tenants that never see each other's objects."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from sqlalchemy import select
from tinker import types

from core.signing import sign_download
from core.tables import ModelVersion
from tests.scenarios import MODEL, sft_datum
from tests.server import LiveServer, tinker_cli

pytestmark = pytest.mark.e2e

SECRET = b"test-secret-0123456789abcdef"  # make_settings' server secret
METADATA = {"renderer_name": "llama3", "purpose": "rest-test"}


@dataclass
class World:
    server: LiveServer
    owner_key: str
    owner_tenant: str
    other_key: str
    owner: tinker.ServiceClient
    other: tinker.ServiceClient
    run_id: str
    state_path: str
    sampler_path: str
    external_path: str

    def rest(self, key: str | None = None) -> tinker.RestClient:
        return tinker.RestClient(base_url=self.server.base_url, api_key=key or self.owner_key)

    def http(self, key: str) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.server.base_url}/api/v1", headers={"X-API-Key": key}, timeout=60
        )

    def version(self, path: str) -> ModelVersion | None:
        with self.server.database.reader() as db:
            row = db.scalar(select(ModelVersion).where(ModelVersion.tinker_path == path))
            if row is not None:
                db.expunge(row)
            return row


@pytest.fixture(scope="module")
def world(live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))  # no stored credentials
        owner_tenant, other_tenant = live_server.make_tenant(), live_server.make_tenant()
        owner = tinker.ServiceClient(base_url=live_server.base_url, api_key=owner_tenant.key)
        other = tinker.ServiceClient(base_url=live_server.base_url, api_key=other_tenant.key)
        trainer = owner.create_lora_training_client(
            base_model=MODEL, rank=4, seed=1, train_unembed=False, user_metadata=METADATA
        ).result()
        trainer.forward_backward([sft_datum(0)], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state_path = trainer.save_state("a").result().path
        sampler_path = trainer.save_weights_for_sampler("b").result().path
        external_path = trainer.save_weights_external("c").result().path
        yield World(
            live_server,
            owner_tenant.key,
            owner_tenant.tenant_id,
            other_tenant.key,
            owner,
            other,
            trainer.model_id,
            state_path,
            sampler_path,
            external_path,
        )
        owner.close("success").result(timeout=60)
        other.close("success").result(timeout=60)


def _paths(listing: types.CheckpointsListResponse) -> set[str]:
    return {c.tinker_path for c in listing.checkpoints}


def test_training_run_round_trips_its_metadata(world: World) -> None:
    rest = world.rest()
    listed = rest.list_training_runs().result()
    assert world.run_id in [r.training_run_id for r in listed.training_runs]
    assert listed.cursor.total_count >= 1
    run = rest.get_training_run(world.run_id).result()
    assert run.user_metadata == METADATA
    assert (run.base_model, run.model_owner, run.is_lora, run.lora_rank, run.corrupted) == (
        MODEL,
        world.owner_tenant,
        True,
        4,
        False,
    )
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == world.state_path
    assert run.last_sampler_checkpoint is not None
    assert run.last_sampler_checkpoint.tinker_path == world.sampler_path
    assert run.last_request_time <= datetime.now(UTC)
    by_path = rest.get_training_run_by_tinker_path(world.sampler_path).result()
    assert by_path.training_run_id == world.run_id


def test_checkpoint_listings(world: World) -> None:
    rest = world.rest()
    per_run = rest.list_checkpoints(world.run_id).result()
    assert {world.state_path, world.sampler_path, world.external_path} <= _paths(per_run)
    kinds = {c.checkpoint_id: c.checkpoint_type for c in per_run.checkpoints}
    assert kinds["weights/a"] == "training"
    assert kinds["sampler_weights/b"] == "sampler"
    assert kinds["external_weights/c"] == "external"
    assert all(c.size_bytes and c.size_bytes > 0 for c in per_run.checkpoints)
    mine = rest.list_user_checkpoints().result()
    assert {world.state_path, world.sampler_path, world.external_path} <= _paths(mine)
    assert mine.cursor is not None and mine.cursor.total_count == len(mine.checkpoints)
    page = rest.list_user_checkpoints(limit=1, offset=1).result()
    assert len(page.checkpoints) == 1 and page.checkpoints[0] == mine.checkpoints[1]


def test_weights_info(world: World) -> None:
    info = world.rest().get_weights_info_by_tinker_path(world.state_path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (MODEL, True, 4)
    assert (info.train_unembed, info.train_mlp, info.train_attn) == (False, True, True)


def test_external_weights_download_through_signed_urls(world: World) -> None:
    response = world.rest().get_external_weights_urls(world.external_path).result()
    assert response.expires > datetime.now(UTC) + timedelta(minutes=50)
    version = world.version(world.external_path)
    assert version is not None and version.artifact_uri is not None
    root = Path(version.artifact_uri.removeprefix("file://"))
    stored = {
        p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()
    }
    assert set(response.urls) == set(stored) and "adapter_config.json" in stored
    for relpath, url in response.urls.items():
        with urllib.request.urlopen(url, timeout=30) as download:  # no API key, as the CLI does
            assert download.read() == stored[relpath]

    url = response.urls["adapter_config.json"]
    prefix, token, name = url.rsplit("/", 2)
    payload, signature = token.split(".")
    tampered = (
        f"{prefix}/{payload}.{signature[:-2]}{'AA' if signature[-2:] != 'AA' else 'BB'}/{name}"
    )
    other_file = f"{prefix}/{token}/{next(p for p in stored if p != name)}"
    stale = sign_download(SECRET, version.id, name, datetime.now(UTC) - timedelta(seconds=1))
    expired = f"{prefix}/{stale}/{name}"
    for bad, reason in ((tampered, "invalid"), (other_file, "invalid"), (expired, "expired")):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=30)
        assert refused.value.code == 403
        detail = json.loads(refused.value.read())["detail"]
        assert reason in detail and "request new URLs" in detail


def test_ttl_can_be_set_and_removed(world: World) -> None:
    rest = world.rest()
    rest.set_checkpoint_ttl_from_tinker_path(world.sampler_path, 7200).result()
    version = world.version(world.sampler_path)
    assert version is not None and version.expires_at is not None
    remaining = version.expires_at - datetime.now(UTC)
    assert timedelta(minutes=110) < remaining <= timedelta(hours=2)
    listed = {c.tinker_path: c for c in rest.list_checkpoints(world.run_id).result().checkpoints}
    assert listed[world.sampler_path].expires_at == version.expires_at

    with pytest.raises(tinker.UnprocessableEntityError, match="3600"):
        rest.set_checkpoint_ttl_from_tinker_path(world.sampler_path, 60).result()
    unchanged = world.version(world.sampler_path)
    assert unchanged is not None and unchanged.expires_at == version.expires_at

    rest.set_checkpoint_ttl_from_tinker_path(world.sampler_path, None).result()
    cleared = world.version(world.sampler_path)
    assert cleared is not None and cleared.expires_at is None


def test_published_checkpoint_is_loadable_by_another_tenant_until_unpublished(
    world: World,
) -> None:
    owner, other = world.rest(), world.rest(world.other_key)
    with pytest.raises(tinker.NotFoundError):
        world.other.create_training_client_from_state(world.state_path).result()

    owner.publish_checkpoint_from_tinker_path(world.state_path).result()
    owner.publish_checkpoint_from_tinker_path(world.state_path).result()  # idempotent
    listed = {c.tinker_path: c for c in owner.list_checkpoints(world.run_id).result().checkpoints}
    assert listed[world.state_path].public
    loaded = world.other.create_training_client_from_state(world.state_path).result()
    assert loaded.get_info().model_data.model_name == MODEL
    assert other.get_weights_info_by_tinker_path(world.state_path).result().lora_rank == 4
    seen = other.get_training_run(world.run_id, access_scope="accessible").result()
    assert seen.last_checkpoint is not None and seen.last_checkpoint.public
    # Published is readable, not owned: the other tenant's listings and owner routes still 404.
    assert world.state_path not in _paths(other.list_user_checkpoints().result())
    with pytest.raises(tinker.NotFoundError):
        other.get_training_run(world.run_id).result()
    with pytest.raises(tinker.NotFoundError):
        other.unpublish_checkpoint_from_tinker_path(world.state_path).result()

    owner.unpublish_checkpoint_from_tinker_path(world.state_path).result()
    owner.unpublish_checkpoint_from_tinker_path(world.state_path).result()  # never a 409
    with pytest.raises(tinker.NotFoundError):
        world.other.create_training_client_from_state(world.state_path).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_training_run(world.run_id, access_scope="accessible").result()


def test_deleted_checkpoint_is_gone_everywhere(world: World) -> None:
    trainer = world.owner.create_lora_training_client(base_model=MODEL, rank=4).result()
    path = trainer.save_weights_external("doomed").result().path
    rest = world.rest()
    urls = rest.get_external_weights_urls(path).result().urls
    version = world.version(path)
    assert version is not None and version.artifact_uri is not None
    folder = Path(version.artifact_uri.removeprefix("file://"))
    assert folder.is_dir()

    rest.delete_checkpoint_from_tinker_path(path).result()
    assert path not in _paths(rest.list_checkpoints(trainer.model_id).result())
    assert path not in _paths(rest.list_user_checkpoints().result())
    assert not folder.exists()
    with pytest.raises(tinker.NotFoundError):
        world.owner.create_training_client_from_state(path).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(next(iter(urls.values())), timeout=30)
    assert refused.value.code == 404
    # The name is free again.
    assert trainer.save_weights_external("doomed").result().path == path


def test_sampling_client_on_a_deleted_checkpoint_gets_a_user_error(world: World) -> None:
    trainer = world.owner.create_lora_training_client(base_model=MODEL, rank=4).result()
    path = trainer.save_weights_for_sampler("short-lived").result().path
    sampler = world.owner.create_sampling_client(model_path=path).result()
    world.rest().delete_checkpoint_from_tinker_path(path).result()
    # Refused when submitted (404, a user error the SDK does not retry).
    with pytest.raises(tinker.NotFoundError, match="deleted") as failed:
        sampler.sample(
            types.ModelInput.from_ints([5, 6]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    assert isinstance(failed.value.body, dict) and failed.value.body["category"] == "user"


def test_every_endpoint_answers_404_for_foreign_ids(world: World) -> None:
    run = world.run_id
    with world.http(world.other_key) as http:
        for path in (world.state_path, world.external_path):
            checkpoint = path.removeprefix(f"tinker://{run}/")
            base = f"/training_runs/{run}/checkpoints/{checkpoint}"
            attempts = {
                "get run": http.get(f"/training_runs/{run}"),
                "list checkpoints": http.get(f"/training_runs/{run}/checkpoints"),
                "delete": http.delete(base),
                "publish": http.post(f"{base}/publish"),
                "unpublish": http.delete(f"{base}/publish"),
                "ttl": http.put(f"{base}/ttl", json={"ttl_seconds": 7200}),
                "urls": http.get(f"{base}/external_weights_urls"),
                "weights_info": http.post("/weights_info", json={"tinker_path": path}),
            }
            for name, response in attempts.items():
                assert response.status_code == 404, (name, response.text)
                assert "not found" in response.json()["detail"], name
        assert run not in [
            r["training_run_id"] for r in http.get("/training_runs").json()["training_runs"]
        ]
        assert http.get("/checkpoints").json()["checkpoints"] == []
    for path in (world.state_path, world.external_path):
        version = world.version(path)
        assert version is not None and not version.public


def test_bad_input_gets_clear_errors_and_changes_nothing(world: World) -> None:
    before = world.version(world.state_path)
    with world.http(world.owner_key) as http:
        base = f"/training_runs/{world.run_id}/checkpoints"
        cases = {
            "malformed path": (
                http.post("/weights_info", json={"tinker_path": "tinker://run/bogus/x"}),
                422,
                "expected tinker://<run id>/",
            ),
            "not a tinker path": (
                http.post("/weights_info", json={"tinker_path": "s3://bucket/x"}),
                422,
                "must start with tinker://",
            ),
            "unknown kind": (
                http.post(f"{base}/bogus/a/publish"),
                422,
                "'weights', 'sampler_weights' or 'external_weights'",
            ),
            "ttl too short": (
                http.put(f"{base}/weights/a/ttl", json={"ttl_seconds": 10}),
                422,
                "1 hour to 10 years",
            ),
            "ttl too long": (
                http.put(f"{base}/weights/a/ttl", json={"ttl_seconds": 10**10}),
                422,
                "1 hour to 10 years",
            ),
            "ttl missing": (http.put(f"{base}/weights/a/ttl", json={}), 422, "ttl_seconds"),
            "unknown checkpoint": (http.delete(f"{base}/weights/nope"), 404, "not found"),
            "unknown run": (http.get("/training_runs/nope:train:0"), 404, "not found"),
            "bad scope": (http.get("/training_runs?access_scope=everyone"), 422, "access_scope"),
        }
        for name, (response, status, message) in cases.items():
            assert response.status_code == status, (name, response.text)
            assert message in response.json()["detail"], (name, response.text)
    after = world.version(world.state_path)
    assert before is not None and after is not None
    assert (after.status, after.public, after.expires_at) == (
        before.status,
        before.public,
        before.expires_at,
    )


def _tinker_cli(world: World, home: Path, *args: str) -> Any:
    return tinker_cli(world.server.base_url, world.owner_key, home, *args)


def test_tinker_cli_lists_and_downloads_checkpoints(world: World, tmp_path: Path) -> None:
    runs = _tinker_cli(world, tmp_path, "run", "list")
    assert world.run_id in json.dumps(runs)
    external = world.version(world.external_path)
    assert external is not None and external.artifact_uri is not None
    stored = Path(external.artifact_uri.removeprefix("file://"))
    _tinker_cli(
        world, tmp_path, "checkpoint", "download", world.external_path, "-o", str(tmp_path / "x")
    )
    got = tmp_path / "x" / world.external_path.removeprefix("tinker://").replace("/", "_")
    for file in (p for p in stored.rglob("*") if p.is_file()):
        assert (got / file.relative_to(stored)).read_bytes() == file.read_bytes()

    # A training checkpoint goes through a temporary export, deleted after the download.
    before = _paths(world.rest().list_user_checkpoints().result())
    _tinker_cli(
        world, tmp_path, "checkpoint", "download", world.state_path, "-o", str(tmp_path / "t")
    )
    got = tmp_path / "t" / world.state_path.removeprefix("tinker://").replace("/", "_")
    assert {p.name for p in got.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert _paths(world.rest().list_user_checkpoints().result()) == before
