"""Where artifacts live: adapters, optimizer state, exports, snapshots.

A seam with one implementation so far, a local folder (embedded mode, or a shared volume).
Keys are relative paths such as `tn_x/runs/<run>/weights/<name>`; the store turns them into
URIs recorded in the database and back into local folders the engine reads and writes.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Protocol


class ArtifactStore(Protocol):
    def local_dir(self, key: str) -> Path:
        """A local folder for `key`, created empty if missing; write the artifact there."""
        ...

    def uri(self, key: str) -> str: ...

    def open_dir(self, uri: str) -> Path:
        """The local folder holding the artifact at `uri`, for reading."""
        ...

    def delete(self, uri: str) -> None: ...

    def size_and_digest(self, uri: str) -> tuple[int, str]:
        """Total bytes and a sha256 over the artifact's files (names and contents)."""
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
