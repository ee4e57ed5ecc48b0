"""Where artifacts live: adapters, optimizer state, exports, snapshots, served tokenizers.

A seam with one implementation so far, a local folder (embedded mode, or a volume every
process mounts at the same path); there is no S3 or other remote store yet. Keys are relative
paths chosen by the callers, such as `<tenant>/<run>/weights/<name>-<op>` or
`models/<model>/tokenizer`; the store turns them into `file://` URIs recorded in the database
and back into local folders the engine reads and writes.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol


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
        """The URI to record for the artifact at `key`."""
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
        path = self._path(key)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def uri(self, key: str) -> str:
        return f"file://{self._path(key)}"

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
        root = self.open_dir(uri)
        digest, total = hashlib.sha256(), 0
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            digest.update(str(file.relative_to(root)).encode())
            data = file.read_bytes()
            total += len(data)
            digest.update(data)
        return total, digest.hexdigest()

    def files(self, uri: str) -> list[StoredFile]:
        root = self.open_dir(uri)
        return [
            StoredFile(
                path=file.relative_to(root).as_posix(),
                size_bytes=file.stat().st_size,
                sha256=_file_sha256(file),
            )
            for file in sorted(p for p in root.rglob("*") if p.is_file())
        ]

    def open_file(self, uri: str, relpath: str) -> BinaryIO:
        root = self.open_dir(uri)
        path = (root / relpath).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise FileNotFoundError(f"{relpath!r} is not a file of artifact {uri}")
        return path.open("rb")

    def presigned_url(self, uri: str, relpath: str, expires_in: int) -> str | None:
        return None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
