"""The tinker SDK's billing and audit calls (`AdminClient`, `tinker billing`) against an
embedded server: hourly usage with its cost, checkpoint storage, the audit log of checkpoint
changes; each tenant sees only its own."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from billing.tables import UsageEvent
from core import apikeys, tenants
from core.clock import SystemClock
from core.tables import Tenant
from tests.scenarios import MODEL, sft_datum
from tests.server import LiveServer, tinker_cli

pytestmark = pytest.mark.e2e


@dataclass
class World:
    server: LiveServer
    owner_key: str
    owner_tenant: str
    other_key: str
    state_path: str
    run_id: str

    def admin(self, key: str | None = None) -> tinker.AdminClient:
        return tinker.AdminClient(base_url=self.server.base_url, api_key=key or self.owner_key)

    def http(self, key: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=f"{self.server.base_url}/api/v1",
            headers={"X-API-Key": key or self.owner_key},
            timeout=60,
        )


def _window() -> tuple[str, str]:
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    return (hour - timedelta(hours=1)).isoformat(), (hour + timedelta(hours=1)).isoformat()


@pytest.fixture(scope="module")
def world(live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))  # no stored credentials
        owner, other = live_server.make_tenant(), live_server.make_tenant()
        service = tinker.ServiceClient(base_url=live_server.base_url, api_key=owner.key)
        trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
        trainer.forward_backward([sft_datum(0), sft_datum(1)], "cross_entropy").result()
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state_path = trainer.save_state("kept").result().path
        run_id = state_path.split("/")[2]
        yield World(live_server, owner.key, owner.tenant_id, other.key, state_path, run_id)


def test_billing_usage_through_the_admin_client(world: World) -> None:
    start, end = _window()
    usage = world.admin().get_billing_usage(start, end).result()
    by_type = {event.event_info.type: event for event in usage.data}
    assert set(by_type) == {"training", "checkpoint"}
    training = by_type["training"]
    assert isinstance(training.event_info, types.TrainingBillingEvent)
    with world.server.database.reader() as db:
        tokens, amount = db.execute(
            select(func.sum(UsageEvent.quantity), func.sum(UsageEvent.amount_micros)).where(
                UsageEvent.tenant_id == world.owner_tenant, UsageEvent.kind == "training"
            )
        ).one()
    assert training.event_info.token_count == tokens
    assert training.base_model == MODEL
    assert training.session_id is not None and training.session_id in usage.sessions
    assert amount > 0
    assert training.estimated_cost_usd == pytest.approx(amount / 1e6)
    assert training.effective_rate_usd_per_million_tokens is not None
    assert training.bucket_end - training.bucket_start == timedelta(hours=1)
    # Another tenant's usage is invisible.
    assert world.admin(world.other_key).get_billing_usage(start, end).result().data == []


def test_usage_window_is_checked(world: World) -> None:
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    cases = {
        "on a UTC hour boundary": (hour + timedelta(minutes=5), hour + timedelta(hours=1)),
        "more than 14 days": (hour - timedelta(days=15), hour),
        "in the future": (hour + timedelta(hours=2), hour + timedelta(hours=3)),
        "not after starting_on": (hour, hour),
    }
    with world.http() as http:
        for message, (start, end) in cases.items():
            response = http.get(
                "/billing/usage/events",
                params={"starting_on": start.isoformat(), "ending_before": end.isoformat()},
            )
            assert response.status_code == 422, response.text
            assert message in response.json()["detail"], response.text
        response = http.get("/billing/usage/events", params={"starting_on": "yesterday"})
        assert response.status_code == 422


def test_current_checkpoint_storage(world: World) -> None:
    storage = world.admin().get_current_checkpoint_storage_usage().result()
    assert storage.effective_rate_usd_per_gigabyte_month is not None
    assert sum(item.checkpoint_count for item in storage.data) == 1
    size = sum(item.size_bytes for item in storage.data)
    assert size > 0
    other = world.admin(world.other_key).get_current_checkpoint_storage_usage().result()
    assert other.data == []


def _tinker_cli(world: World, home: Path, *args: str) -> Any:
    return tinker_cli(world.server.base_url, world.owner_key, home, *args)


def test_tinker_billing_cli(world: World, tmp_path: Path) -> None:
    start, end = _window()
    usage = _tinker_cli(world, tmp_path, "billing", "usage", start, end)
    assert {row["event_info"]["type"] for row in usage["data"]} == {"training", "checkpoint"}
    storage = _tinker_cli(world, tmp_path, "billing", "checkpoint-storage")
    assert sum(row["checkpoint_count"] for row in storage["data"]) == 1


def test_audit_log_of_checkpoint_changes(world: World) -> None:
    rest = tinker.RestClient(base_url=world.server.base_url, api_key=world.owner_key)
    rest.publish_checkpoint_from_tinker_path(world.state_path).result()
    rest.unpublish_checkpoint_from_tinker_path(world.state_path).result()
    admin = world.admin()
    log = admin.get_audit_log(event_type="checkpoints").result()
    events = [(e.event, e.tinker_path) for e in log.entries]
    assert events == [
        ("checkpoint_published", world.state_path),
        ("checkpoint_unpublished", world.state_path),
    ]
    assert log.entries[0].event_details["actor"] == world.owner_key.split("-")[1]
    assert admin.get_audit_log(event_type="projects").result().entries == []
    yesterday = (datetime.now(UTC) - timedelta(days=1)).date()
    assert admin.get_audit_log(day=yesterday).result().entries == []
    other = world.admin(world.other_key).get_audit_log().result().entries
    assert [e.event for e in other] == ["api_key_created"]  # its own key, nothing of the owner's


def test_audit_log_of_keys_and_limits(world: World) -> None:
    """Keys issued and revoked and limits changed by the operator, each logged once."""
    settings_secret = world.server.app.state.treadle.server_secret
    clock = SystemClock()
    with world.server.database.transaction() as db:
        tenant = db.get(Tenant, world.owner_tenant)
        assert tenant is not None
        key, _ = apikeys.issue_api_key(
            db, clock, settings_secret, tenant, name="ci", scope="tenant"
        )
        key_id = key.id
    with world.server.database.transaction() as db:
        apikeys.revoke_api_key(db, clock, key_id)
        apikeys.revoke_api_key(db, clock, key_id)  # already revoked: not logged again
        tenant = db.get(Tenant, world.owner_tenant)
        assert tenant is not None
        tenants.update_tenant_limits(db, tenant, clock=clock, max_lora_rank=32)
        tenants.update_tenant_limits(db, tenant, clock=clock, max_lora_rank=32)  # no change
    entries = world.admin().get_audit_log(event_type="organizations").result().entries
    assert [(e.event, e.event_details.get("target")) for e in entries][-3:] == [
        ("api_key_created", key_id),
        ("api_key_revoked", key_id),
        ("tenant_limit_changed", world.owner_tenant),
    ]
    assert entries[-1].event_details["max_lora_rank"] == {"from": 64, "to": 32}
    assert entries[-1].event_details["actor"] == "operator"
