"""The admin dashboard's JSON routes and forms through the app (`/admin`, `/admin/api/*`), on
SQLite and PostgreSQL: usage seeded into the ledger and its rollups comes back summed per
bucket and group (and as CSV, formula-like names quoted); far-out dates refused; who gets in
(an admin key's cookie or header) and who does not (no cookie, a tenant key, a forged, expired,
revoked-key or disabled-tenant cookie); logins and logouts audited; forms refuse posts without
the session's CSRF token, over-long key names and a key form sent twice, and change limits and
keys through the core functions; the live, fleet and key lists bounded; answers never cached;
names escaped; no page or file refers to another origin. tests/e2e/test_admin_browser.py drives
the pages in a browser."""

from __future__ import annotations

import csv
import io
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.admin import cookies, overview
from api.admin.api import csv_cell
from core.clock import FakeClock
from core.db import Database
from core.tables import ApiKey, AuditLog, Tenant
from scheduler import oplog
from scheduler.failures import OpFailure
from tests.builders import TenantKey, record, tenant_factory
from tests.scheduling import Rows
from tests.server import AppFactory

pytestmark = pytest.mark.integration

NOW = datetime(2026, 3, 10, 12, 30, tzinfo=UTC)
DAY = datetime(2026, 3, 9, tzinfo=UTC)  # the day before NOW: all seeded usage is in it or NOW's
EXTERNAL = re.compile(r"https?://|[\"'(=]\s*//", re.IGNORECASE)


@dataclass
class Dashboard:
    client: TestClient
    database: Database
    clock: FakeClock
    admin: TenantKey
    acme: TenantKey
    globex: TenantKey

    def log_in(self, key: str | None = None) -> None:
        response = self.client.post(
            "/admin/login", data={"key": key or self.admin.key}, follow_redirects=False
        )
        assert response.status_code == 303, response.text
        assert response.headers["location"] == "/admin/usage"

    def csrf(self, page: str = "/admin/tenants") -> str:
        return self.hidden(page, "csrf")

    def hidden(self, page: str, name: str) -> str:
        """The value of the page's first hidden field `name`."""
        html = self.client.get(page).text
        found = re.search(rf'name="{name}" value="([^"]+)"', html)
        assert found is not None, html
        return found.group(1)


@pytest.fixture
def dashboard(app_factory: AppFactory, database_url: str) -> Iterator[Dashboard]:
    clock = FakeClock(NOW)
    app = app_factory(database_url, clock=clock)
    state = app.state.treadle
    make = tenant_factory(state.database, state.settings, clock)
    admin = make("operators", scope="admin")
    acme, globex = make("acme"), make("globex")
    with TestClient(app) as client:
        yield Dashboard(client, state.database, clock, admin, acme, globex)


def _seed(d: Dashboard) -> None:
    record(d.database, d.acme, DAY.replace(hour=3), quantity=1000, amount_micros=2_000_000)
    record(d.database, d.acme, DAY.replace(hour=3), kind="sampling_sample", quantity=500,
           amount_micros=500_000)  # fmt: skip
    record(d.database, d.acme, DAY.replace(hour=3), kind="checkpoint", quantity=1,
           amount_micros=100_000)  # fmt: skip
    record(d.database, d.globex, DAY.replace(hour=7), model="m/b", quantity=4000,
           amount_micros=1_000_000)  # fmt: skip
    record(d.database, d.globex, NOW.replace(minute=0), model="m/b", quantity=10,
           amount_micros=10)  # fmt: skip
    # Outside the range asked for: never counted.
    record(d.database, d.acme, DAY - timedelta(days=3), quantity=7, amount_micros=7)


