"""Downloads of a version by tinker path or registry reference: per-file signed URLs, the tar
archive of the whole version, HTTP Range on both, and what another tenant or an expired version
gets. Versions are seeded through the core services (tests/integration/rest_env.py);
tests/e2e/test_treadle_sdk.py downloads real exports with the SDK and the CLI."""

from __future__ import annotations

import hashlib
import io
import tarfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from core.clock import FakeClock
from tests.builders import tenant_factory
from tests.integration.rest_env import FILES, Env, open_env
from tests.integration.rest_env import headers as _h
from tests.server import build_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def env(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from open_env(request, tmp_path_factory)


URLS = "/api/v1/registry/download_urls"


def _local(url: str) -> str:
    return "/api/v1/" + url.split("/api/v1/", 1)[1]


def _untar(data: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        members = archive.getmembers()
        assert all(m.isfile() for m in members)
        return {m.name: archive.extractfile(m).read() for m in members}  # type: ignore[union-attr]


def test_a_version_downloads_by_path_or_reference_as_files_or_one_archive(env: Env) -> None:
    tenant = env.make_tenant()
    run_id = env.seed(tenant, names=(("training", "a"), ("adapter", "c")))
    path = f"tinker://{run_id}/external_weights/c"
    answers = [
        env.client.post(URLS, json={"path": ref}, headers=_h(tenant))
        for ref in (path, f"{run_id}:2", f"{run_id}@latest")
    ]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    bodies = [a.json() for a in answers]
    assert len({b["version_id"] for b in bodies}) == 1 and bodies[0]["kind"] == "adapter"
    body = bodies[0]
    assert [(f["path"], f["size_bytes"], f["sha256"]) for f in body["files"]] == [
        (p, len(data), hashlib.sha256(data).hexdigest()) for p, data in sorted(FILES.items())
    ]
    for file in body["files"]:
        fetched = env.client.get(_local(file["url"]))  # no API key: the link is the permission
        assert fetched.status_code == 200 and fetched.content == FILES[file["path"]]

    archive = env.client.get(_local(body["archive_url"]))
    assert archive.status_code == 200, archive.text
    assert archive.headers["content-type"] == "application/x-tar"
    assert (
        int(archive.headers["content-length"]) == body["archive_size_bytes"] == len(archive.content)
    )
    assert _untar(archive.content) == FILES
    # The same version always gives the same bytes, so a resumed download can be trusted.
    again = env.client.post(URLS, json={"path": path}, headers=_h(tenant)).json()
    assert env.client.get(_local(again["archive_url"])).content == archive.content

    training = env.client.post(URLS, json={"path": f"{run_id}:1"}, headers=_h(tenant)).json()
    assert training["kind"] == "training" and training["version_id"] != body["version_id"]


def test_files_and_archives_answer_byte_ranges(env: Env) -> None:
    tenant = env.make_tenant()
    run_id = env.seed(tenant, names=(("merged", "m"),))
    body = env.client.post(URLS, json={"path": f"{run_id}:1"}, headers=_h(tenant)).json()
    file = next(f for f in body["files"] if f["path"] == "nested/adapter_model.safetensors")
    data = FILES[file["path"]]
    url = _local(file["url"])

    part = env.client.get(url, headers={"Range": "bytes=2-5"})
    assert part.status_code == 206 and part.content == data[2:6]
    assert part.headers["content-range"] == f"bytes 2-5/{len(data)}"
    assert env.client.get(url, headers={"Range": "bytes=3-"}).content == data[3:]
    assert env.client.get(url).headers["accept-ranges"] == "bytes"
    beyond = env.client.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert beyond.status_code == 416
    assert beyond.headers["content-range"] == f"bytes */{len(data)}"
    assert f"below {len(data)}" in beyond.json()["detail"]

    archive_url = _local(body["archive_url"])
    whole = env.client.get(archive_url).content
    size = len(whole)
    assert size == body["archive_size_bytes"]
    # Cuts inside a header, inside file data, inside padding and in the closing blocks.
    cuts = [0, 100, 513, 515, 1030, size - 1000, size - 1]
    for start in cuts:
        resumed = env.client.get(archive_url, headers={"Range": f"bytes={start}-"})
        assert resumed.status_code == 206, resumed.text
        assert resumed.headers["content-range"] == f"bytes {start}-{size - 1}/{size}"
        assert resumed.content == whole[start:]
    middle = env.client.get(archive_url, headers={"Range": "bytes=500-1600"})
    assert middle.status_code == 206 and middle.content == whole[500:1601]
    tail = env.client.get(archive_url, headers={"Range": "bytes=-700"})
    assert tail.status_code == 206 and tail.content == whole[-700:]
    refused = env.client.get(archive_url, headers={"Range": f"bytes={size}-"})
    assert refused.status_code == 416
    assert refused.headers["content-range"] == f"bytes */{size}"
    assert str(size) in refused.json()["detail"]


def test_another_tenant_and_an_expired_version_get_404(env: Env) -> None:
    owner, other = env.make_tenant(), env.make_tenant()
    run_id = env.seed(owner, names=(("adapter", "c"),), ttl_seconds=3600)
    path = f"tinker://{run_id}/external_weights/c"
    for ref in (path, f"{run_id}:1", f"{run_id}@latest"):
        foreign = env.client.post(URLS, json={"path": ref}, headers=_h(other))
        assert foreign.status_code == 404, foreign.text
    made_up = env.client.post(
        URLS, json={"path": path.replace(run_id, run_id + "x")}, headers=_h(other)
    )
    foreign = env.client.post(URLS, json={"path": path}, headers=_h(other))
    assert foreign.json() == {
        **made_up.json(),
        "detail": made_up.json()["detail"].replace(run_id + "x", run_id),
    }

    archive_url = env.client.post(URLS, json={"path": path}, headers=_h(owner)).json()[
        "archive_url"
    ]
    env.clock.advance(3601)
    for ref in (path, f"{run_id}:1"):
        expired = env.client.post(URLS, json={"path": ref}, headers=_h(owner))
        assert expired.status_code == 404, expired.text
    assert (
        "expired"
        in env.client.post(URLS, json={"path": f"{run_id}:1"}, headers=_h(owner)).json()["detail"]
    )
    assert env.client.get(_local(archive_url)).status_code in (403, 404)


def test_a_store_that_signs_urls_serves_the_files_and_treadle_the_archive(
    s3_artifact_url: str, tmp_path: Path
) -> None:
    """With S3, each file's URL is the store's presigned one (no Treadle in between), and the
    archive, streamed by Treadle from the store, holds the same bytes."""
    clock = FakeClock()
    app = build_app(tmp_path, clock=clock, artifact_url=s3_artifact_url)
    state = app.state.treadle
    with TestClient(app) as client:
        env = Env(client, clock, tenant_factory(state.database, state.settings, clock), tmp_path)
        tenant = env.make_tenant()
        run_id = env.seed(tenant, names=(("adapter", "c"),))
        body = client.post(URLS, json={"path": f"{run_id}:1"}, headers=_h(tenant)).json()
        assert sorted(f["path"] for f in body["files"]) == sorted(FILES)
        for file in body["files"]:
            assert "/api/v1/" not in file["url"], file["url"]
            with urllib.request.urlopen(file["url"]) as fetched:  # no credentials
                assert fetched.read() == FILES[file["path"]]
        archive = client.get(_local(body["archive_url"]))
        assert archive.status_code == 200 and _untar(archive.content) == FILES
