"""The artifact stores behind `core.objectstore.open_store`: a local folder and S3-compatible
object storage (a moto server reached through the real s3fs and boto3 clients). Both hand out a
folder to write, publish it, read it back in another store instance (another process's view),
list and open its files, and delete it; S3 signs URLs that fetch a file without credentials."""

from __future__ import annotations

import hashlib
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from core.objectstore import ArtifactStore, LocalArtifactStore, S3ArtifactStore, open_store
from core.settings import Settings
from tests.fakes.s3 import S3Server

pytestmark = pytest.mark.integration

KEY = "tenant_a/run_1/training/step-3-op_9"
FILES = {
    "adapter_model.safetensors": b"\x00\x01weights" * 1000,
    "adapter_config.json": b'{"r": 8}',
    "optimizer/state.pt": b"adam moments",
}


@pytest.fixture(params=["local", "s3"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[ArtifactStore, ArtifactStore]:
    """Two stores on the same artifacts, with separate local folders: a writer and a reader."""
    if request.param == "local":
        url = str(tmp_path / "artifacts")
        return (
            open_store(Settings(data_dir=tmp_path / "w", artifact_url=url)),
            open_store(Settings(data_dir=tmp_path / "r", artifact_url=f"file://{url}")),
        )
    url = request.getfixturevalue("s3_artifact_url")
    return (
        open_store(Settings(data_dir=tmp_path / "w", artifact_url=url)),
        open_store(Settings(data_dir=tmp_path / "r", artifact_url=url)),
    )


def _write(store: ArtifactStore, key: str = KEY) -> str:
    folder = store.local_dir(key)
    for name, data in FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return store.publish(key)


def test_a_published_artifact_reads_back_elsewhere_with_its_files_and_digest(
    stores: tuple[ArtifactStore, ArtifactStore],
) -> None:
    writer, reader = stores
    uri = _write(writer)
    assert uri == writer.uri(KEY) == reader.uri(KEY)

    folder = reader.open_dir(uri)
    assert {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    } == FILES
    listed = reader.files(uri)
    assert [f.path for f in listed] == sorted(FILES)
    assert {f.path: (f.size_bytes, f.sha256) for f in listed} == {
        name: (len(data), hashlib.sha256(data).hexdigest()) for name, data in FILES.items()
    }
    assert reader.size_and_digest(uri) == writer.size_and_digest(uri)
    assert reader.size_and_digest(uri)[0] == sum(len(d) for d in FILES.values())
    with reader.open_file(uri, "optimizer/state.pt") as handle:
        assert handle.read() == b"adam moments"
    for missing in ("nope.bin", "../training", "/etc/passwd"):
        with pytest.raises(FileNotFoundError):
            reader.open_file(uri, missing)


def test_deleting_removes_every_file_and_a_second_delete_is_no_error(
    stores: tuple[ArtifactStore, ArtifactStore],
) -> None:
    writer, reader = stores
    uri = _write(writer)
    kept = _write(writer, KEY.replace("step-3", "step-4"))
    reader.open_dir(uri)  # cached by the reader before the delete

    writer.delete(uri)
    writer.delete(uri)
    with pytest.raises(FileNotFoundError):
        writer.open_dir(uri)
    with pytest.raises(FileNotFoundError):
        writer.open_file(uri, "adapter_config.json")
    # A prefix of another artifact's key is not that artifact: the neighbour stays.
    assert [f.path for f in reader.files(kept)] == sorted(FILES)


def test_a_rewritten_key_holds_only_the_new_files(
    stores: tuple[ArtifactStore, ArtifactStore],
) -> None:
    writer, reader = stores
    _write(writer)
    folder = writer.local_dir(KEY)
    (folder / "only.txt").write_bytes(b"second attempt")
    uri = writer.publish(KEY)
    assert [f.path for f in reader.files(uri)] == ["only.txt"]


def test_local_store_serves_files_itself(tmp_path: Path) -> None:
    store = LocalArtifactStore(tmp_path)
    uri = _write(store)
    assert store.presigned_url(uri, "adapter_config.json", 60) is None


def test_s3_presigned_urls_fetch_a_file_without_credentials_for_the_time_asked(
    s3_artifact_url: str, s3_server: S3Server, tmp_path: Path
) -> None:
    store = open_store(Settings(data_dir=tmp_path, artifact_url=s3_artifact_url))
    assert isinstance(store, S3ArtifactStore)
    uri = _write(store)
    url = store.presigned_url(uri, "adapter_model.safetensors", 600)
    assert url is not None and url.startswith(s3_server.endpoint)
    query = parse_qs(urlsplit(url).query)
    assert query["X-Amz-Expires"] == ["600"]
    assert "X-Amz-Signature" in query
    with urllib.request.urlopen(url) as response:
        assert response.read() == FILES["adapter_model.safetensors"]
    other = store.presigned_url(uri, "optimizer/state.pt", 3600)
    assert other is not None
    assert parse_qs(urlsplit(other).query)["X-Amz-Expires"] == ["3600"]
    with urllib.request.urlopen(other) as response:
        assert response.read() == b"adam moments"
    with pytest.raises(FileNotFoundError):
        store.presigned_url(uri, "missing.bin", 600)


def test_s3_objects_live_under_the_configured_prefix(
    s3_artifact_url: str, s3_server: S3Server, tmp_path: Path
) -> None:
    store = open_store(Settings(data_dir=tmp_path, artifact_url=s3_artifact_url))
    uri = _write(store)
    prefix = s3_artifact_url.removeprefix("s3://").partition("/")[2]
    assert s3_server.keys(s3_artifact_url) == sorted(f"{prefix}/{KEY}/{name}" for name in FILES)
    assert uri == f"{s3_artifact_url}/{KEY}"
    with pytest.raises(FileNotFoundError):
        store.open_dir("s3://another-bucket/artifacts/x")


def test_an_unknown_artifact_url_scheme_is_refused_with_what_to_use(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="s3://bucket/prefix"):
        open_store(Settings(data_dir=tmp_path, artifact_url="gs://bucket/x"))
