"""Signed, expiring download tokens for the files of a saved checkpoint.

A token names one file (model version id and the file's path inside the artifact), or the
archive of a whole version, and an expiry time, and carries an HMAC-SHA256 over them under the
server secret. Whoever holds it may fetch that file or archive until it expires, without an API
key: the tinker CLI downloads signed URLs with plain urllib. This module knows nothing of HTTP
or of where artifacts live.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from datetime import UTC, datetime

from core.errors import PermissionDenied

# Domain separation: the same secret also keys API-key hashes, and a file's token never
# passes for an archive's.
_PURPOSE = b"treadle-artifact-download-v1\n"
_ARCHIVE_PURPOSE = b"treadle-artifact-archive-v1\n"


class InvalidDownloadToken(PermissionDenied):
    """The token was altered, is for another file, or was signed under another secret."""


class DownloadTokenExpired(PermissionDenied):
    """The token was valid but its time is up."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(
    secret: bytes, version_id: str, relpath: str, expires: int, purpose: bytes = _PURPOSE
) -> bytes:
    message = purpose + f"{version_id}\n{relpath}\n{expires}".encode()
    return hmac.new(secret, message, hashlib.sha256).digest()


def sign_download(
    secret: bytes, version_id: str, relpath: str, expires_at: datetime, *, archive: bool = False
) -> str:
    """A URL-safe token allowing a download of `relpath` of `version_id` until `expires_at`;
    with `archive`, of the whole version as one archive (`relpath` then names the archive)."""
    expires = int(expires_at.timestamp())
    payload = _b64(f"{version_id}\n{expires}".encode())
    purpose = _ARCHIVE_PURPOSE if archive else _PURPOSE
    return f"{payload}.{_b64(_mac(secret, version_id, relpath, expires, purpose))}"


def verify_download(
    secret: bytes, token: str, relpath: str, now: datetime, *, archive: bool = False
) -> str:
    """The model version id the token grants `relpath` of (with `archive`, the archive of).

    Raises:
        InvalidDownloadToken: the token is malformed, altered, or for another file.
        DownloadTokenExpired: the token is genuine but expired.
    """
    invalid = InvalidDownloadToken(
        "this download link is invalid (altered, or for another file); request new URLs with "
        "RestClient.get_download_urls() or get_external_weights_urls()"
    )
    try:
        payload, signature = token.split(".")
        version_id, expires_text = _unb64(payload).decode().split("\n")
        expires = int(expires_text)
        given = _unb64(signature)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise invalid from None
    purpose = _ARCHIVE_PURPOSE if archive else _PURPOSE
    if not hmac.compare_digest(given, _mac(secret, version_id, relpath, expires, purpose)):
        raise invalid
    if now.timestamp() >= expires:
        when = datetime.fromtimestamp(expires, UTC).isoformat()
        raise DownloadTokenExpired(
            f"this download link expired at {when}; request new URLs with "
            "RestClient.get_download_urls() or get_external_weights_urls()"
        )
    return version_id
