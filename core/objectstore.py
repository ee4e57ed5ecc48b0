"""Where artifacts live: adapters, optimizer state, exports, snapshots, served tokenizers.

Two implementations behind one protocol, chosen by `open_store(settings)` from
`TREADLE_ARTIFACT_URL`: a local folder (`LocalArtifactStore`: embedded mode, or a volume every
process mounts at the same path) and S3-compatible object storage (`S3ArtifactStore`, through
fsspec's s3fs, imported only when used). Keys are relative paths chosen by the callers, such as
`<tenant>/<run>/weights/<name>-<op>` or `models/<model>/tokenizer`; the store turns them into
the URIs recorded in the database (`file://…` or `s3://bucket/prefix/…`).

The engine reads and writes local folders, so a writer asks `local_dir(key)` for a folder,
writes the artifact there, then calls `publish(key)`, which makes it readable by every process
and returns its URI; only then may a version that names the URI become ready. A reader calls
`open_dir(uri)`: the folder itself for a local store, a downloaded copy for S3 (artifacts are
immutable, so a cached copy stays valid). The store knows nothing of versions, tenants or which
artifacts are still referenced: `scheduler.artifact_gc` decides what to delete.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

if TYPE_CHECKING:
    from core.settings import Settings


@dataclass(frozen=True)
class StoredFile:
    """One file of an artifact: its path inside the artifact (POSIX), size and sha256."""

    path: str
    size_bytes: int
    sha256: str


class ArtifactStore(Protocol):
    def local_dir(self, key: str) -> Path:
        """An empty local folder for `key` (whatever it held is deleted); write the artifact
        there."""
        ...

    def uri(self, key: str) -> str:
        """The URI the artifact at `key` has (or will have, once published)."""
        ...

    def publish(self, key: str) -> str:
        """Make what was written to `local_dir(key)` readable by every process; returns its
        URI. Once it returns, every file is in place; if it raises, the artifact may be partial
        and must not be recorded as ready."""
        ...

    def open_dir(self, uri: str) -> Path:
        """The local folder holding the artifact at `uri`, for reading."""
        ...

    def delete(self, uri: str) -> None:
        """Remove the artifact at `uri`; one that is already gone is no error."""
        ...

    def size_and_digest(self, uri: str) -> tuple[int, str]:
        """Total bytes and a sha256 over the artifact's files (names and contents)."""
        ...

    def files(self, uri: str) -> list[StoredFile]:
        """Every file of the artifact at `uri`, sorted by path."""
        ...

    def open_file(self, uri: str, relpath: str) -> BinaryIO:
        """One file of the artifact, for reading; FileNotFoundError if it is not there."""
        ...

    def presigned_url(self, uri: str, relpath: str, expires_in: int) -> str | None:
        """A URL that fetches one file without credentials for `expires_in` seconds, where the
        store can sign one; None means Treadle serves the file itself (a local folder)."""
        ...


class LocalArtifactStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        # Only the server's own user may read tenants' weights.
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root):
            raise ValueError(f"artifact key {key!r} escapes the store")
        return path

    def local_dir(self, key: str) -> Path:
        return _fresh_dir(self._path(key))

    def uri(self, key: str) -> str:
        return f"file://{self._path(key)}"

    def publish(self, key: str) -> str:
        # Written in place: every process reads the same folder.
        return self.uri(key)

    def open_dir(self, uri: str) -> Path:
        path = Path(uri.removeprefix("file://")).resolve()
        if not path.is_relative_to(self.root) or not path.is_dir():
            raise FileNotFoundError(f"artifact {uri} is missing")
        return path

    def delete(self, uri: str) -> None:
        path = Path(uri.removeprefix("file://")).resolve()
        if path.is_relative_to(self.root) and path.exists():
            shutil.rmtree(path)

    def size_and_digest(self, uri: str) -> tuple[int, str]:
        return _size_and_digest(self.open_dir(uri))

    def files(self, uri: str) -> list[StoredFile]:
        return _stored_files(self.open_dir(uri))

    def open_file(self, uri: str, relpath: str) -> BinaryIO:
        root = self.open_dir(uri)
        path = (root / relpath).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise FileNotFoundError(f"{relpath!r} is not a file of artifact {uri}")
        return path.open("rb")

    def presigned_url(self, uri: str, relpath: str, expires_in: int) -> str | None:
        return None