def test_usage_sums_the_rollups_per_bucket_and_group(dashboard: Dashboard) -> None:
    d = dashboard
    _seed(d)
    headers = {"X-API-Key": d.admin.key}
    query = {"start": "2026-03-09", "end": "2026-03-11", "bucket": "day", "group": "tenant"}
    body = d.client.get("/admin/api/usage", params=query, headers=headers).json()
    assert body["buckets"] == ["2026-03-09T00:00:00Z", "2026-03-10T00:00:00Z"]
    series = {s["label"]: s for s in body["series"]}
    assert series["acme"]["tokens"] == [1500, 0]  # the checkpoint adds cost, not tokens
    assert series["acme"]["cost_micros"] == [2_600_000, 0]
    assert series["globex"]["tokens"] == [4000, 10]
    assert series["globex"]["cost_micros"] == [1_000_000, 10]
    assert [s["label"] for s in body["series"]] == ["acme", "globex"]  # by cost, largest first
    top = [(t["name"], t["tokens"], t["cost_micros"], t["cost"]) for t in body["top_tenants"]]
    assert top == [("acme", 1500, 2_600_000, "$2.60"), ("globex", 4010, 1_000_010, "$1.00001")]

    hourly = d.client.get(
        "/admin/api/usage", params=query | {"bucket": "hour", "group": "kind"}, headers=headers
    ).json()
    assert len(hourly["buckets"]) == 48
    kinds = {s["key"]: s for s in hourly["series"]}
    assert set(kinds) == {"training", "sampling_sample", "checkpoint"}
    assert kinds["training"]["tokens"][3] == 1000 and kinds["training"]["tokens"][7] == 4000
    assert kinds["training"]["tokens"][36] == 10 and sum(kinds["training"]["tokens"]) == 5010
    assert kinds["checkpoint"]["cost_micros"][3] == 100_000

    by_key = d.client.get(
        "/admin/api/usage", params=query | {"group": "key"}, headers=headers
    ).json()
    assert {s["label"] for s in by_key["series"]} == {
        f"test ({d.acme.key_id})",
        f"test ({d.globex.key_id})",
    }
    by_model = d.client.get(
        "/admin/api/usage", params=query | {"group": "model"}, headers=headers
    ).json()
    assert {s["key"]: sum(s["tokens"]) for s in by_model["series"]} == {"m/a": 1000 + 500,
                                                                         "m/b": 4010}  # fmt: skip

    exported = d.client.get("/admin/api/usage.csv", params=query, headers=headers)
    assert exported.headers["content-type"].startswith("text/csv")
    lines = list(csv.DictReader(io.StringIO(exported.text)))
    assert [(r["bucket_start"][:10], r["label"], r["tokens"], r["cost_micros"]) for r in lines] == [
        ("2026-03-09", "acme", "1500", "2600000"),
        ("2026-03-09", "globex", "4000", "1000000"),
        ("2026-03-10", "globex", "10", "10"),
    ]

    # Hours span at most a week, the default range.
    week = {"start": "2026-03-04", "end": "2026-03-11", "bucket": "hour"}
    assert d.client.get("/admin/api/usage", params=week, headers=headers).status_code == 200
    too_long = d.client.get(
        "/admin/api/usage", params=week | {"start": "2026-03-03T23:00:00"}, headers=headers
    )
    assert too_long.status_code == 422
    assert "narrow the range to 7 days or use day buckets" in too_long.json()["detail"]
    bad = d.client.get("/admin/api/usage", params={"start": "yesterday"}, headers=headers)
    assert bad.status_code == 422 and "2026-01-31" in bad.json()["detail"]


