"""The admin dashboard's session cookie and its CSRF token.

The cookie holds an admin API key's id, an expiry and a random nonce, and an HMAC-SHA256 over
them under the server secret; never the key itself. It proves that someone logged in with that
key before the expiry, nothing more: whoever checks it must still check that the key is
unrevoked and admin-scoped, since either may have changed since. The CSRF token of a session is
an HMAC of its cookie under another purpose, so it needs no storage, differs per login and
cannot be derived without the secret. This module knows nothing of HTTP or of the database.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

# Domain separation: the same secret keys API-key hashes and download tokens.
_COOKIE_PURPOSE = b"treadle-admin-session-v1\n"
_CSRF_PURPOSE = b"treadle-admin-csrf-v1\n"

COOKIE_NAME = "treadle_admin"
SESSION_LIFETIME = timedelta(hours=8)


@dataclass(frozen=True)
class AdminSession:
    """What a genuine, unexpired cookie says."""

    key_id: str
    expires_at: int
    """Unix seconds."""
    cookie: str
    """The cookie's value, from which its CSRF token is derived."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: bytes, purpose: bytes, message: bytes) -> bytes:
    return hmac.new(secret, purpose + message, hashlib.sha256).digest()


def issue(secret: bytes, key_id: str, now: datetime) -> str:
    """A cookie value for admin key `key_id`, valid for `SESSION_LIFETIME` from `now`."""
    expires = int((now + SESSION_LIFETIME).timestamp())
    payload = f"{key_id}\n{expires}\n{secrets.token_hex(8)}".encode()
    return f"{_b64(payload)}.{_b64(_mac(secret, _COOKIE_PURPOSE, payload))}"


def verify(secret: bytes, cookie: str, now: datetime) -> AdminSession | None:
    """The session `cookie` holds, or None when it is malformed, altered, signed under another
    secret or expired."""
    try:
        payload_text, signature = cookie.split(".")
        payload, given = _unb64(payload_text), _unb64(signature)
        key_id, expires_text, _nonce = payload.decode().split("\n")
        expires = int(expires_text)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None
    if not hmac.compare_digest(given, _mac(secret, _COOKIE_PURPOSE, payload)):
        return None
    if now.timestamp() >= expires:
        return None
    return AdminSession(key_id=key_id, expires_at=expires, cookie=cookie)


def csrf_token(secret: bytes, session: AdminSession) -> str:
    """The token every form of this session carries."""
    return _b64(_mac(secret, _CSRF_PURPOSE, session.cookie.encode()))


def csrf_matches(secret: bytes, session: AdminSession, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(token, csrf_token(secret, session))