class S3ArtifactStore:
    """Artifacts under `s3://bucket/prefix`, with a local cache folder for the engine.

    Endpoint, region and credentials come from the environment as botocore reads them
    (`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`, `AWS_DEFAULT_REGION`, `AWS_ACCESS_KEY_ID`,
    `AWS_SECRET_ACCESS_KEY`, or a profile). `local_dir` hands out a scratch folder under
    `cache_dir/staging`; `publish` uploads it to the final key (after removing anything an
    interrupted earlier attempt left there) and keeps it as the cached copy; `open_dir`
    downloads an artifact once into `cache_dir/objects`, keyed by URI.
    """

    def __init__(self, url: str, cache_dir: str | Path) -> None:
        import s3fs  # Only S3 deployments pay for botocore's import.

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not url.startswith("s3://") or not bucket:
            raise ValueError(f"artifact URL {url!r} is not s3://bucket[/prefix]; fix it")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        # Not fsspec's shared instance: each store reads the environment when it is built.
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True)
        self.cache = Path(cache_dir).resolve()
        self.cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._client: Any = None

    # --- keys, URIs and cache folders ------------------------------------------------------

    def _object_path(self, key: str) -> str:
        parts = PurePosixPath(key).parts
        if not parts or ".." in parts or key.startswith("/"):
            raise ValueError(f"artifact key {key!r} escapes the store")
        return "/".join(p for p in (self.bucket, self.prefix, key.strip("/")) if p)

    def _path_of(self, uri: str) -> str:
        """`bucket/prefix/key` of a URI of this store; FileNotFoundError for any other."""
        root = "/".join(p for p in (self.bucket, self.prefix) if p) + "/"
        path = uri.removeprefix("s3://")
        if not uri.startswith("s3://") or not path.startswith(root) or ".." in path.split("/"):
            raise FileNotFoundError(f"artifact {uri} is not in this store (s3://{root})")
        return path.rstrip("/")

    def _cached(self, uri: str) -> Path:
        return self.cache / "objects" / hashlib.sha256(uri.encode()).hexdigest()

    def _staging(self, key: str) -> Path:
        return self.cache / "staging" / hashlib.sha256(self._object_path(key).encode()).hexdigest()

    # --- the protocol ------------------------------------------------------------------------

    def local_dir(self, key: str) -> Path:
        return _fresh_dir(self._staging(key))

    def uri(self, key: str) -> str:
        return f"s3://{self._object_path(key)}"

    def publish(self, key: str) -> str:
        uri, staging = self.uri(key), self._staging(key)
        if not staging.is_dir():
            raise FileNotFoundError(f"nothing was written for artifact {key!r}; call local_dir")
        target = self._object_path(key)
        # A key is written once per op; an earlier, interrupted attempt may have left objects.
        self._remove_objects(target)
        for file in sorted(p for p in staging.rglob("*") if p.is_file()):
            self._upload(file, f"{target}/{file.relative_to(staging).as_posix()}")
        # What was uploaded is what a reader would download: keep it as the cached copy.
        cached = self._cached(uri)
        if cached.exists():
            shutil.rmtree(cached)
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(cached)
        return uri

    def _upload(self, file: Path, object_path: str) -> None:
        """One file to one object (a seam the tests use to interrupt an upload)."""
        self.fs.put_file(str(file), object_path)

    def _remove_objects(self, object_path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(object_path, recursive=True)
        self.fs.invalidate_cache(object_path)

    def open_dir(self, uri: str) -> Path:
        cached = self._cached(uri)
        if cached.is_dir():
            return cached
        path = self._path_of(uri)
        self.fs.invalidate_cache(path)
        names = [n for n in self.fs.find(path) if n.startswith(path + "/")]
        if not names:
            raise FileNotFoundError(f"artifact {uri} is missing")
        # Downloaded beside the cache, then renamed: a reader never sees half a folder.
        partial = cached.with_name(f"{cached.name}.{uuid.uuid4().hex}.partial")
        try:
            for name in names:
                local = partial / name[len(path) + 1 :]
                local.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(name, str(local))
            try:
                os.rename(partial, cached)
            except OSError:
                if not cached.is_dir():  # not another reader's copy of the same artifact
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return cached

    def delete(self, uri: str) -> None:
        try:
            path = self._path_of(uri)
        except FileNotFoundError:
            return
        self._remove_objects(path)
        shutil.rmtree(self._cached(uri), ignore_errors=True)

    def size_and_digest(self, uri: str) -> tuple[int, str]:
        return _size_and_digest(self.open_dir(uri))

    def files(self, uri: str) -> list[StoredFile]:
        return _stored_files(self.open_dir(uri))

    def _file_path(self, uri: str, relpath: str) -> str:
        parts = PurePosixPath(relpath).parts
        if not parts or ".." in parts or relpath.startswith("/"):
            raise FileNotFoundError(f"{relpath!r} is not a file of artifact {uri}")
        return f"{self._path_of(uri)}/{relpath}"

    def open_file(self, uri: str, relpath: str) -> BinaryIO:
        cached = self._cached(uri)
        if cached.is_dir():
            path = (cached / relpath).resolve()
            if path.is_relative_to(cached) and path.is_file():
                return path.open("rb")
        object_path = self._file_path(uri, relpath)
        try:
            handle: BinaryIO = self.fs.open(object_path, "rb")
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{relpath!r} is not a file of artifact {uri}") from exc
        return handle

    def presigned_url(self, uri: str, relpath: str, expires_in: int) -> str | None:
        object_path = self._file_path(uri, relpath)
        self.fs.invalidate_cache(object_path)
        if not self.fs.isfile(object_path):
            raise FileNotFoundError(f"{relpath!r} is not a file of artifact {uri}")
        bucket, _, key = object_path.partition("/")
        url: str = self._s3_client().generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=expires_in
        )
        return url

    def _s3_client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            # Signature version 4: what S3 and S3-compatible stores accept for presigned URLs.
            self._client = boto3.client("s3", config=Config(signature_version="s3v4"))
        return self._client


