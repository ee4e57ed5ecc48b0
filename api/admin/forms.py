"""`/admin` forms that change something: a tenant's limits, a new API key, a revoked key.

Each checks the session's CSRF token first, then calls the core function the admin CLI calls
(`core.tenants.update_tenant_limits` and `set_spend_limits`, `core.apikeys.issue_api_key` and
`revoke_api_key`) with the admin key's id as the audit log's actor; a refused value shows the
tenants page again with the reason, and a change redirects to the tenants page (so reloading it
posts nothing). A new key's plain text is shown in the answer to its post, the only place it
can be: that form carries how many keys existed when it was shown, and a post made after
another key was issued (the same form sent again by a reload) is refused, so a reload never
issues a second key.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.admin.auth import PageAdmin, check_csrf
from api.admin.render import Form, keys_issued, redirect, tenants_page
from api.deps import State
from core import apikeys, tenants
from core.errors import InvalidInput, NotFound

router = APIRouter(prefix="/admin", include_in_schema=False)

_MAX_MICROS = 2**63 - 1  # the spend limit's column is a BIGINT
_SENT_AGAIN = (
    "a key was issued since this form was shown (was it sent twice?); check the keys below "
    "and fill in the form again to issue another"
)


def _whole(form: dict[str, str], name: str) -> int:
    try:
        return int(form.get(name, "").strip())
    except ValueError:
        raise InvalidInput(f"{name} {form.get(name, '')[:40]!r} is not a whole number") from None


def _micros(text: str) -> int | None:
    """Dollars as micro-units; blank: no limit."""
    if not text.strip():
        return None
    refusal = InvalidInput(
        f"monthly limit {text[:40]!r} is not an amount of dollars; write e.g. 250 or 99.50, "
        "or leave it blank for no limit"
    )
    try:
        amount = Decimal(text.strip().lstrip("$").replace(",", "")) * 1_000_000
    except InvalidOperation:
        raise refusal from None
    if not amount.is_finite() or abs(amount) > _MAX_MICROS:
        raise refusal
    if amount < 0:
        raise InvalidInput(
            "the monthly limit is negative; write 0 or more dollars, or leave it blank"
        )
    return int(amount.to_integral_value())


@router.post("/tenants/{tenant_id}/limits")
def change_limits(
    request: Request, state: State, admin: PageAdmin, form: Form, tenant_id: str
) -> Response:
    """Set a tenant's session quota, LoRA rank ceiling and monthly spend limit."""
    check_csrf(state, admin, form.get("csrf"))
    try:
        sessions, rank = _whole(form, "max_concurrent_sessions"), _whole(form, "max_lora_rank")
        monthly = _micros(form.get("monthly_dollars", ""))
        with state.database.transaction() as db:
            tenant = tenants.find_tenant(db, tenant_id)
            tenants.update_tenant_limits(
                db,
                tenant,
                clock=state.clock,
                actor=admin.actor,
                max_concurrent_sessions=sessions,
                max_lora_rank=rank,
            )
            tenants.set_spend_limits(
                db, state.clock, tenant, monthly_micros=monthly, actor=admin.actor
            )
    except (InvalidInput, NotFound) as refused:
        return tenants_page(request, state, admin, status=422, error=str(refused))
    return redirect(request, "tenants")


@router.post("/keys")
def create_key(request: Request, state: State, admin: PageAdmin, form: Form) -> Response:
    """Issue a key; the page shows its plain text this once."""
    check_csrf(state, admin, form.get("csrf"))
    try:
        with state.database.transaction() as db:
            if form.get("issued") != str(keys_issued(db)):
                return tenants_page(request, state, admin, status=409, error=_SENT_AGAIN)
            tenant = tenants.find_tenant(db, form.get("tenant_id", ""))
            row, key = apikeys.issue_api_key(
                db,
                state.clock,
                state.server_secret,
                tenant,
                name=form.get("name", "").strip(),
                scope=form.get("scope", ""),
                actor=admin.actor,
            )
            created = {
                "key_id": row.id,
                "scope": row.scope,
                "tenant_name": tenant.name,
                "key": key,
            }
    except (InvalidInput, NotFound) as refused:
        return tenants_page(request, state, admin, status=422, error=str(refused))
    return tenants_page(request, state, admin, created=created)


@router.post("/keys/{key_id}/revoke")
def revoke_key(
    request: Request, state: State, admin: PageAdmin, form: Form, key_id: str
) -> Response:
    check_csrf(state, admin, form.get("csrf"))
    try:
        with state.database.transaction() as db:
            apikeys.revoke_api_key(db, state.clock, key_id, actor=admin.actor)
    except NotFound as refused:
        return tenants_page(request, state, admin, status=404, error=str(refused))
    return redirect(request, "tenants")