def test_day_buckets_of_a_range_cut_mid_day_hold_only_its_hours(dashboard: Dashboard) -> None:
    """Day buckets sum the hours that start in the range, as its hour buckets do, whether the
    range starts and ends at midnight (whole days, read from the daily rollups), mid-day or
    mid-hour (the cut days' hours read from the hourly ones); the top tenants likewise."""
    d = dashboard
    first = DAY - timedelta(days=1)
    for n in range(56):
        kind = ("training", "sampling_sample", "checkpoint")[n % 3]
        record(d.database, (d.acme, d.globex)[n % 2], first + timedelta(hours=n), kind=kind,
               model=f"m/{n % 4}", quantity=n + 1, amount_micros=1000 * (n + 1))  # fmt: skip
    headers = {"X-API-Key": d.admin.key}
    ranges = [
        ("2026-03-08", "2026-03-10"),
        ("2026-03-08T05:00:00Z", "2026-03-10T04:00:00Z"),
        ("2026-03-08T05:30:00Z", "2026-03-09T21:59:00Z"),
        ("2026-03-08T23:00:00Z", "2026-03-09T01:00:00Z"),
        ("2026-03-09T10:00:00+05:30", "2026-03-10T10:00:00+05:30"),
    ]
    for start, end in ranges:
        query = {"start": start, "end": end, "group": "model"}
        days = d.client.get("/admin/api/usage", params=query, headers=headers).json()
        hours = d.client.get(
            "/admin/api/usage", params=query | {"bucket": "hour"}, headers=headers
        ).json()
        folded: dict[tuple[str, str], list[int]] = {}
        for s in hours["series"]:
            for moment, tokens, cost in zip(
                hours["buckets"], s["tokens"], s["cost_micros"], strict=True
            ):
                sums = folded.setdefault((s["key"], moment[:10]), [0, 0])
                sums[0] += tokens
                sums[1] += cost
        by_day = {
            (s["key"], moment[:10]): [tokens, cost]
            for s in days["series"]
            for moment, tokens, cost in zip(
                days["buckets"], s["tokens"], s["cost_micros"], strict=True
            )
        }
        assert by_day == folded, (start, end)
        assert days["top_tenants"] == hours["top_tenants"], (start, end)
        assert sum(t["cost_micros"] for t in days["top_tenants"]) > 0
    # From 05:30 on the 8th to 21:59 on the 9th: the hours 06:00 to 21:00 of the 8th in its
    # bucket, 00:00 to 21:00 of the 9th in the next; acme's are the even hours, globex's odd.
    query = {"start": ranges[2][0], "end": ranges[2][1], "group": "tenant"}
    body = d.client.get("/admin/api/usage", params=query, headers=headers).json()
    assert body["buckets"] == ["2026-03-08T00:00:00Z", "2026-03-09T00:00:00Z"]
    assert {s["label"]: s["cost_micros"] for s in body["series"]} == {
        name: [1000 * sum(n + 1 for n in range(*day)) for day in days]
        for name, days in (
            ("acme", ((6, 24, 2), (24, 46, 2))),
            ("globex", ((7, 24, 2), (25, 46, 2))),
        )
    }


def test_only_an_admin_gets_in_and_a_cookie_counts_only_while_valid(
    dashboard: Dashboard,
) -> None:
    d = dashboard
    routes = ["/admin/api/usage", "/admin/api/tenants", "/admin/api/live", "/admin/api/fleet",
              "/admin/api/billing"]  # fmt: skip
    pages = ["/admin/usage", "/admin/live", "/admin/fleet", "/admin/tenants", "/admin/live/tables",
             "/admin/billing"]  # fmt: skip
    for path in routes:
        assert d.client.get(path).status_code == 401, path
        tenant = d.client.get(path, headers={"X-API-Key": d.acme.key})
        assert tenant.status_code == 403, path
        assert d.client.get(path, headers={"X-API-Key": d.admin.key}).status_code == 200, path
    for path in pages:
        away = d.client.get(path, follow_redirects=False)
        assert (away.status_code, away.headers["location"]) == (303, "/admin/login"), path
        assert d.client.get(path, headers={"X-API-Key": d.acme.key}).status_code == 403, path
    refresh = d.client.get("/admin/live/tables", headers={"HX-Request": "true"})
    assert (refresh.status_code, refresh.headers["hx-redirect"]) == (204, "/admin/login")

    refused = d.client.post("/admin/login", data={"key": d.acme.key}, follow_redirects=False)
    assert refused.status_code == 403 and "admin-scope key" in refused.text
    assert cookies.COOKIE_NAME not in refused.cookies
    wrong = d.client.post("/admin/login", data={"key": "tml-000000000000-" + "x" * 40})
    assert wrong.status_code == 401 and "unknown API key" in wrong.text

    response = d.client.post("/admin/login", data={"key": d.admin.key}, follow_redirects=False)
    set_cookie = response.headers["set-cookie"]
    assert "HttpOnly" in set_cookie and "SameSite=strict" in set_cookie
    assert "Secure" not in set_cookie  # plain http here; see the https test
    value = d.client.cookies[cookies.COOKIE_NAME]
    assert d.admin.key not in value and d.admin.key.split("-", 2)[2] not in value
    for path in routes + pages:
        assert d.client.get(path).status_code == 200, path

    payload, signature = value.split(".")
    forged_payload = cookies._b64(cookies._unb64(payload).replace(b"\n", b"\n9", 1))
    for forged in (f"{forged_payload}.{signature}", f"{payload}.{signature[:-2]}AA", "junk"):
        d.client.cookies.clear()
        d.client.cookies.set(cookies.COOKIE_NAME, forged)
        assert d.client.get("/admin/api/live").status_code == 401
        assert d.client.get("/admin/live", follow_redirects=False).status_code == 303

    d.client.cookies.clear()
    d.client.cookies.set(cookies.COOKIE_NAME, value)
    assert d.client.get("/admin/api/live").status_code == 200
    d.clock.advance(cookies.SESSION_LIFETIME.total_seconds())
    assert d.client.get("/admin/api/live").status_code == 401  # expired
    assert d.client.get("/admin/live", follow_redirects=False).status_code == 303


