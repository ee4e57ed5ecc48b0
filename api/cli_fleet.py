"""`treadle-server admin runs|workers|ops`: where runs are, what workers hold, and what waits.

Tables of `scheduler.fleet`'s rows, read from the database at the moment the command runs; they
change nothing. Durations are rounded for reading; ids are printed whole at any terminal width.
"""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.table import Column, Table

from api.cli_context import console, fail, open_database, print_table
from core import tenants
from core.clock import SystemClock
from core.db import Database
from core.errors import TreadleError
from core.settings import Settings
from core.tables import Worker, WorkerStatus
from scheduler import fleet
from scheduler import workers as worker_rows

workers_cli = typer.Typer(
    help="The workers: list them (no subcommand), or act on one.",
    invoke_without_command=True,
)


def register(admin: typer.Typer) -> None:
    """Add these commands to the `admin` group."""
    admin.command("runs")(runs)
    admin.add_typer(workers_cli, name="workers")
    admin.command("ops")(ops)


def _duration(seconds: float) -> str:
    if seconds < 100:
        return f"{seconds:.0f} s"
    if seconds < 100 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def _lease(expires_in: float) -> str:
    if expires_in > 0:
        return f"expires in {_duration(expires_in)}"
    return f"lapsed {_duration(-expires_in)} ago"


def runs(
    tenant: Annotated[
        str | None, typer.Option(help="Only this tenant's runs (name or id).")
    ] = None,
    worker: Annotated[str | None, typer.Option(help="Only the runs placed on this worker.")] = None,
) -> None:
    """The training runs clients can use (not unloaded or failed, their session active), with
    where each is placed and its work in flight."""
    now = SystemClock().now()
    try:
        with open_database(Settings()).reader() as db:
            tenant_id = tenants.find_tenant(db, tenant).id if tenant else None
            rows = fleet.runs(db, now, tenant=tenant_id, worker=worker)
    except TreadleError as exc:
        raise fail(exc.message) from exc
    table = Table(
        Column("run id", no_wrap=True),
        "tenant",
        Column("tenant id", no_wrap=True),
        "base model",
        "rank",
        Column("worker", no_wrap=True),
        "status",
        "ops in flight",
        "last op",
    )
    for r in rows:
        table.add_row(
            r.run_id,
            r.tenant_name,
            r.tenant_id,
            r.base_model,
            str(r.lora_rank),
            r.worker_id or "none",
            r.status,
            str(r.ops_in_flight),
            "never" if r.last_op_age_seconds is None else f"{_duration(r.last_op_age_seconds)} ago",
        )
    print_table(table)


@workers_cli.callback()
def workers(ctx: typer.Context) -> None:
    """List every registered worker: its lease, the runs placed on it and the work queued for
    it."""
    if ctx.invoked_subcommand is not None:
        return
    now = SystemClock().now()
    with open_database(Settings()).reader() as db:
        rows = fleet.workers(db, now)
    table = Table(
        Column("worker id", no_wrap=True),
        "host",
        "device",
        Column("ranks", justify="right"),
        "status",
        "lease",
        "runs",
        "engine runs",
        "adapters (MB)",
        "queued ops",
    )
    for w in rows:
        table.add_row(
            w.worker_id,
            w.hostname,
            w.device,
            str(w.group_size),
            w.status,
            _lease(w.lease_expires_in_seconds),
            str(w.runs_placed),
            str(w.runs_reported),
            f"{w.adapter_bytes / 1e6:.1f}",
            str(w.queued_ops),
        )
    print_table(table)


def ops(
    stuck: Annotated[
        bool, typer.Option("--stuck", help="Operations waiting longer than --older-than.")
    ] = False,
    older_than: Annotated[
        float, typer.Option(min=0, metavar="SECONDS", help="How long counts as stuck.")
    ] = 60.0,
) -> None:
    """Operations queued or running for longer than --older-than seconds, oldest first, each
    with why it has not finished."""
    if not stuck:
        raise fail("pass --stuck to list the operations waiting longer than --older-than seconds")
    settings = Settings()
    now = SystemClock().now()
    with open_database(settings).reader() as db:
        rows = fleet.stuck_ops(db, now, settings, older_than)
        names = {t.id: t.name for t in tenants.list_tenants(db)}
    if not rows:
        console.print(f"no operation has waited longer than {older_than:g} s")
        return
    table = Table(
        Column("op id", no_wrap=True),
        "tenant",
        Column("target", no_wrap=True),
        "seq",
        "kind",
        "status",
        "waited",
        "reason",
    )
    for op in rows:
        table.add_row(
            op.op_id,
            names.get(op.tenant_id, op.tenant_id),
            op.target_id,
            "" if op.seq_id is None else str(op.seq_id),
            op.kind,
            op.status,
            _duration(op.waited_seconds),
            op.reason,
        )
    print_table(table)


@workers_cli.command("drain")
def drain(
    worker_id: Annotated[str, typer.Argument(help="The worker's id (`admin workers` lists them).")],
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Wait until the worker has left.")
    ] = True,
    timeout: Annotated[
        float, typer.Option(min=1, metavar="SECONDS", help="How long --wait waits.")
    ] = 300.0,
) -> None:
    """Take a worker out of service: it gets no new runs and, at its next lease renewal, stops
    as on SIGTERM: it saves its runs, hands them to live workers and exits. A supervisor that
    restarts it (compose's restart policy, a StatefulSet) brings it back live: to keep it out,
    stop or scale down its service instead of (or after) draining."""
    settings = Settings()
    database = open_database(settings, writes=True)
    clock = SystemClock()
    try:
        with database.transaction() as db:
            held = len(fleet.runs(db, clock.now(), worker=worker_id))
            worker_rows.request_drain(db, worker_id, clock.now())
    except LookupError as exc:
        raise fail(str(exc)) from exc
    console.print(
        f"worker {worker_id} is draining: it takes no new runs, and starts handing its {held} "
        f"training runs (and its samplers) over at its next lease renewal, within about "
        f"{settings.worker_lease_seconds / 3:.0f} s",
        markup=False,
        soft_wrap=True,
    )
    if not wait:
        return
    started = time.monotonic()
    while (status := _status(database, worker_id)) in worker_rows.HOLDING:
        if time.monotonic() - started > timeout:
            raise fail(
                f"worker {worker_id} is still {status} after {timeout:g} s: is its process "
                "running? A stopped worker's runs move once its lease lapses"
            )
        time.sleep(0.5)
    console.print(
        f"worker {worker_id} {'left' if status == WorkerStatus.LEFT else 'is ' + str(status)} "
        f"after {time.monotonic() - started:.1f} s",
        markup=False,
    )


def _status(database: Database, worker_id: str) -> str | None:
    with database.reader() as db:
        worker = db.get(Worker, worker_id)
        return worker.status if worker is not None else None
