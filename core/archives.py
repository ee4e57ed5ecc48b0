"""A model version's files as one uncompressed tar archive, streamed from the artifact store.

The archive is laid out before a byte is read: per file a header (POSIX pax, so any path length
fits), its bytes and zero padding to a 512-byte block; two zero blocks end it. So its length is
known up front and any byte range of it can be produced by skipping to it, which lets a client
resume an interrupted download. Headers carry a fixed owner and mode and one time (the
version's), so a version always yields the same bytes. File bytes are read in blocks through
`ArtifactStore.open_file`; nothing is copied aside. This module knows nothing of HTTP.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

from core.objectstore import ArtifactStore, StoredFile

BLOCK = 512
CHUNK = 1 << 20
_END = b"\0" * (2 * BLOCK)


@dataclass(frozen=True)
class _Member:
    header: bytes
    path: str
    size: int

    @property
    def padding(self) -> int:
        return -self.size % BLOCK

    @property
    def length(self) -> int:
        return len(self.header) + self.size + self.padding


def _header(file: StoredFile, mtime: int) -> bytes:
    info = tarfile.TarInfo(file.path)
    info.size = file.size_bytes
    info.mtime = mtime
    info.mode = 0o644
    info.type = tarfile.REGTYPE
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


class Archive:
    """The tar archive of the artifact at `uri`, holding exactly `files`."""

    def __init__(self, store: ArtifactStore, uri: str, files: list[StoredFile], mtime: int):
        self.store = store
        self.uri = uri
        self.members = [
            _Member(_header(f, mtime), f.path, f.size_bytes)
            for f in sorted(files, key=lambda f: f.path)
        ]
        self.size = sum(m.length for m in self.members) + len(_END)

    def stream(self, start: int = 0, end: int | None = None) -> Iterator[bytes]:
        """The archive's bytes `start` to `end` (exclusive; the end of the archive if None)."""
        end = self.size if end is None else min(end, self.size)
        offset = 0
        for member in self.members:
            if offset >= end:
                return
            if offset + member.length > start:
                yield from self._member(member, start - offset, end - offset)
            offset += member.length
        yield from _slice(_END, start - offset, end - offset)

    def _member(self, member: _Member, start: int, end: int) -> Iterator[bytes]:
        """Bytes `start`..`end` of one member (header, data, padding), relative to it."""
        yield from _slice(member.header, start, end)
        data_start = len(member.header)
        first, last = max(start - data_start, 0), min(end - data_start, member.size)
        if first < last:
            with self.store.open_file(self.uri, member.path) as handle:
                handle.seek(first)
                left = last - first
                while left > 0:
                    block = handle.read(min(CHUNK, left))
                    if not block:
                        raise OSError(
                            f"{member.path} of {self.uri} is shorter than its recorded "
                            f"{member.size} bytes"
                        )
                    left -= len(block)
                    yield block
        padding_start = data_start + member.size
        yield from _slice(b"\0" * member.padding, start - padding_start, end - padding_start)


def _slice(data: bytes, start: int, end: int) -> Iterator[bytes]:
    part = data[max(start, 0) : max(end, 0)]
    if part:
        yield part