def test_a_revoked_keys_cookie_is_refused_at_once(dashboard: Dashboard) -> None:
    d = dashboard
    d.log_in()
    other = tenant_factory(d.database, d.client.app.state.treadle.settings, d.clock)(
        "second-operators", scope="admin"
    )
    # Revoke the logged-in key through the dashboard itself, as another admin would.
    headers = {"X-API-Key": other.key}
    revoke = d.client.post(
        f"/admin/keys/{d.admin.key_id}/revoke", data={}, headers=headers, follow_redirects=False
    )
    assert revoke.status_code == 303, revoke.text
    assert d.client.get("/admin/api/usage", headers={}).status_code == 401
    assert d.client.get("/admin/api/usage", headers={"X-API-Key": d.admin.key}).status_code == 401


def test_forms_need_the_sessions_csrf_token_and_go_through_core(dashboard: Dashboard) -> None:
    d = dashboard
    d.log_in()
    token = d.csrf()
    path = f"/admin/tenants/{d.acme.tenant_id}/limits"
    fields = {"max_concurrent_sessions": "25", "max_lora_rank": "32", "monthly_dollars": "150.5"}
    for form in (fields, fields | {"csrf": "forged"}, fields | {"csrf": ""}):
        refused = d.client.post(path, data=form, follow_redirects=False)
        assert refused.status_code == 403 and "CSRF" in refused.json()["detail"]
    assert d.client.post(f"/admin/keys/{d.globex.key_id}/revoke", data={}).status_code == 403
    assert d.client.post("/admin/logout", data={}).status_code == 403
    with d.database.reader() as db:
        tenant = db.get(Tenant, d.acme.tenant_id)
        assert tenant is not None and tenant.max_concurrent_sessions == 10

    changed = d.client.post(path, data=fields | {"csrf": token}, follow_redirects=False)
    assert changed.status_code == 303, changed.text
    row = next(
        t for t in d.client.get("/admin/api/tenants").json()["tenants"] if t["name"] == "acme"
    )
    assert row["max_concurrent_sessions"] == 25 and row["max_lora_rank"] == 32
    assert row["spend_limit_micros"] == 150_500_000
    with d.database.reader() as db:
        actors = db.scalars(
            select(AuditLog.actor).where(AuditLog.action == "tenant.limit_changed")
        ).all()
    assert actors and set(actors) == {d.admin.key_id}
    round_limit = fields | {"csrf": token, "monthly_dollars": "100"}
    assert d.client.post(path, data=round_limit, follow_redirects=False).status_code == 303
    assert (
        'name="monthly_dollars" type="text" inputmode="decimal" value="100"'
        in d.client.get("/admin/tenants").text
    )
    for dollars in ("NaN", "Infinity", "1e30", "ten"):
        refused = d.client.post(path, data=fields | {"csrf": token, "monthly_dollars": dollars})
        assert refused.status_code == 422 and "not an amount of dollars" in refused.text
    invalid = d.client.post(path, data=fields | {"csrf": token, "max_lora_rank": "0"})
    assert invalid.status_code == 422 and "max LoRA rank 0 is outside" in invalid.text

    issued = d.hidden("/admin/tenants", "issued")
    created = d.client.post(
        "/admin/keys",
        data={"csrf": token, "tenant_id": d.globex.tenant_id, "name": "ci", "scope": "tenant"}
        | {"issued": issued},
    )
    assert created.status_code == 200, created.text
    found = re.search(r'<code id="new-key">(tml-[^<]+)</code>', created.text)
    assert found is not None
    new_key = found.group(1)
    assert d.client.get("/api/v1/usage", headers={"X-API-Key": new_key}).status_code == 200
    assert new_key not in d.client.get("/admin/tenants").text  # shown once only
    key_id = new_key.split("-")[1]
    keys = {k["key_id"]: k for k in d.client.get("/admin/api/tenants").json()["keys"]}
    assert keys[key_id]["name"] == "ci" and keys[key_id]["revoked_at"] is None

    revoked = d.client.post(
        f"/admin/keys/{key_id}/revoke", data={"csrf": token}, follow_redirects=False
    )
    assert revoked.status_code == 303
    assert d.client.get("/api/v1/usage", headers={"X-API-Key": new_key}).status_code == 401

    out = d.client.post("/admin/logout", data={"csrf": token}, follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/admin/login"
    assert d.client.get("/admin/api/tenants").status_code == 401


def test_the_cookie_is_secure_over_https(app_factory: AppFactory, sqlite_url: str) -> None:
    app = app_factory(sqlite_url)
    state = app.state.treadle
    admin = tenant_factory(state.database, state.settings)("ops", scope="admin")
    with TestClient(app, base_url="https://testserver") as client:
        response = client.post("/admin/login", data={"key": admin.key}, follow_redirects=False)
    assert response.status_code == 303
    assert "Secure" in response.headers["set-cookie"]


def test_live_and_fleet_show_sessions_runs_failures_and_workers(dashboard: Dashboard) -> None:
    d = dashboard
    rows = Rows(d.database, d.clock)
    rows.worker("w-live", ["m/a"], lease_seconds=600)
    rows.worker("w-gone", ["m/a"], dead=True)
    run = rows.run(d.acme.tenant_id, base_model="m/a")
    # Behind a gap in its run's seq_ids, so no worker can claim it: it waits for certain.
    waiting = rows.training_op(run, 5).request_id
    failing = rows.run(d.globex.tenant_id, base_model="m/a")
    # Behind a gap too, so the embedded engine never claims it before it is failed here.
    op = rows.op(rows.training_op(failing, 7).request_id)
    with d.database.transaction() as db:
        loaded = db.merge(op)
        oplog.fail_now(loaded, OpFailure.user("rank too large for this model"), d.clock.now())
    d.clock.advance(90)
    headers = {"X-API-Key": d.admin.key}

    live = d.client.get("/admin/api/live", headers=headers).json()
    assert {s["tenant_name"] for s in live["sessions"]} == {"acme", "globex"}
    assert run in [r["run_id"] for r in live["runs"]]
    # The embedded engine may fail the runs' create_model too (no engine serves m/a).
    failed = next(f for f in live["failed"] if f["op_id"] == op.id)
    assert failed["error_code"] == "invalid_input" and failed["tenant_name"] == "globex"
    assert "rank too large" in failed["error_message"]
    stuck = {s["op_id"]: s for s in live["stuck"]}
    assert waiting in stuck and stuck[waiting]["status"] == "queued", live["stuck"]
    assert all(s["waited_seconds"] >= 60 and s["reason"] for s in live["stuck"])
    assert live["stuck_total"] == len(live["stuck"])

    fleet = d.client.get("/admin/api/fleet", headers=headers).json()
    workers = {w["worker_id"]: w for w in fleet["workers"]}
    assert workers["w-live"]["status"] == "live" and workers["w-live"]["runs_placed"] == 0
    assert "w-gone" not in workers  # dead and holding nothing: a departure only
    assert [(g["worker_id"], g["status"]) for g in fleet["departures"]] == [("w-gone", "dead")]
    gone_at = datetime.fromisoformat(fleet["departures"][0]["at"])
    assert gone_at == NOW - timedelta(seconds=1)  # its lapsed lease, read back in UTC

    d.log_in()
    tables = d.client.get("/admin/live/tables").text
    assert op.id in tables and "invalid_input" in tables and "rank too large" in tables
    assert "w-gone" in d.client.get("/admin/fleet").text


def test_pages_and_files_refer_to_no_other_origin(dashboard: Dashboard) -> None:
    d = dashboard
    d.log_in()
    seen: set[str] = set()
    pages = ("login", "usage", "live", "fleet", "tenants", "billing")
    for page in (f"/admin/{name}" for name in pages):
        response = d.client.get(page)
        assert response.status_code == 200, page
        policy = response.headers["content-security-policy"]
        assert "default-src 'self'" in policy and "unsafe" not in policy
        assert response.headers["x-frame-options"] == "DENY"
        html = response.text
        assert not EXTERNAL.search(html), (page, EXTERNAL.search(html))
        assert re.search(r"<script\b[^>]*>[^<]+</script>|\son[a-z]+\s*=|<style", html) is None
        seen.update(re.findall(r"""(?:src|href)\s*=\s*["'](/admin/static/[^"']+)["']""", html))
    assert seen == {
        "/admin/static/admin.css",
        "/admin/static/admin.png",
        "/admin/static/admin.js",
        "/admin/static/vendor/htmx.min.js",
        "/admin/static/vendor/chart.umd.min.js",
    }
    for path in seen - {"/admin/static/admin.png"}:
        text = d.client.get(path).text
        # Licence banners (`/*! ... */`) name their projects' sites; nothing else may.
        code = re.sub(r"/\*!.*?\*/", "", text, flags=re.DOTALL)
        assert not re.search(r"https?://", code), (path, re.search(r".{40}https?://.{40}", code))


def test_the_dashboard_stays_out_of_the_openapi_document(dashboard: Dashboard) -> None:
    paths = dashboard.client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith("/admin")]


