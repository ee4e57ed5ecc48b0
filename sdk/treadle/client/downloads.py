"""Fetching a version's signed download URLs to disk, resumably.

Each file (or the one tar archive) is written to `<target>.part` and renamed into place once
its bytes check out: a file's sha256 against the server's list, an archive's members against
the files it must hold. An interrupted download leaves the `.part` file behind, and the next
attempt asks only for the missing bytes (an HTTP Range request) and keeps them if the server
answers 206. A file already in place with the right digest is not fetched again. The signed URL
is the permission, so the API key is never sent to it. This module knows nothing of how the
URLs were obtained.
"""

from __future__ import annotations

import hashlib
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx

from treadle.errors import APIConnectionError, RequestFailedError, error_from_response
from treadle.types import DownloadFile, DownloadUrlsResponse

ProgressFn = Callable[[str, int, int | None], None]
"""`(relative file path, bytes received so far, file size or None)`."""

BLOCK = 1 << 20
PART_SUFFIX = ".part"


async def download_files(
    plain: httpx.AsyncClient,
    urls: DownloadUrlsResponse,
    destination: Path,
    on_progress: ProgressFn | None,
) -> Path:
    """Every file of the version under `destination`; returns the folder."""
    root = destination.resolve()
    for file in urls.files:
        target = (root / file.path).resolve()
        if not target.is_relative_to(root):
            raise RequestFailedError(
                f"refusing to write {file.path!r} outside {root}: the server's file list is "
                "wrong; tell its operator",
                category="server",
            )
        if target.is_file() and _sha256(target) == file.sha256:
            if on_progress is not None:
                on_progress(file.path, file.size_bytes, file.size_bytes)
            continue
        await _fetch(plain, file.url, file.path, target, file.size_bytes, on_progress)
        got = _sha256(_part(target))
        _settle(
            target,
            None
            if got == file.sha256
            else f"{file.path} arrived with sha256 {got}, not the version's {file.sha256}",
        )
    return root


async def download_archive(
    plain: httpx.AsyncClient,
    urls: DownloadUrlsResponse,
    destination: Path,
    name: str,
    on_progress: ProgressFn | None,
) -> Path:
    """The version's tar archive as `destination/name`; returns the archive's path."""
    root = destination.resolve()
    target = (root / name).resolve()
    if not target.is_relative_to(root) or target == root:
        raise RequestFailedError(
            f"refusing to write the archive {name!r} outside {root}: the server's archive URL "
            "is wrong; tell its operator",
            category="server",
        )
    await _fetch(plain, urls.archive_url, name, target, urls.archive_size_bytes, on_progress)
    problem = _archive_problem(_part(target), urls.files)
    _settle(target, None if problem is None else f"the archive {name} arrived damaged ({problem})")
    return target


async def _fetch(
    plain: httpx.AsyncClient,
    url: str,
    label: str,
    target: Path,
    size: int,
    on_progress: ProgressFn | None,
) -> None:
    """Bring `<target>.part` to `size` bytes, continuing what an earlier attempt left."""
    part = _part(target)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.is_file() else 0
    if have > size:  # left by something else; start over
        part.unlink()
        have = 0
    if have == size:
        if on_progress is not None:
            on_progress(label, size, size)
        return
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        async with plain.stream("GET", url, headers=headers) as response:
            if not response.is_success:
                await response.aread()
                raise error_from_response(response)
            resumed = response.status_code == 206
            received = have if resumed else 0
            with part.open("ab" if resumed else "wb") as out:
                async for block in response.aiter_bytes(BLOCK):
                    out.write(block)
                    received += len(block)
                    if on_progress is not None:
                        on_progress(label, received, size)
    except httpx.TransportError as exc:
        raise APIConnectionError(
            f"downloading {label} failed: {exc!r}; run the download again to continue it"
        ) from exc


def _settle(target: Path, problem: str | None) -> None:
    """Move `<target>.part` into place, or, when `problem` says what is wrong with it, remove it
    and refuse."""
    if problem is not None:
        _part(target).unlink()
        raise RequestFailedError(
            f"{problem}; run the download again (the partial file was removed)", category="server"
        )
    _part(target).replace(target)


def _part(target: Path) -> Path:
    return target.with_name(target.name + PART_SUFFIX)


def _sha256(path: Path) -> str:
    with path.open("rb") as handle:
        return _stream_sha256(handle)


def _stream_sha256(handle: IO[bytes]) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: handle.read(BLOCK), b""):
        digest.update(block)
    return digest.hexdigest()


def _archive_problem(path: Path, files: list[DownloadFile]) -> str | None:
    """What is wrong with the archive at `path`, or None if it holds exactly `files`."""
    expected = {f.path: f.sha256 for f in files}
    found: dict[str, str] = {}
    try:
        with tarfile.open(path, mode="r:") as archive:
            for member in archive:
                handle = archive.extractfile(member)
                if handle is None:
                    return f"{member.name} is not a regular file"
                found[member.name] = _stream_sha256(handle)
    except tarfile.TarError as exc:
        return f"not a readable tar archive: {exc}"
    if found.keys() != expected.keys():
        return f"it holds {sorted(found)}, the version {sorted(expected)}"
    wrong = sorted(p for p in found if found[p] != expected[p])
    return f"sha256 of {wrong} differ" if wrong else None