def open_store(settings: Settings) -> ArtifactStore:
    """The artifact store `TREADLE_ARTIFACT_URL` names: `s3://bucket/prefix`, or a folder (a
    path or `file:///path`; by default `<data dir>/artifacts`)."""
    url = settings.resolved_artifact_url
    if url.startswith("s3://"):
        return S3ArtifactStore(url, settings.data_dir / "artifact-cache")
    if url.startswith("file://"):
        return LocalArtifactStore(url.removeprefix("file://"))
    if "://" in url:
        raise ValueError(
            f"TREADLE_ARTIFACT_URL {url!r} is not supported; use s3://bucket/prefix, a folder "
            "path or file:///path"
        )
    return LocalArtifactStore(url)


def _fresh_dir(path: Path) -> Path:
    """`path` as an empty folder: whatever an earlier attempt left there is deleted."""
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _size_and_digest(root: Path) -> tuple[int, str]:
    digest, total = hashlib.sha256(), 0
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode())
        data = file.read_bytes()
        total += len(data)
        digest.update(data)
    return total, digest.hexdigest()


def _stored_files(root: Path) -> list[StoredFile]:
    return [
        StoredFile(
            path=file.relative_to(root).as_posix(),
            size_bytes=file.stat().st_size,
            sha256=_file_sha256(file),
        )
        for file in sorted(p for p in root.rglob("*") if p.is_file())
    ]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