def test_admin_api_answers_are_not_cached(dashboard: Dashboard) -> None:
    headers = {"X-API-Key": dashboard.admin.key}
    for path in ("usage", "usage.csv", "tenants", "live", "fleet", "billing"):
        response = dashboard.client.get(f"/admin/api/{path}", headers=headers)
        assert response.status_code == 200, path
        assert response.headers["cache-control"] == "no-store", path


def test_names_reach_the_csv_as_text_and_the_pages_escaped(dashboard: Dashboard) -> None:
    d = dashboard
    make = tenant_factory(d.database, d.client.app.state.treadle.settings, d.clock)
    formulas = {name: make(name) for name in ("=1+2", "+1", "-1", "@SUM(A1)")}
    script = make("<script>alert(1)</script>")
    for tenant in [*formulas.values(), script]:
        record(d.database, tenant, DAY, quantity=10, amount_micros=10)
    headers = {"X-API-Key": d.admin.key}
    query = {"start": "2026-03-09", "end": "2026-03-10", "group": "tenant"}
    exported = d.client.get("/admin/api/usage.csv", params=query, headers=headers)
    labels = {r["label"] for r in csv.DictReader(io.StringIO(exported.text))}
    assert labels >= {f"'{name}" for name in formulas} | {"<script>alert(1)</script>"}
    # Names are stripped, so none starts with a tab or carriage return; the cell would be quoted.
    assert [csv_cell(text) for text in ("\tx", "\rx", "a=1")] == ["'\tx", "'\rx", "a=1"]

    d.log_in()
    for page in ("/admin/tenants", "/admin/live/tables"):
        html = d.client.get(page).text
        assert "<script>alert" not in html, page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in d.client.get("/admin/tenants").text


