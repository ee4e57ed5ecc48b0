"""The REST surface (runs, checkpoints, weights_info, signed downloads) over HTTP, on SQLite
and PostgreSQL, with a fake clock for TTLs and link expiry. Runs and checkpoints are made
through the core services so that each test sets up in milliseconds; tests/e2e drives the same
endpoints with the tinker SDK."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import select
from tinker import types as tinker_types

from core.signing import sign_download
from core.tables import ModelVersion
from tests.integration.rest_env import FILES, MODEL, Env, open_env
from tests.integration.rest_env import headers as _h

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from open_env(request, tmp_path_factory)


def test_runs_listing_and_view_match_tinker_types(env: Env) -> None:
    tenant = env.make_tenant()
    first = env.seed(tenant, user_metadata={"renderer_name": "qwen3", "epochs": 3})
    env.clock.advance(1)
    second = env.seed(tenant, names=())
    page = env.client.get("/api/v1/training_runs?limit=1", headers=_h(tenant))
    assert page.status_code == 200, page.text
    parsed = tinker_types.TrainingRunsResponse.model_validate(page.json())
    assert [r.training_run_id for r in parsed.training_runs] == [second]  # newest first
    assert (parsed.cursor.offset, parsed.cursor.limit, parsed.cursor.total_count) == (0, 1, 2)

    run = tinker_types.TrainingRun.model_validate(
        env.client.get(f"/api/v1/training_runs/{first}", headers=_h(tenant)).json()
    )
    # Non-string metadata values travel as JSON text: the wire type is {str: str}.
    assert run.user_metadata == {"renderer_name": "qwen3", "epochs": "3"}
    assert (run.model_owner, run.is_lora, run.lora_rank) == (tenant.tenant_id, True, 4)
    assert run.last_checkpoint is not None
    assert run.last_checkpoint.tinker_path == f"tinker://{first}/weights/a"
    assert run.last_sampler_checkpoint is None


def test_checkpoint_listing_and_weights_info(env: Env) -> None:
    tenant = env.make_tenant()
    run_id = env.seed(tenant, names=(("training", "a"), ("sampler", "b"), ("merged", "c")))
    listed = env.client.get(f"/api/v1/training_runs/{run_id}/checkpoints", headers=_h(tenant))
    parsed = tinker_types.CheckpointsListResponse.model_validate(listed.json())
    assert {(c.checkpoint_id, c.checkpoint_type) for c in parsed.checkpoints} == {
        ("weights/a", "training"),
        ("sampler_weights/b", "sampler"),
        ("external_weights/c", "external"),
    }
    assert all(c.size_bytes == sum(map(len, FILES.values())) for c in parsed.checkpoints)
    mine = env.client.get("/api/v1/checkpoints?limit=2&offset=1", headers=_h(tenant)).json()
    assert len(mine["checkpoints"]) == 2 and mine["cursor"]["total_count"] == 3

    info = env.client.post(
        "/api/v1/weights_info",
        json={"tinker_path": f"tinker://{run_id}/sampler_weights/b"},
        headers=_h(tenant),
    )
    parsed_info = tinker_types.WeightsInfoResponse.model_validate(info.json())
    assert (parsed_info.base_model, parsed_info.lora_rank, parsed_info.train_mlp) == (
        MODEL,
        4,
        False,
    )
    assert parsed_info.train_attn and parsed_info.train_unembed


def test_ttl_hides_expired_checkpoints(env: Env) -> None:
    tenant = env.make_tenant()
    run_id = env.seed(tenant, names=(("training", "a"),))
    base = f"/api/v1/training_runs/{run_id}/checkpoints/weights/a"
    assert (
        env.client.put(f"{base}/ttl", json={"ttl_seconds": 3600}, headers=_h(tenant)).status_code
        == 204
    )
    listed = env.client.get(
        f"/api/v1/training_runs/{run_id}/checkpoints", headers=_h(tenant)
    ).json()
    assert listed["checkpoints"][0]["expires_at"] is not None
    env.clock.advance(3601)
    listed = env.client.get(
        f"/api/v1/training_runs/{run_id}/checkpoints", headers=_h(tenant)
    ).json()
    assert listed["checkpoints"] == []
    assert env.client.post(f"{base}/publish", headers=_h(tenant)).status_code == 404
    run = env.client.get(f"/api/v1/training_runs/{run_id}", headers=_h(tenant)).json()
    assert run.get("last_checkpoint") is None


def test_signed_urls_expire_and_follow_public_url(env: Env) -> None:
    tenant = env.make_tenant()
    run_id = env.seed(tenant, names=(("adapter", "c"),))
    base = f"/api/v1/training_runs/{run_id}/checkpoints/external_weights/c"
    env.state.settings.public_url = "https://treadle.example/prefix/"
    try:
        body = env.client.get(f"{base}/external_weights_urls", headers=_h(tenant)).json()
    finally:
        env.state.settings.public_url = None
    parsed = tinker_types.ExternalWeightsUrlsResponse.model_validate(body)
    assert set(parsed.urls) == set(FILES)
    assert all(
        u.startswith("https://treadle.example/prefix/api/v1/artifacts/")
        for u in parsed.urls.values()
    )
    assert parsed.expires == env.clock.now().replace(microsecond=0) + timedelta(hours=1)
    for relpath, url in parsed.urls.items():
        fetched = env.client.get(url.removeprefix("https://treadle.example/prefix"))  # no API key
        assert fetched.status_code == 200 and fetched.content == FILES[relpath]
    env.clock.advance(3600)
    url = parsed.urls["adapter_config.json"].removeprefix("https://treadle.example/prefix")
    refused = env.client.get(url)
    assert refused.status_code == 403 and "expired" in refused.json()["detail"]


def test_download_links_stop_with_the_checkpoint_and_refuse_traversal(env: Env) -> None:
    tenant = env.make_tenant()
    run_id = env.seed(tenant, names=(("adapter", "c"),))
    base = f"/api/v1/training_runs/{run_id}/checkpoints/external_weights/c"
    urls = env.client.get(f"{base}/external_weights_urls", headers=_h(tenant)).json()["urls"]
    url = urls["adapter_config.json"].split("/api/v1/", 1)[1]
    (env.root / "outside.txt").write_text("private")
    with env.state.database.reader() as db:
        version = db.scalar(
            select(ModelVersion).where(
                ModelVersion.tinker_path == f"tinker://{run_id}/external_weights/c"
            )
        )
        assert version is not None
        version_id = version.id
    escape = "../../../outside.txt"
    token = sign_download(
        env.state.server_secret, version_id, escape, env.clock.now() + timedelta(hours=1)
    )
    sneaky = env.client.get(
        f"/api/v1/artifacts/{token}/{escape.replace('.', '%2E').replace('/', '%2F')}"
    )
    assert sneaky.status_code == 404 and "not a file of this checkpoint" in sneaky.json()["detail"]

    assert env.client.delete(base, headers=_h(tenant)).status_code == 204
    gone = env.client.get(f"/api/v1/{url}")
    assert gone.status_code == 404 and "deleted" in gone.json()["detail"]


def test_checkpoints_named_like_suffixes_are_addressable(env: Env) -> None:
    tenant = env.make_tenant()
    run_id = env.seed(
        tenant, names=(("training", "publish"), ("training", "ttl"), ("training", "a"))
    )
    base = f"/api/v1/training_runs/{run_id}/checkpoints/weights"
    assert env.client.post(f"{base}/publish/publish", headers=_h(tenant)).status_code == 204
    assert env.client.delete(f"{base}/ttl", headers=_h(tenant)).status_code == 204
    listed = env.client.get(
        f"/api/v1/training_runs/{run_id}/checkpoints", headers=_h(tenant)
    ).json()
    public = {c["checkpoint_id"]: c["public"] for c in listed["checkpoints"]}
    assert public == {"weights/publish": True, "weights/a": False}


def test_foreign_tenant_sees_nothing_and_changes_nothing(env: Env) -> None:
    owner, intruder = env.make_tenant(), env.make_tenant()
    run_id = env.seed(owner)
    before = env.versions()
    base = f"/api/v1/training_runs/{run_id}/checkpoints/weights/a"
    calls = {
        "get run": env.client.get(f"/api/v1/training_runs/{run_id}", headers=_h(intruder)),
        "accessible run": env.client.get(
            f"/api/v1/training_runs/{run_id}?access_scope=accessible", headers=_h(intruder)
        ),
        "checkpoints": env.client.get(
            f"/api/v1/training_runs/{run_id}/checkpoints", headers=_h(intruder)
        ),
        "delete": env.client.delete(base, headers=_h(intruder)),
        "publish": env.client.post(f"{base}/publish", headers=_h(intruder)),
        "unpublish": env.client.delete(f"{base}/publish", headers=_h(intruder)),
        "ttl": env.client.put(f"{base}/ttl", json={"ttl_seconds": None}, headers=_h(intruder)),
        "urls": env.client.get(f"{base}/external_weights_urls", headers=_h(intruder)),
        "weights_info": env.client.post(
            "/api/v1/weights_info",
            json={"tinker_path": f"tinker://{run_id}/weights/a"},
            headers=_h(intruder),
        ),
    }
    for name, response in calls.items():
        assert response.status_code == 404, (name, response.text)
        assert "not found" in response.json()["detail"], name
    assert (
        env.client.get("/api/v1/training_runs", headers=_h(intruder)).json()["training_runs"] == []
    )
    assert env.client.get("/api/v1/checkpoints", headers=_h(intruder)).json()["checkpoints"] == []
    assert env.versions() == before


def test_rejected_requests_change_nothing(env: Env) -> None:
    tenant = env.make_tenant()
    run_id = env.seed(tenant)
    before = env.versions()
    base = f"/api/v1/training_runs/{run_id}/checkpoints"
    bad = {
        "ttl below range": (
            env.client.put(f"{base}/weights/a/ttl", json={"ttl_seconds": 3599}, headers=_h(tenant)),
            422,
        ),
        "ttl above range": (
            env.client.put(
                f"{base}/weights/a/ttl", json={"ttl_seconds": 10**9}, headers=_h(tenant)
            ),
            422,
        ),
        "ttl not a number": (
            env.client.put(
                f"{base}/weights/a/ttl", json={"ttl_seconds": "soon"}, headers=_h(tenant)
            ),
            422,
        ),
        "ttl extra field": (
            env.client.put(
                f"{base}/weights/a/ttl", json={"ttl_seconds": None, "x": 1}, headers=_h(tenant)
            ),
            422,
        ),
        "unknown kind": (env.client.delete(f"{base}/snapshots/a", headers=_h(tenant)), 422),
        "unknown checkpoint": (
            env.client.post(f"{base}/weights/zzz/publish", headers=_h(tenant)),
            404,
        ),
        "weights_info bad path": (
            env.client.post(
                "/api/v1/weights_info",
                json={"tinker_path": f"tinker://{run_id}/weights"},
                headers=_h(tenant),
            ),
            422,
        ),
        "limit zero": (env.client.get("/api/v1/checkpoints?limit=0", headers=_h(tenant)), 422),
        "no key": (env.client.delete(f"{base}/weights/a"), 401),
    }
    for name, (response, status) in bad.items():
        assert response.status_code == status, (name, response.text)
        assert response.json()["detail"], name
    assert env.versions() == before


def test_session_responses_match_tinker_types(env: Env) -> None:
    tenant = env.make_tenant()
    created = env.client.post(
        "/api/v1/create_session", json={"user_metadata": {"a": "b", "n": 1}}, headers=_h(tenant)
    ).json()["session_id"]
    listed = env.client.get("/api/v1/sessions", headers=_h(tenant)).json()
    assert tinker_types.ListSessionsResponse.model_validate(listed).sessions == [created]
    detail = env.client.get(f"/api/v1/sessions/{created}", headers=_h(tenant)).json()
    parsed = tinker_types.GetSessionResponse.model_validate(detail)
    assert parsed.user_metadata == {"a": "b", "n": "1"}
    assert detail["status"] == "active"
