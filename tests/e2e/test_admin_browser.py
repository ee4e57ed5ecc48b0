"""The admin dashboard in a real browser (the system's chromium, driven by Playwright) against
an embedded server: a visitor is sent to log in; an admin key's login shows the usage charts
with the seeded numbers (read back from the Chart.js objects and compared with the JSON route);
a new date range and hour buckets redraw them; a key revoked on the tenants page gets 401 from
the API; a tenant's session quota is raised; the live and fleet pages render and refresh
without a console error; the billing page says this server has no Stripe key; logging out ends
the session. Screenshots of each page go to the test's tmp folder."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.clock import FakeClock
from tests.builders import TenantKey, record
from tests.server import LiveServer, start_server

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no chromium binary on PATH (chromium or chromium-browser)", allow_module_level=True
    )

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402

CHART_DATA = """(name) => {
  const chart = window.adminCharts[name];
  return {labels: chart.data.labels,
          datasets: chart.data.datasets.map((d) => ({label: d.label, data: d.data}))};
}"""


# The server's clock, so that "today" is the same day for the server and the test whenever the
# test runs (a real clock could pass midnight between seeding and reading).
TODAY = datetime(2026, 3, 10, tzinfo=UTC)


@pytest.fixture
def pinned_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    clock = FakeClock(TODAY.replace(hour=12))
    yield from start_server(tmp_path_factory.mktemp("pinned"), clock=clock)


@pytest.fixture
def page() -> Iterator[Page]:
    assert CHROMIUM is not None
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser.new_page(viewport={"width": 1280, "height": 900})
        finally:
            browser.close()


def _chart(page: Page, name: str) -> dict[str, Any]:
    expect(page.locator("#usage[data-ready=true]")).to_have_count(1)
    data: dict[str, Any] = page.evaluate(CHART_DATA, name)
    return data


def test_an_admin_reads_usage_changes_keys_and_limits_and_logs_out(
    pinned_server: LiveServer, page: Page, tmp_path: Path
) -> None:
    live_server = pinned_server
    base = live_server.base_url
    admin = live_server.make_tenant("operators", scope="admin")
    acme: TenantKey = live_server.make_tenant("acme")
    globex: TenantKey = live_server.make_tenant("globex")
    today, yesterday = TODAY, TODAY - timedelta(days=1)
    record(live_server.database, acme, yesterday.replace(hour=5), quantity=3000,
           amount_micros=3_000_000)  # fmt: skip
    record(live_server.database, globex, yesterday.replace(hour=5), quantity=1000,
           amount_micros=500_000)  # fmt: skip
    record(live_server.database, globex, today, quantity=200, amount_micros=100_000)
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    api = httpx.Client(base_url=base, headers={"X-API-Key": admin.key}, timeout=30)

    page.goto(f"{base}/admin/usage")
    expect(page).to_have_url(f"{base}/admin/login")
    page.fill("#key", acme.key)
    page.click("#login-button")
    expect(page.locator("#login-error")).to_contain_text("403")
    problems.clear()  # the browser logs the refused login itself
    page.fill("#key", admin.key)
    page.click("#login-button")
    expect(page).to_have_url(f"{base}/admin/usage")

    # Seven days of day buckets by tenant: yesterday and today hold the seeded usage.
    tokens, cost = _chart(page, "tokens"), _chart(page, "cost")
    served = api.get("/admin/api/usage").json()
    assert len(tokens["labels"]) == 7 and tokens["labels"][-1] == today.date().isoformat()
    assert {d["label"]: d["data"] for d in tokens["datasets"]} == {
        s["label"]: s["tokens"] for s in served["series"]
    }
    drawn = {d["label"]: d["data"][-2:] for d in tokens["datasets"]}
    assert drawn == {"acme": [3000, 0], "globex": [1000, 200]}
    assert {d["label"]: d["data"][-2:] for d in cost["datasets"]} == {
        "acme": [3.0, 0],
        "globex": [0.5, 0.1],
    }
    expect(page.locator("#top-tenants tbody tr")).to_have_count(2)
    expect(page.locator("#top-tenants tbody tr").first).to_contain_text("acme")
    page.screenshot(path=str(tmp_path / "admin-usage.png"), full_page=True)

    # Yesterday and today in hour buckets, by kind.
    page.fill("#start", yesterday.date().isoformat())
    page.fill("#end", (today + timedelta(days=1)).date().isoformat())
    page.select_option("#bucket", "hour")
    page.select_option("#group", "kind")
    page.click("#apply")
    expect(page).to_have_url(f"{base}/admin/usage?{_query(yesterday, today, 'hour', 'kind')}")
    hourly = _chart(page, "tokens")
    assert len(hourly["labels"]) == 48
    [training] = hourly["datasets"]
    assert training["label"] == "training"
    assert training["data"][5] == 4000 and training["data"][24] == 200
    assert sum(training["data"]) == 4200
    page.screenshot(path=str(tmp_path / "admin-usage-hourly.png"), full_page=True)

    # Revoke globex's key: the API refuses it from then on.
    assert httpx.get(f"{base}/api/v1/usage", headers={"X-API-Key": globex.key}).status_code == 200
    page.click("nav >> text=Tenants")
    page.click(f"#key-{globex.key_id} button")
    expect(page.locator(f"#key-{globex.key_id}")).to_contain_text("revoked")
    assert httpx.get(f"{base}/api/v1/usage", headers={"X-API-Key": globex.key}).status_code == 401

    # Raise acme's session quota.
    row = page.locator(f"#tenant-{acme.tenant_id}")
    row.locator("input[name=max_concurrent_sessions]").fill("40")
    row.locator("button").click()
    expect(page.locator(f"#tenant-{acme.tenant_id}")).to_contain_text("0 / 40")
    limits = {t["name"]: t for t in api.get("/admin/api/tenants").json()["tenants"]}
    assert limits["acme"]["max_concurrent_sessions"] == 40
    page.screenshot(path=str(tmp_path / "admin-tenants.png"), full_page=True)

    for name in ("Live", "Fleet"):
        page.click(f"nav >> text={name}")
        table = "#sessions" if name == "Live" else "#workers"
        expect(page.locator(table)).to_be_visible()
        # htmx swaps the tables in again within a refresh period.
        with page.expect_response(lambda r: r.url.endswith("/tables"), timeout=15_000):
            pass
        page.screenshot(path=str(tmp_path / f"admin-{name.lower()}.png"), full_page=True)

    # This server has no Stripe key: the billing page says so and how to set one.
    page.click("nav >> text=Billing")
    expect(page.locator("#stripe-off")).to_contain_text("TREADLE_STRIPE_API_KEY")
    expect(page.locator("#oldest-unaccepted")).to_contain_text("none")
    assert api.get("/admin/api/billing").json()["stripe"]["configured"] is False
    page.screenshot(path=str(tmp_path / "admin-billing.png"), full_page=True)

    page.click("#logout")
    expect(page).to_have_url(f"{base}/admin/login")
    page.goto(f"{base}/admin/tenants")
    expect(page).to_have_url(f"{base}/admin/login")
    assert not problems, problems


def _query(start: datetime, today: datetime, bucket: str, group: str) -> str:
    end = (today + timedelta(days=1)).date().isoformat()
    return f"start={start.date().isoformat()}&end={end}&bucket={bucket}&group={group}"
