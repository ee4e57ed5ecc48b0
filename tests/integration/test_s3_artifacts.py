"""An embedded server whose artifacts live in S3-compatible storage (a moto server, real s3fs
and boto3): saves upload and become ready versions, a restarted server with an empty local
folder loads and samples them, an upload that fails half-way leaves a failed version that no
name resolves to, and artifact collection removes what nothing needs any more, once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from core import checkpoints, references, runs, sessions
from core.clock import FakeClock, SystemClock
from core.objectstore import S3ArtifactStore
from core.tables import ModelVersion, TrainingRun, VersionStatus
from scheduler import artifact_gc
from tests.builders import tenant_factory
from tests.fakes.s3 import S3Server
from tests.integration.helpers import DATUM, MODEL, op, result
from tests.server import AppFactory

pytestmark = pytest.mark.integration

PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}


class Server:
    def __init__(self, app: FastAPI, client: TestClient, key: str | None = None) -> None:
        self.app, self.client = app, client
        state = app.state.treadle
        self.database, self.store = state.database, state.store
        self.key = key or tenant_factory(state.database, state.settings)().key
        self.headers = {"X-API-Key": self.key}
        self.session_id = str(
            client.post("/api/v1/create_session", json={}, headers=self.headers).json()[
                "session_id"
            ]
        )

    def op(self, path: str, body: dict[str, Any]) -> dict[str, object]:
        return op(self.client, self.headers, path, body)

    def failure(self, path: str, body: dict[str, Any]) -> dict[str, object]:
        response = self.client.post(f"/api/v1/{path}", json=body, headers=self.headers)
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            answer: dict[str, object] = self.client.post(
                "/api/v1/retrieve_future",
                json={"request_id": response.json()["request_id"]},
                headers=self.headers,
            ).json()
            if answer.get("type") != "try_again":
                assert "error" in answer, answer
                return answer
        raise AssertionError("no result")

    def trained_run(self, seq: int = 0) -> str:
        run_id = str(
            self.op(
                "create_model",
                {
                    "session_id": self.session_id,
                    "model_seq_id": seq,
                    "base_model": MODEL,
                    "lora_config": {"rank": 4, "seed": 3},
                },
            )["model_id"]
        )
        self.op(
            "forward_backward",
            {"model_id": run_id, "seq_id": 1, "data": [DATUM], "loss_fn": "cross_entropy"},
        )
        self.op(
            "optim_step",
            {"model_id": run_id, "seq_id": 2, "adam_params": {"learning_rate": 0.05}},
        )
        return run_id

    def versions(self, run_id: str) -> list[ModelVersion]:
        with self.database.reader() as db:
            return list(
                db.scalars(
                    select(ModelVersion)
                    .where(ModelVersion.training_run_id == run_id)
                    .order_by(ModelVersion.version)
                )
            )


@pytest.fixture
def s3_app(app_factory: AppFactory, s3_artifact_url: str) -> Iterator[Server]:
    app = app_factory(artifact_url=s3_artifact_url)
    with TestClient(app) as client:
        yield Server(app, client)


def test_checkpoints_live_in_the_bucket_and_load_and_sample_on_a_server_without_them(
    app_factory: AppFactory, s3_artifact_url: str, s3_server: S3Server, tmp_path: Path
) -> None:
    app = app_factory(artifact_url=s3_artifact_url)
    with TestClient(app) as client:
        first = Server(app, client)
        assert isinstance(first.store, S3ArtifactStore)
        run_id = first.trained_run()
        path = first.op("save_weights", {"model_id": run_id, "seq_id": 3, "path": "ckpt"})["path"]
        sampler = first.op(
            "save_weights_for_sampler", {"model_id": run_id, "seq_id": 4, "path": "s"}
        )["path"]
        (ready, ready_sampler) = first.versions(run_id)
        assert ready.status == VersionStatus.READY and ready.tinker_path == path
        assert ready.artifact_uri is not None and ready.artifact_uri.startswith(s3_artifact_url)
        assert ready_sampler.status == VersionStatus.READY
        keys = s3_server.keys(ready.artifact_uri)
        assert keys and {f["path"] for f in ready.files or []} == {
            k.rsplit(ready.artifact_uri.partition("/artifacts/")[2] + "/", 1)[1] for k in keys
        }
        key = first.key

    # Another server on the same database and bucket, with an empty data folder: everything it
    # reads comes from the bucket.
    other = app_factory(
        artifact_url=s3_artifact_url,
        data_dir=tmp_path / "elsewhere",
        database_url=app.state.treadle.settings.database_url,
    )
    with TestClient(other) as client:
        second = Server(other, client, key=key)
        loaded = second.op(
            "load_weights",
            {"session_id": second.session_id, "model_seq_id": 0, "path": path, "optimizer": True},
        )
        assert loaded["path"] == path
        created = second.client.post(
            "/api/v1/create_sampling_session",
            json={
                "session_id": second.session_id,
                "sampling_session_seq_id": 0,
                "model_path": sampler,
            },
            headers=second.headers,
        )
        assert created.status_code == 200, created.text
        sampled = second.client.post(
            "/api/v1/asample",
            json={
                "sampling_session_id": created.json()["sampling_session_id"],
                "seq_id": 0,
                "num_samples": 1,
                "prompt": PROMPT,
                "sampling_params": {"max_tokens": 2, "seed": 1},
            },
            headers=second.headers,
        )
        assert sampled.status_code == 200, sampled.text
        out = result(second.client, second.headers, sampled.json()["request_id"])
        assert len(out["sequences"]) == 1  # type: ignore[arg-type]
        assert (tmp_path / "elsewhere" / "artifact-cache").is_dir()
        # The tokenizers the engine published to the store are served from it.
        tokenizer = second.client.get(f"/api/v1/models/{MODEL}/tokenizer", headers=second.headers)
        assert tokenizer.status_code == 200, tokenizer.text
        assert "tokenizer.json" in tokenizer.json()["files"]


def test_an_upload_that_fails_half_way_leaves_a_failed_version_and_no_name(
    s3_app: Server, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = s3_app.trained_run()
    s3_app.op("save_weights", {"model_id": run_id, "seq_id": 3, "path": "good"})
    store = s3_app.store
    assert isinstance(store, S3ArtifactStore)
    upload = store._upload
    uploaded: list[str] = []

    def dies_after_one_file(file: Path, object_path: str) -> None:
        if uploaded:
            raise ConnectionResetError("the connection to the object store was reset")
        upload(file, object_path)
        uploaded.append(object_path)

    monkeypatch.setattr(store, "_upload", dies_after_one_file)
    failed = s3_app.failure("save_weights", {"model_id": run_id, "seq_id": 4, "path": "half"})
    assert failed["category"] == "server"
    monkeypatch.undo()

    good, half = s3_app.versions(run_id)
    assert good.status == VersionStatus.READY
    assert half.status == VersionStatus.FAILED and half.tinker_path is None
    assert half.artifact_uri is not None and s3_server.keys(half.artifact_uri) == [
        name.partition("/")[2] for name in uploaded
    ]
    # Neither its would-be path nor the package's latest version names it.
    missing = s3_app.client.post(
        "/api/v1/weights_info",
        json={"tinker_path": f"tinker://{run_id}/weights/half"},
        headers=s3_app.headers,
    )
    assert missing.status_code == 404, missing.text
    with s3_app.database.reader() as db:
        latest = references.latest_version(db, half.package_id, SystemClock().now())
        assert latest is not None and latest.id == good.id

    # The name is free: saving it again works, and collection removes the half upload only.
    s3_app.op("save_weights", {"model_id": run_id, "seq_id": 5, "path": "half"})
    collected = artifact_gc.collect(
        s3_app.database, store, SystemClock(), pending_grace=timedelta(hours=1)
    )
    assert collected.versions == 1
    assert s3_server.keys(half.artifact_uri) == []
    assert s3_server.keys(good.artifact_uri or "")
    assert (
        artifact_gc.collect(s3_app.database, store, SystemClock(), pending_grace=timedelta(hours=1))
        == artifact_gc.Collected()
    )


def test_collection_removes_overwritten_expired_and_stale_uploads_but_not_shared_artifacts(
    s3_app: Server, s3_server: S3Server
) -> None:
    run_id = s3_app.trained_run()
    s3_app.op("save_weights", {"model_id": run_id, "seq_id": 3, "path": "a"})
    s3_app.op("save_weights", {"model_id": run_id, "seq_id": 4, "path": "a", "overwrite": True})
    s3_app.op("save_weights", {"model_id": run_id, "seq_id": 5, "path": "b", "ttl_seconds": 3600})
    s3_app.op("save_weights", {"model_id": run_id, "seq_id": 6, "path": "kept"})
    overwritten, current, expiring, kept = s3_app.versions(run_id)
    assert overwritten.status == VersionStatus.DELETED
    with s3_app.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        # A stale upload (its worker died) and a version sharing `kept`'s artifact, deleted:
        # `kept` still needs the objects.
        stale = checkpoints.begin_upload(
            db,
            SystemClock(),
            run=run,
            kind="training",
            name=None,
            artifact_uri=s3_app.store.uri("stale/upload"),
        ).id
        # The same save run again (a redelivered op writes the same key) finds its version.
        again = checkpoints.begin_upload(
            db,
            SystemClock(),
            run=run,
            kind="training",
            name=None,
            artifact_uri=s3_app.store.uri("stale/upload"),
        )
        assert again.id == stale
        shared = checkpoints.begin_upload(
            db,
            SystemClock(),
            run=run,
            kind="training",
            name=None,
            artifact_uri=kept.artifact_uri or "",
        )
        assert shared.id != kept.id
        checkpoints.fail_upload(db, shared.id)

    later = FakeClock(SystemClock().now() + timedelta(hours=2))
    collected = artifact_gc.collect(
        s3_app.database, s3_app.store, later, pending_grace=timedelta(hours=1)
    )
    assert collected == artifact_gc.Collected(failed_uploads=1, versions=3, snapshots=0)
    assert (
        artifact_gc.collect(s3_app.database, s3_app.store, later, pending_grace=timedelta(hours=1))
        == artifact_gc.Collected()
    )
    by_id = {v.id: v for v in s3_app.versions(run_id)}
    assert by_id[stale].status == VersionStatus.FAILED
    for gone in (overwritten, expiring):
        assert by_id[gone.id].artifact_uri is None
        assert s3_server.keys(gone.artifact_uri or "") == []
    for alive in (current, kept):
        assert by_id[alive.id].artifact_uri == alive.artifact_uri
        assert s3_server.keys(alive.artifact_uri or "")
    # A failed version on an artifact a ready one still uses keeps naming it, objects and all.
    assert by_id[shared.id].artifact_uri == kept.artifact_uri


def test_deleting_a_checkpoint_keeps_files_another_version_still_uses(
    s3_app: Server, s3_server: S3Server
) -> None:
    run_id = s3_app.trained_run()
    s3_app.op("save_weights", {"model_id": run_id, "seq_id": 3, "path": "a"})
    (original,) = s3_app.versions(run_id)
    uri = original.artifact_uri or ""
    with s3_app.database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        # A second version on the same artifact, as promotion makes one.
        copy_id = checkpoints.register(
            db,
            SystemClock(),
            run=run,
            kind="training",
            name=None,
            artifact_uri=uri,
            size_bytes=original.size_bytes or 0,
            sha256=original.sha256 or "",
        ).id
    route = f"/api/v1/training_runs/{run_id}/checkpoints/weights/a"
    deleted = s3_app.client.delete(route, headers=s3_app.headers)
    assert deleted.status_code == 204, deleted.text
    assert s3_server.keys(uri)  # the copy still uses them
    assert (
        artifact_gc.collect(
            s3_app.database, s3_app.store, SystemClock(), pending_grace=timedelta(hours=1)
        )
        == artifact_gc.Collected()
    )
    assert s3_server.keys(uri)
    with s3_app.database.transaction() as db:
        copy = db.get(ModelVersion, copy_id)
        assert copy is not None
        assert checkpoints.mark_deleted(copy) == uri  # the last one out removes them


def test_collection_removes_the_snapshot_of_a_run_that_never_runs_again(
    app_factory: AppFactory, s3_artifact_url: str, s3_server: S3Server
) -> None:
    app = app_factory(artifact_url=s3_artifact_url, snapshot_every_steps=1)
    with TestClient(app) as client:
        server = Server(app, client)
        run_id = server.trained_run()
        live = server.trained_run(seq=1)
        # A snapshot is taken right after the step's result is recorded.
        deadline = time.monotonic() + 60
        while True:
            with server.database.reader() as db:
                uris = {
                    r.id: r.snapshot_uri
                    for r in db.scalars(
                        select(TrainingRun).where(TrainingRun.id.in_([run_id, live]))
                    )
                }
            if all(uris.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert all(uri and uri.startswith(s3_artifact_url) for uri in uris.values())
        assert all(s3_server.keys(uri or "") for uri in uris.values())
        gc = {"pending_grace": timedelta(hours=1)}
        # While the session is open, both runs may still run: their snapshots stay.
        assert (
            artifact_gc.collect(server.database, server.store, SystemClock(), **gc).snapshots == 0
        )
        with server.database.transaction() as db:
            run = db.get(TrainingRun, run_id)
            assert run is not None
            runs.unload(run)
            sessions.finish(
                db,
                SystemClock(),
                tenant_id=run.tenant_id,
                session_id=server.session_id,
                reason="success",
                detail=None,
                ttl_seconds=300,
            )
        # The other run's session ended too, but it was not unloaded: it stays as it was.
        collected = artifact_gc.collect(server.database, server.store, SystemClock(), **gc)
        assert collected.snapshots == 1
        assert s3_server.keys(uris[run_id] or "") == []
        assert s3_server.keys(uris[live] or "")
        with server.database.reader() as db:
            assert (
                db.scalar(select(TrainingRun.snapshot_uri).where(TrainingRun.id == run_id)) is None
            )
        assert (
            artifact_gc.collect(server.database, server.store, SystemClock(), **gc).snapshots == 0
        )


def test_download_links_of_a_version_whose_objects_are_gone_answer_404(
    s3_app: Server, s3_server: S3Server
) -> None:
    run_id = s3_app.trained_run()
    s3_app.op("save_weights", {"model_id": run_id, "seq_id": 3, "path": "a"})
    (version,) = s3_app.versions(run_id)
    uri = version.artifact_uri or ""
    bucket = uri.removeprefix("s3://").partition("/")[0]
    s3_server.client().delete_objects(
        Bucket=bucket, Delete={"Objects": [{"Key": key} for key in s3_server.keys(uri)]}
    )
    answer = s3_app.client.post(
        "/api/v1/registry/download_urls",
        json={"path": version.tinker_path},
        headers=s3_app.headers,
    )
    assert answer.status_code == 404, answer.text
    assert "are gone" in answer.json()["detail"]
