"""Downloads of a model version: signed per-file URLs and one signed URL for a tar archive.

A version is addressed by its tinker path or by a registry reference (`package@alias`,
`package:version`). The URLs need no API key and stop working at `expires`.
"""

from __future__ import annotations

from datetime import datetime

from treadle.types._base import WireRequest, WireResponse
from treadle.types.bounds import CheckpointPathText


class DownloadUrlsRequest(WireRequest):
    path: CheckpointPathText
    """A tinker path (`tinker://<run>/<segment>/<name>`) or a registry reference."""


class DownloadFile(WireResponse):
    path: str
    """The file's path inside the version (POSIX), where it belongs under the download folder."""
    size_bytes: int
    sha256: str
    """Hex digest of the file's bytes, to verify a download."""
    url: str
    """Signed URL of the file; Treadle's own answer HTTP Range requests."""


class DownloadUrlsResponse(WireResponse):
    version_id: str
    kind: str
    """`training`, `sampler`, `adapter` (a PEFT adapter folder) or `merged` (a Hugging Face
    model folder)."""
    files: list[DownloadFile]
    """Every file of the version, sorted by path."""
    archive_url: str
    """Signed URL of one uncompressed tar archive holding exactly `files`; it answers HTTP Range
    requests, and the same version always gives the same bytes."""
    archive_size_bytes: int
    expires: datetime
