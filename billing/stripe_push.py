"""The Stripe pusher: priced usage goes to Stripe Billing meters exactly once.

One meter per usage kind, named `<prefix>_<kind>`, valued in micro-units of money. The unit of
pushing is a *cell*: one tenant's usage of one kind in one hour at one price version. Once the
hour has settled (ended, plus the settle delay, so the hour's usage is recorded), the cell's
value is the ledger's sum minus every part `stripe_meter_pushes` records for it, and a positive
remainder goes as the cell's next *part*: part 0 first, part n for usage recorded after n parts.

Exactly once: a part's identifier is a function of the cell and the part number only, and a
part is recorded as intended (identifier and value) in a committed transaction before it is
sent, then marked accepted (`billing.stripe_parts`). Each push first sends again, unchanged, the
parts an earlier push intended and never marked accepted: Stripe answers that it already holds
the ones it accepted, which counts as accepted. Usage recorded in between goes to a new part.
A part intended so long ago that Stripe may have forgotten its identifier is not sent blindly;
it is reported until the operator settles it with the reconciler's help.

Stripe takes events up to 35 days old; older cells with value left are reported, not pushed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session as OrmSession

from billing import stripe_parts
from billing.stripe_gateway import (
    MAX_EVENT_AGE_DAYS,
    MeterEvent,
    StripeGateway,
    StripeUnavailable,
)
from billing.stripe_parts import Cell, PendingPush, push_identifier
from billing.tables import UsageEvent
from core.clock import Clock
from core.db import Database
from core.settings import Settings
from core.tables import Tenant

log = logging.getLogger(__name__)

BATCH_SIZE = 100
# Events for hours this close to Stripe's age limit are not sent: the limit is checked when
# Stripe receives them, a while after they are built.
AGE_MARGIN = timedelta(hours=1)
# Cells past Stripe's limit are reported by pushes for this long; later, by the reconciler only.
TOO_OLD_REPORTED_FOR = timedelta(days=7)
# Stripe keeps a meter event identifier unique for at least 24 hours. A part intended longer ago
# than this (an hour's margin for a slow push) and never marked accepted is not sent again: if
# Stripe accepted it and then forgot the identifier, the copy would count twice.
RESEND_WITHIN = timedelta(hours=23)
# pg_try_advisory_lock key: one push at a time across processes sharing a PostgreSQL database.
_PUSH_LOCK_KEY = 0x7472_6561_646C_6531  # "treadle1"
_local_locks: dict[str, threading.Lock] = {}
_local_locks_guard = threading.Lock()


@dataclass
class PushReport:
    # Parts Stripe accepted in this push (new ones and ones an earlier push intended).
    pushed: int = 0
    value_micros: int = 0
    # Of them, parts an earlier push intended and did not see accepted, sent again unchanged.
    resent: int = 0
    # Parts Stripe already held (a push repeated after a crash): marked, not counted twice.
    repeats: int = 0
    # Cells past Stripe's age limit with value left, and that value.
    too_old: list[tuple[Cell, int]] = field(default_factory=list)
    # Events Stripe refused for good (no meter with that event name, a deleted customer):
    # (identifier, Stripe's reason). Their cells are computed again by the next push.
    refused: list[tuple[str, str]] = field(default_factory=list)
    # Parts intended more than RESEND_WITHIN ago (or for hours now past Stripe's age limit) and
    # never marked accepted: Stripe may hold them or not, so they are not sent; the operator
    # settles each after a reconcile (`treadle-server admin billing resolve`).
    unconfirmed: list[PendingPush] = field(default_factory=list)
    # False when another push held the lock, so this one did nothing.
    ran: bool = True


def meter_event_name(prefix: str, kind: str) -> str:
    return f"{prefix}_{kind}"


def settled_before(now: datetime, settle_seconds: float) -> datetime:
    """Hours starting before this have ended at least `settle_seconds` ago."""
    return (now - timedelta(seconds=settle_seconds)).replace(minute=0, second=0, microsecond=0)


def gateway_from_settings(settings: Settings) -> StripeGateway | None:
    """The gateway, or None while no Stripe key is set (pushing is off)."""
    if settings.stripe_api_key is None:
        return None
    return StripeGateway(
        settings.stripe_api_key.get_secret_value(), api_base=settings.stripe_api_base
    )


def push_from_settings(database: Database, settings: Settings, clock: Clock) -> PushReport | None:
    """One push as configured; None when pushing is off (no `TREADLE_STRIPE_API_KEY`)."""
    gateway = gateway_from_settings(settings)
    if gateway is None:
        return None
    return push_usage(
        database,
        gateway,
        clock,
        meter_prefix=settings.stripe_meter_prefix,
        settle_seconds=settings.stripe_settle_seconds,
    )


def push_usage(
    database: Database,
    gateway: StripeGateway,
    clock: Clock,
    *,
    meter_prefix: str = "treadle",
    settle_seconds: float = 600.0,
    batch_size: int = BATCH_SIZE,
    after_accept: Callable[[list[PendingPush]], None] | None = None,
) -> PushReport:
    """Push every settled cell's unpushed value for every tenant linked to a Stripe customer,
    after sending again the parts earlier pushes intended and did not see accepted.

    `after_accept` runs after Stripe accepted a batch and before it is marked accepted (a
    test's crash point). An event Stripe refuses is reported in `PushReport.refused` and the
    push goes on; a Stripe that stays unreachable through the retries stops it: the parts
    accepted before are marked, and `StripeUnavailable` is raised.
    """
    with _exclusive(database) as held:
        if not held:
            log.info("another Stripe push is running; this one does nothing")
            return PushReport(ran=False)
        now = clock.now()
        report = PushReport()
        with database.reader() as db:
            again = _to_send_again(db, now, report)
            pending = _pending(db, now, settle_seconds, report)
        for start in range(0, len(again), batch_size):
            batch = again[start : start + batch_size]
            accepted = _send(database, gateway, clock, batch, meter_prefix, report, after_accept)
            report.resent += len(accepted)
        for start in range(0, len(pending), batch_size):
            batch = stripe_parts.intend(database, clock, pending[start : start + batch_size])
            _send(database, gateway, clock, batch, meter_prefix, report, after_accept)
        _log_report(report)
        return report


def _log_report(report: PushReport) -> None:
    if report.unconfirmed:
        log.warning(
            "%d meter events were meant for Stripe over %d hours ago and never seen accepted "
            "(%d micro-units in all); Stripe may have forgotten their identifiers, so they are "
            "not sent again. Run `treadle-server admin billing reconcile` over their hours, then "
            "`treadle-server admin billing resolve IDENTIFIER --held` where Stripe holds the "
            "value or `--not-held` to have the next push send it: %s",
            len(report.unconfirmed),
            RESEND_WITHIN // timedelta(hours=1),
            sum(push.value for push in report.unconfirmed),
            ", ".join(push.identifier for push in report.unconfirmed[:5]),
        )
    if report.too_old:
        log.warning(
            "%d usage cells are older than Stripe's %d-day limit and were not pushed "
            "(%d micro-units in all); bill them by hand: %s",
            len(report.too_old),
            MAX_EVENT_AGE_DAYS,
            sum(value for _, value in report.too_old),
            ", ".join(push_identifier(cell, 0) for cell, _ in report.too_old[:5]),
        )
    if report.pushed:
        log.info(
            "pushed %d meter events to Stripe (%d micro-units; %d sent again after a push that "
            "stopped, %d of them already held)",
            report.pushed,
            report.value_micros,
            report.resent,
            report.repeats,
        )


def _send(
    database: Database,
    gateway: StripeGateway,
    clock: Clock,
    batch: list[PendingPush],
    meter_prefix: str,
    report: PushReport,
    after_accept: Callable[[list[PendingPush]], None] | None,
) -> list[PendingPush]:
    """Send a batch of intended parts, then mark what Stripe accepted in one transaction; the
    parts accepted."""
    accepted: list[PendingPush] = []
    refused: list[PendingPush] = []
    try:
        for push in batch:
            try:
                created = gateway.send_meter_event(
                    MeterEvent(
                        event_name=meter_event_name(meter_prefix, push.cell.kind),
                        stripe_customer_id=push.stripe_customer_id,
                        value=push.value,
                        identifier=push.identifier,
                        timestamp=push.cell.hour,
                    )
                )
            except StripeUnavailable as exc:
                if not exc.refused:
                    raise
                # One bad cell (a meter not created yet) must not hold up everyone's billing.
                log.error("%s; the next push tries it again", exc.message)
                report.refused.append((push.identifier, exc.message))
                refused.append(push)
                continue
            accepted.append(push)
            if not created:
                report.repeats += 1
    finally:
        # What Stripe accepted is marked even when a later event of the batch failed.
        if after_accept is not None:
            after_accept(accepted)
        stripe_parts.settle(database, clock, accepted, refused)
        report.pushed += len(accepted)
        report.value_micros += sum(push.value for push in accepted)
    return accepted


def _to_send_again(db: OrmSession, now: datetime, report: PushReport) -> list[PendingPush]:
    """The parts earlier pushes intended and did not see accepted, to send again unchanged:
    those Stripe may have forgotten, or would refuse as too old, go to the report instead."""
    oldest = now - timedelta(days=MAX_EVENT_AGE_DAYS) + AGE_MARGIN
    again: list[PendingPush] = []
    for intent in stripe_parts.unaccepted(db):
        if intent.intended_at < now - RESEND_WITHIN or intent.push.cell.hour < oldest:
            report.unconfirmed.append(intent.push)
        else:
            again.append(intent.push)
    return again


def _pending(
    db: OrmSession, now: datetime, settle_seconds: float, report: PushReport
) -> list[PendingPush]:
    before = settled_before(now, settle_seconds)
    oldest = now - timedelta(days=MAX_EVENT_AGE_DAYS) + AGE_MARGIN
    reported_from = oldest - TOO_OLD_REPORTED_FOR
    pending: list[PendingPush] = []
    for tenant_id, customer in db.execute(
        select(Tenant.id, Tenant.stripe_customer_id)
        .where(Tenant.stripe_customer_id.is_not(None))
        .order_by(Tenant.id)
    ):
        if customer is None:  # not selected; for the type checker
            continue
        ledger = ledger_cells(db, tenant_id, reported_from, before)
        recorded = stripe_parts.recorded_cells(db, tenant_id, reported_from, before)
        for cell in sorted(ledger):
            value_recorded, part = recorded.get(cell, (0, 0))
            left = ledger[cell] - value_recorded
            if left < 0:
                log.warning(
                    "Stripe was sent %d micro-units more than the ledger holds for %s; the "
                    "reconciler reports it",
                    -left,
                    push_identifier(cell, part),
                )
            if left <= 0:
                continue
            if cell.hour < oldest:
                report.too_old.append((cell, left))
                continue
            pending.append(PendingPush(cell, customer, part, left, push_identifier(cell, part)))
    return pending


def ledger_cells(
    db: OrmSession, tenant_id: str, since: datetime, before: datetime
) -> dict[Cell, int]:
    """The ledger's priced amounts per cell for hours in [since, before)."""
    rows = db.execute(
        select(
            UsageEvent.kind,
            UsageEvent.hour,
            UsageEvent.price_id,
            func.sum(UsageEvent.amount_micros),
        )
        .where(
            UsageEvent.tenant_id == tenant_id,
            UsageEvent.price_id.is_not(None),
            UsageEvent.hour >= since,
            UsageEvent.hour < before,
        )
        .group_by(UsageEvent.kind, UsageEvent.hour, UsageEvent.price_id)
    )
    return {
        Cell(tenant_id, kind, hour, int(price_id or 0)): int(total or 0)
        for kind, hour, price_id, total in rows
    }


@contextlib.contextmanager
def _exclusive(database: Database) -> Iterator[bool]:
    """Yields whether this push may run: one at a time per database (a PostgreSQL advisory
    lock across processes; on SQLite, within this process)."""
    if database.is_sqlite:
        with _local_locks_guard:
            lock = _local_locks.setdefault(database.url, threading.Lock())
        if not lock.acquire(blocking=False):
            yield False
            return
        try:
            yield True
        finally:
            lock.release()
        return
    with database.engine.connect() as conn:
        held = bool(
            conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": _PUSH_LOCK_KEY}).scalar()
        )
        conn.commit()
        try:
            yield held
        finally:
            if held:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PUSH_LOCK_KEY})
                conn.commit()


_pusher_threads: dict[str, threading.Thread] = {}


def start_push(database: Database, settings: Settings, clock: Clock) -> threading.Thread | None:
    """Run one push in a background thread, so a slow or unreachable Stripe never holds up the
    caller's loop; None when pushing is off or this process's previous push still runs."""
    gateway = gateway_from_settings(settings)
    if gateway is None:
        return None
    with _local_locks_guard:
        running = _pusher_threads.get(database.url)
        if running is not None and running.is_alive():
            return None

        def push() -> None:
            try:
                push_usage(
                    database,
                    gateway,
                    clock,
                    meter_prefix=settings.stripe_meter_prefix,
                    settle_seconds=settings.stripe_settle_seconds,
                )
            except Exception:
                log.exception("pushing usage to Stripe failed; the next push retries it")

        thread = threading.Thread(target=push, name="treadle-stripe-push", daemon=True)
        _pusher_threads[database.url] = thread
        thread.start()
        return thread


def running_push(database: Database) -> threading.Thread | None:
    """The thread of this process's latest push started by `start_push`, if any."""
    with _local_locks_guard:
        return _pusher_threads.get(database.url)
