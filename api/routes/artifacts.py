"""Downloads of checkpoint files through signed URLs, served by Treadle itself.

No API key: the URL's token (see `core.signing`) is the permission, because the tinker CLI
fetches these URLs with plain urllib. A token grants one file of one checkpoint until it
expires, and only while the checkpoint is still live. Files answer HTTP Range requests.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import FileResponse, Response

from api import ranges
from api.deps import State
from api.openapi import FILE_RESPONSE, error_responses
from core import checkpoints, signing
from core.errors import NotFound
from core.tables import ModelVersion

router = APIRouter(prefix="/api/v1", tags=["artifacts"])


@router.get(
    "/artifacts/{token}/{relpath:path}",
    response_model=None,
    response_class=FileResponse,
    responses=FILE_RESPONSE | ranges.documented("the file", "*/*") | error_responses(403, 404),
)
def download(
    token: str,
    relpath: str,
    state: State,
    range_header: Annotated[str | None, Header(alias="range")] = None,
) -> Response:
    version_id = signing.verify_download(state.server_secret, token, relpath, state.clock.now())
    gone = NotFound("this checkpoint was deleted or has expired; its download links no longer work")
    with state.database.reader() as db:
        version = db.get(ModelVersion, version_id)
        if version is None or not checkpoints.downloadable(version, state.clock):
            raise gone
        uri = version.artifact_uri
    try:
        if uri is None:
            raise FileNotFoundError(version_id)
        root = state.store.open_dir(uri)
    except FileNotFoundError as exc:
        raise gone from exc
    # The signature already pins relpath; refuse escapes anyway should a signed one ever be odd.
    path = (root / relpath).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise NotFound(f"{relpath!r} is not a file of this checkpoint; request new URLs")
    # FileResponse serves ranges itself; only its refusal is answered here, with the body every
    # error has.
    size = path.stat().st_size
    span = ranges.single(range_header, size)
    if range_header is not None and span is not None and span[0] >= size:
        return ranges.not_satisfiable(range_header, size)
    return FileResponse(path, filename=path.name)
