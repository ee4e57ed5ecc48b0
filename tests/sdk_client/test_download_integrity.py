"""A download whose bytes do not match the version's digests is refused and leaves nothing
behind: neither the file nor its `.part`, so the next attempt starts clean."""

from __future__ import annotations

import asyncio
import hashlib
import io
import tarfile
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from treadle.client.downloads import download_archive, download_files
from treadle.errors import RequestFailedError
from treadle.types import DownloadFile, DownloadUrlsResponse

pytestmark = pytest.mark.unit

GOOD, BAD = b"the weights", b"the wrong weights"


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _urls(archive: bytes) -> DownloadUrlsResponse:
    return DownloadUrlsResponse(
        version_id="v",
        kind="adapter",
        files=[
            DownloadFile(
                path="adapter.bin",
                size_bytes=len(BAD),
                sha256=hashlib.sha256(GOOD).hexdigest(),
                url="http://store/adapter.bin",
            )
        ],
        archive_url="http://store/v.tar",
        archive_size_bytes=len(archive),
        expires=datetime(2030, 1, 1, tzinfo=UTC),
    )


def _serving(body: bytes) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, content=body))
    )


def test_a_file_with_another_digest_is_refused_and_removed(tmp_path: Path) -> None:
    async def go() -> None:
        async with _serving(BAD) as plain:
            await download_files(plain, _urls(b""), tmp_path, None)

    with pytest.raises(RequestFailedError, match=r"arrived with sha256 .*partial file was removed"):
        asyncio.run(go())
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_archive_is_refused_and_removed(tmp_path: Path) -> None:
    archive = _tar({"adapter.bin": BAD})

    async def go() -> None:
        async with _serving(archive) as plain:
            await download_archive(plain, _urls(archive), tmp_path, "v.tar", None)

    with pytest.raises(RequestFailedError, match=r"arrived damaged \(sha256 of \['adapter.bin'\]"):
        asyncio.run(go())
    assert list(tmp_path.iterdir()) == []