def test_far_out_dates_are_refused_not_failed(dashboard: Dashboard) -> None:
    d = dashboard
    headers = {"X-API-Key": d.admin.key}
    for start, end in (("9999-12-30", "9999-12-31T23:00:00"), ("0001-01-01", "0001-01-02")):
        query = {"start": start, "end": end, "bucket": "hour"}
        for path in ("/admin/api/usage", "/admin/api/usage.csv"):
            refused = d.client.get(path, params=query, headers=headers)
            assert refused.status_code == 422, (path, refused.text)
            assert "outside the years 2000 to 2200" in refused.json()["detail"]
    d.log_in()
    page = d.client.get("/admin/usage", params={"start": "9999-12-31"})
    assert page.status_code == 400 and "outside the years 2000 to 2200" in page.text


def test_the_cookie_is_secure_when_the_setting_says_always(
    app_factory: AppFactory, sqlite_url: str
) -> None:
    app = app_factory(sqlite_url, admin_secure_cookie="always")
    state = app.state.treadle
    admin = tenant_factory(state.database, state.settings)("ops", scope="admin")
    with TestClient(app) as client:  # plain http, as behind a proxy that terminates TLS
        response = client.post("/admin/login", data={"key": admin.key}, follow_redirects=False)
    assert response.status_code == 303
    assert "Secure" in response.headers["set-cookie"]


def test_logging_in_and_out_is_audited(dashboard: Dashboard) -> None:
    d = dashboard
    d.log_in()
    d.client.post("/admin/login", data={"key": d.acme.key})  # refused: not audited
    out = d.client.post("/admin/logout", data={"csrf": d.csrf()}, follow_redirects=False)
    assert out.status_code == 303
    with d.database.reader() as db:
        found = db.execute(
            select(AuditLog.action, AuditLog.actor, AuditLog.target, AuditLog.tenant_id)
            .where(AuditLog.action.startswith("admin."))
            .order_by(AuditLog.id)
        ).all()
    admin = (d.admin.key_id, d.admin.key_id, d.admin.tenant_id)
    assert [tuple(row) for row in found] == [
        ("admin.logged_in", *admin),
        ("admin.logged_out", *admin),
    ]


