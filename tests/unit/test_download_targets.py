"""The SDK writes a download only under the folder it was given: a file list or an archive URL
naming a path outside it (`../`, an absolute path) is refused before anything is fetched."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from treadle.client import downloads
from treadle.errors import RequestFailedError
from treadle.types import DownloadFile, DownloadUrlsResponse

pytestmark = pytest.mark.unit


def _urls(path: str = "adapter_config.json") -> DownloadUrlsResponse:
    return DownloadUrlsResponse(
        version_id="mv_1",
        kind="adapter",
        files=[DownloadFile(path=path, size_bytes=2, sha256="0" * 64, url="http://x/f")],
        archive_url="http://x/archive.tar",
        archive_size_bytes=10240,
        expires=datetime(2030, 1, 1, tzinfo=UTC),
    )


def _never(request: httpx.Request) -> httpx.Response:
    raise AssertionError(f"fetched {request.url} although the target was refused")


@pytest.mark.parametrize("name", ["../escape.tar", "/tmp/escape.tar", "..", "."])
def test_an_archive_named_outside_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    async def attempt() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_never)) as plain:
            await downloads.download_archive(plain, _urls(), tmp_path / "out", name, None)

    with pytest.raises(RequestFailedError, match="refusing to write the archive"):
        asyncio.run(attempt())
    assert not (tmp_path / "escape.tar").exists()


def test_a_file_listed_outside_the_folder_is_refused(tmp_path: Path) -> None:
    async def attempt() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_never)) as plain:
            await downloads.download_files(plain, _urls("../escape.json"), tmp_path / "out", None)

    with pytest.raises(RequestFailedError, match="refusing to write"):
        asyncio.run(attempt())
