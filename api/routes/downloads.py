"""Downloads of any model version the caller may read, by tinker path or registry reference.

`POST /registry/download_urls` answers signed URLs: one per file (the store's own presigned URL
where it can sign one, else Treadle's `/artifacts/...` route) and one for a tar archive of the
whole version, always served here. The archive's token pins the version; like a file's link it
needs no API key and works until it expires while the version stays downloadable. Archives
answer single HTTP Range requests (206, 416 beyond the end), so a client can resume.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Header, Request
from fastapi import Path as PathParameter
from fastapi.responses import Response, StreamingResponse

from api import ranges
from api.deps import CurrentPrincipal, ReadSession, State
from api.openapi import error_responses
from core import checkpoints, signing
from core.archives import Archive
from core.clock import Clock
from core.errors import NotFound
from core.objectstore import StoredFile
from core.tables import ModelVersion
from treadle.types import DownloadFile, DownloadUrlsRequest, DownloadUrlsResponse

router = APIRouter(prefix="/api/v1", tags=["downloads"])

# Long enough to fetch a large export, short enough that a leaked link soon stops working.
DOWNLOAD_URL_SECONDS = 3600

ARCHIVE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The version's files as one uncompressed tar archive.",
        "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
    },
    **ranges.documented("the archive", "application/x-tar"),
}


@router.post(
    "/registry/download_urls",
    response_model=DownloadUrlsResponse,
    responses=error_responses(401, 403, 404, 413, 422),
)
def download_urls(
    body: DownloadUrlsRequest,
    request: Request,
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
) -> DownloadUrlsResponse:
    """Signed URLs for every file of a version and for a tar archive of all of them."""
    version = checkpoints.resolve(db, state.clock, principal.tenant_id, body.path)
    if not checkpoints.downloadable(version, state.clock):
        raise _gone(body.path)
    files = _files(state, version, body.path)
    expires = _expiry(version, state.clock)
    expires_in = max(int((expires - state.clock.now()).total_seconds()), 1)
    base = (state.settings.public_url or str(request.base_url)).rstrip("/")
    assert version.artifact_uri is not None
    listed: list[DownloadFile] = []
    for file in files:
        try:
            url = state.store.presigned_url(version.artifact_uri, file.path, expires_in)
        except FileNotFoundError as exc:
            raise _gone(body.path) from exc
        if url is None:
            token = signing.sign_download(state.server_secret, version.id, file.path, expires)
            url = f"{base}/api/v1/artifacts/{token}/{quote(file.path)}"
        listed.append(
            DownloadFile(path=file.path, size_bytes=file.size_bytes, sha256=file.sha256, url=url)
        )
    name = f"{_archive_name(version)}.tar"
    token = signing.sign_download(state.server_secret, version.id, name, expires, archive=True)
    archive = Archive(state.store, version.artifact_uri, files, _mtime(version))
    return DownloadUrlsResponse(
        version_id=version.id,
        kind=version.kind,
        files=listed,
        archive_url=f"{base}/api/v1/archives/{token}/{quote(name)}",
        archive_size_bytes=archive.size,
        expires=expires,
    )


@router.get(
    "/archives/{token}/{filename}",
    response_model=None,
    response_class=StreamingResponse,
    responses=ARCHIVE_RESPONSE | error_responses(403, 404),
)
def archive(
    token: Annotated[str, PathParameter(description="The signed token of the link.")],
    filename: Annotated[str, PathParameter(description="The archive's name, as signed.")],
    state: State,
    range_header: Annotated[str | None, Header(alias="range")] = None,
) -> Response:
    """A version's files as one tar archive, streamed; a single byte range if asked."""
    version_id = signing.verify_download(
        state.server_secret, token, filename, state.clock.now(), archive=True
    )
    with state.database.reader() as db:
        version = db.get(ModelVersion, version_id)
        if version is None or not checkpoints.downloadable(version, state.clock):
            raise _gone("this version")
        files = _files(state, version, "this version")
        uri, mtime = version.artifact_uri, _mtime(version)
    assert uri is not None
    whole = Archive(state.store, uri, files, mtime)
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'attachment; filename="{filename}"',
    }
    span = ranges.single(range_header, whole.size)
    if span is None:
        headers["Content-Length"] = str(whole.size)
        return StreamingResponse(whole.stream(), media_type="application/x-tar", headers=headers)
    start, end = span
    if start >= whole.size:
        assert range_header is not None
        return ranges.not_satisfiable(range_header, whole.size)
    headers["Content-Length"] = str(end - start)
    headers["Content-Range"] = f"bytes {start}-{end - 1}/{whole.size}"
    return StreamingResponse(
        whole.stream(start, end), status_code=206, media_type="application/x-tar", headers=headers
    )


def _files(state: State, version: ModelVersion, what: str) -> list[StoredFile]:
    if version.files is not None:
        return [StoredFile(**file) for file in version.files]
    try:
        assert version.artifact_uri is not None
        return state.store.files(version.artifact_uri)
    except FileNotFoundError as exc:
        raise _gone(what) from exc


def _gone(what: str) -> NotFound:
    return NotFound(
        f"the files of {what} are gone (deleted or expired); its download links no longer "
        "work, so download another version"
    )


def _archive_name(version: ModelVersion) -> str:
    if version.tinker_path is not None:
        return version.tinker_path.rsplit("/", 1)[-1]
    return f"{version.id}"


def _mtime(version: ModelVersion) -> int:
    return int(version.created_at.timestamp())


def _expiry(version: ModelVersion, clock: Clock) -> datetime:
    expires = clock.now() + timedelta(seconds=DOWNLOAD_URL_SECONDS)
    if version.expires_at is not None:
        expires = min(expires, version.expires_at)
    return expires.replace(microsecond=0)