def test_a_disabled_tenants_cookie_is_refused(dashboard: Dashboard) -> None:
    d = dashboard
    d.log_in()
    assert d.client.get("/admin/api/live").status_code == 200
    with d.database.transaction() as db:
        tenant = db.get(Tenant, d.admin.tenant_id)
        assert tenant is not None
        tenant.disabled = True
    assert d.client.get("/admin/api/live").status_code == 401
    assert d.client.get("/admin/live", follow_redirects=False).status_code == 303


def test_the_key_form_refuses_a_post_without_the_token_or_sent_twice(
    dashboard: Dashboard,
) -> None:
    d = dashboard
    d.log_in()
    token = d.csrf()
    form = {"tenant_id": d.globex.tenant_id, "name": "ci", "scope": "tenant"}
    form |= {"issued": d.hidden("/admin/tenants", "issued")}

    def keys() -> list[str]:
        return [k["name"] for k in d.client.get("/admin/api/tenants").json()["keys"]]

    assert d.client.post("/admin/keys", data=form).status_code == 403  # no CSRF token
    too_long = d.client.post("/admin/keys", data=form | {"csrf": token, "name": "k" * 201})
    assert too_long.status_code == 422 and "use at most 200" in too_long.text
    assert "ci" not in keys() and "k" * 201 not in keys()

    first = d.client.post("/admin/keys", data=form | {"csrf": token})
    assert first.status_code == 200 and 'id="new-key"' in first.text
    again = d.client.post("/admin/keys", data=form | {"csrf": token})  # a reload re-posts
    assert again.status_code == 409 and "sent twice" in again.text
    assert 'id="new-key"' not in again.text
    assert keys().count("ci") == 1


def test_keys_revoked_long_ago_leave_the_list(dashboard: Dashboard) -> None:
    d = dashboard
    headers = {"X-API-Key": d.admin.key}
    for key in (d.acme, d.globex):
        revoked = d.client.post(
            f"/admin/keys/{key.key_id}/revoke", data={}, headers=headers, follow_redirects=False
        )
        assert revoked.status_code == 303
        d.clock.advance(timedelta(days=7).total_seconds())
    listed = {
        k["key_id"] for k in d.client.get("/admin/api/tenants", headers=headers).json()["keys"]
    }
    assert d.acme.key_id not in listed  # revoked 14 days ago
    assert {d.globex.key_id, d.admin.key_id} <= listed  # revoked 7 days ago; in use


def test_a_cookie_session_is_a_use_of_its_key(
    dashboard: Dashboard, caplog: pytest.LogCaptureFixture
) -> None:
    d = dashboard
    d.log_in()
    d.clock.advance(120)
    with caplog.at_level(logging.INFO, logger="treadle.access"):
        response = d.client.get("/admin/api/live", headers={"X-Request-Id": "cookie-use"})
    assert response.status_code == 200
    with d.database.reader() as db:
        key = db.get(ApiKey, d.admin.key_id)
        assert key is not None and key.last_used_at == d.clock.now()
    [line] = [r for r in caplog.records if r.__dict__.get("request_id") == "cookie-use"]
    assert line.__dict__["tenant_id"] == d.admin.tenant_id


def test_the_live_page_shows_the_oldest_waiting_ops_and_counts_them_all(
    dashboard: Dashboard, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = dashboard
    monkeypatch.setattr(overview, "STUCK_SHOWN", 2)
    rows = Rows(d.database, d.clock)
    run = rows.run(d.acme.tenant_id, base_model="m/a")
    # Behind a gap in the run's seq_ids: none can be claimed, so all three wait.
    waiting = []
    for seq_id in (5, 6, 7):
        d.clock.advance(1)  # oldest first: the last is never among the two shown
        waiting.append(rows.training_op(run, seq_id).request_id)
    d.clock.advance(90)
    live = d.client.get("/admin/api/live", headers={"X-API-Key": d.admin.key}).json()
    shown = [s["op_id"] for s in live["stuck"]]
    assert len(shown) == 2 and waiting[2] not in shown
    assert live["stuck_total"] >= 3 and live["stuck_total"] > len(shown)
    d.log_in()
    assert "oldest 2 shown" in d.client.get("/admin/live/tables").text
