"""API keys: issue, authenticate, revoke.

A key reads `tml-<key id>-<secret>`. The `tml-` prefix is what the tinker SDK insists on; the key
id is public and indexes the row; the secret is stored only as HMAC-SHA256 under the server
secret, so a leaked database does not leak usable keys. The plain key exists once, in the return
value of `issue_api_key`; nothing here logs it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
from datetime import datetime, timedelta

from sqlalchemy import bindparam, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session as OrmSession

from core import audit
from core.clock import Clock
from core.errors import AuthenticationFailed, InvalidInput, NotFound, PermissionDenied
from core.tables import ApiKey, Tenant

KEY_PREFIX = "tml-"
MAX_NAME_LENGTH = 200  # the name column's length
SCOPES = ("tenant", "admin")
_KEY_RE = re.compile(r"^tml-([0-9a-f]{12})-([A-Za-z0-9_-]{32,128})$")
# Touch last_used_at at most this often, so authentication is not a write on every request.
_LAST_USED_RESOLUTION = timedelta(seconds=60)


@dataclasses.dataclass(frozen=True)
class Principal:
    """Who is calling: resolved from an API key."""

    tenant_id: str
    key_id: str
    scope: str
    # True when the key's last-used time is older than its resolution: call `touch` to record use.
    stale_last_used: bool = False
    # True when the tenant has a spend limit (per period or per session) when the key was read:
    # only then does a submission price its work, so tenants without one pay nothing for it.
    spend_limited: bool = False

    @property
    def is_admin(self) -> bool:
        return self.scope == "admin"


def _hash_secret(server_secret: bytes, secret: str) -> str:
    return hmac.new(server_secret, secret.encode(), hashlib.sha256).hexdigest()


def issue_api_key(
    db: OrmSession,
    clock: Clock,
    server_secret: bytes,
    tenant: Tenant,
    *,
    name: str,
    scope: str,
    actor: str = "operator",
) -> tuple[ApiKey, str]:
    """Create a key and return it with its plain text, which is never stored or shown again.
    The audit log records `actor` (an API key id, or "operator") as its creator."""
    if scope not in SCOPES:
        raise InvalidInput(f"scope {scope!r} is unknown; use one of {', '.join(SCOPES)}")
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidInput(
            f"the key name is {len(name)} characters long; use at most {MAX_NAME_LENGTH}"
        )
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    row = ApiKey(
        id=key_id,
        tenant_id=tenant.id,
        name=name or "unnamed",
        scope=scope,
        secret_hash=_hash_secret(server_secret, secret),
        created_at=clock.now(),
    )
    db.add(row)
    db.flush()
    audit.record(
        db,
        clock,
        tenant_id=tenant.id,
        actor=actor,
        action="api_key.created",
        target=key_id,
        detail={"name": row.name, "scope": scope},
    )
    return row, f"{KEY_PREFIX}{key_id}-{secret}"


# One indexed read of just the columns needed. It runs on every request, so the statement is
# built once: building it and deriving its cache key cost more than running it.
_KEY_AND_TENANT = (
    select(
        ApiKey.secret_hash,
        ApiKey.revoked_at,
        ApiKey.tenant_id,
        ApiKey.scope,
        ApiKey.last_used_at,
        Tenant.disabled,
        Tenant.spend_limit_micros,
        Tenant.session_spend_limit_micros,
    )
    .join(Tenant, Tenant.id == ApiKey.tenant_id)
    .where(ApiKey.id == bindparam("key_id"))
)


def authenticate(
    db: Connection, clock: Clock, server_secret: bytes, raw_key: str | None
) -> Principal:
    if not raw_key:
        raise AuthenticationFailed("missing API key; send it in the X-API-Key header")
    match = _KEY_RE.match(raw_key.strip())
    if match is None:
        raise AuthenticationFailed(
            "malformed API key; a Treadle key looks like tml-<12 hex>-<secret>, as printed by "
            "`treadle-server admin keys create`"
        )
    key_id, secret = match.groups()
    row = db.execute(_KEY_AND_TENANT, {"key_id": key_id}).one_or_none()
    # Compare even when the row is missing so timing does not reveal which key ids exist.
    expected = row.secret_hash if row is not None else "0" * 64
    valid = hmac.compare_digest(expected, _hash_secret(server_secret, secret))
    if row is None or not valid:
        raise AuthenticationFailed(
            "unknown API key; check the key or ask the operator for a new one"
        )
    if row.revoked_at is not None:
        raise AuthenticationFailed("this API key was revoked; ask the operator for a new one")
    if row.disabled:
        raise PermissionDenied("this tenant is disabled; contact the operator")
    now = clock.now()
    stale = last_used_is_stale(row.last_used_at, now)
    limited = row.spend_limit_micros is not None or row.session_spend_limit_micros is not None
    return Principal(
        tenant_id=row.tenant_id,
        key_id=key_id,
        scope=row.scope,
        stale_last_used=stale,
        spend_limited=limited,
    )


def last_used_is_stale(last_used_at: datetime | None, now: datetime) -> bool:
    """Whether a key's last-used time is worth writing again (at most once a minute)."""
    return last_used_at is None or now - last_used_at >= _LAST_USED_RESOLUTION


def touch(db: OrmSession, clock: Clock, key_id: str) -> None:
    """Record that a key was used (authentication itself only reads)."""
    row = db.get(ApiKey, key_id)
    if row is not None:
        row.last_used_at = clock.now()


def revoke_api_key(db: OrmSession, clock: Clock, key_id: str, *, actor: str = "operator") -> ApiKey:
    """Revoke the key (revoking a revoked key changes nothing and is not logged again)."""
    row = db.get(ApiKey, key_id)
    if row is None:
        raise NotFound(
            f"no API key with id {key_id!r}; list keys with `treadle-server admin keys list`"
        )
    if row.revoked_at is None:
        row.revoked_at = clock.now()
        audit.record(
            db,
            clock,
            tenant_id=row.tenant_id,
            actor=actor,
            action="api_key.revoked",
            target=key_id,
            detail={"name": row.name},
        )
    return row


def list_api_keys(db: OrmSession, tenant_id: str | None = None) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at)
    if tenant_id is not None:
        query = query.where(ApiKey.tenant_id == tenant_id)
    return list(db.scalars(query))


def is_key_usable(db: OrmSession, server_secret: bytes, raw_key: str) -> bool:
    """True when `raw_key` would authenticate (used to reuse the embedded default key)."""
    match = _KEY_RE.match(raw_key.strip())
    if match is None:
        return False
    row = db.get(ApiKey, match.group(1))
    return (
        row is not None
        and row.revoked_at is None
        and hmac.compare_digest(row.secret_hash, _hash_secret(server_secret, match.group(2)))
    )
