"""`treadle-server`: run the service and administer tenants, keys and prices.

Admin commands talk to the database directly (they are for the operator, on the operator's
machine); customers use the HTTP API.
"""

from __future__ import annotations

import errno
import shlex
import socket
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Column, Table

from api import cli_fleet
from api.cli_context import (
    announce_writes,
    console,
    database_name,
    err_console,
    fail,
    open_database,
    print_table,
    require_database_url,
)
from billing import pricebook
from billing.prices import Rate
from billing.tables import USAGE_KINDS
from core import apikeys, tenants
from core.clock import SystemClock
from core.db import Database
from core.errors import TreadleError
from core.settings import Mode, Settings
from core.tables import Tenant

app = typer.Typer(
    help="Treadle server: run it, migrate its database, administer tenants and keys.",
    no_args_is_help=True,
)
admin = typer.Typer(
    help="Tenants, API keys and prices; runs, workers and stuck operations.", no_args_is_help=True
)
tenants_cli = typer.Typer(help="Create, list and change tenants.", no_args_is_help=True)
keys_cli = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)
prices_cli = typer.Typer(
    help="Set and list prices: versions, each in force from its effective time.",
    no_args_is_help=True,
)
billing_cli = typer.Typer(help="Stripe metering: push usage, reconcile.", no_args_is_help=True)
app.add_typer(admin, name="admin")
admin.add_typer(tenants_cli, name="tenants")
admin.add_typer(keys_cli, name="keys")
admin.add_typer(billing_cli, name="billing")
admin.add_typer(prices_cli, name="prices")
cli_fleet.register(admin)


@app.command()
def serve(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
) -> None:
    """Run Treadle in embedded mode: one process, no configuration needed. The engine runs on
    TREADLE_DEVICE (auto: the first GPU, else the CPU) and serves TREADLE_MODELS."""
    import uvicorn

    from api.app import create_app
    from api.bootstrap import DEFAULT_TENANT, default_key

    settings = Settings()
    if host is not None:
        settings.host = host
    if port is not None:
        settings.port = port
    if settings.mode is Mode.DISTRIBUTED:
        raise fail(
            "TREADLE_REDIS_URL is set: use `treadle-server api` (and workers) for distributed mode"
        )
    # The port is tried before anything else (the key above all): a server that cannot listen
    # must not make a key nor print one. It stays held until uvicorn binds it.
    probe = _bind(settings.host, settings.port)
    _logging(settings)
    try:
        application = create_app(settings)
        default = default_key(settings, application.state.treadle.database, SystemClock())
    except TreadleError as exc:
        raise fail(exc.message) from exc
    url = f"http://{settings.host}:{settings.port}"
    console.print(f"[bold]Treadle[/] (embedded mode) listening on [cyan]{url}[/]")
    console.print(f"  data directory: {settings.data_dir}")
    # The key is shown once, when made: logs of later starts (often kept, shared or shipped
    # elsewhere) must not hold it.
    if default.created:
        console.print(
            f"  new API key for tenant '{DEFAULT_TENANT}' (shown once, kept in {default.path}): "
            f"[green]{default.key}[/]",
            soft_wrap=True,
        )
    else:
        console.print(
            f"  API key for tenant '{DEFAULT_TENANT}': in {default.path}; "
            f"`treadle-server admin keys create {DEFAULT_TENANT}` makes another",
            soft_wrap=True,
        )
    key_file = shlex.quote(str(default.path))
    console.print("  clients read the server and key from the environment:", soft_wrap=True)
    console.print(
        f"    treadle SDK and `treadle` CLI: export TREADLE_BASE_URL={url} "
        f"TREADLE_API_KEY=$(cat {key_file})",
        soft_wrap=True,
        markup=False,
    )
    console.print(
        f"    tinker SDK: export TINKER_BASE_URL={url} TINKER_API_KEY=$(cat {key_file})",
        soft_wrap=True,
        markup=False,
    )
    probe.close()
    # No log_config: uvicorn's loggers then keep the handler `_logging` gave every logger; no
    # access log: `api.request_log` writes each request's line.
    uvicorn.run(
        application, host=settings.host, port=settings.port, log_config=None, access_log=False
    )


def _bind(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not listening); fails naming the port and how to choose
    another when it is taken or not allowed."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    # As uvicorn does: a port left in TIME_WAIT by a server that just stopped is free.
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        change = "choose another with --port N (or TREADLE_PORT)"
        if exc.errno == errno.EADDRINUSE:
            raise fail(
                f"port {port} on {host} is already in use (another Treadle or another program "
                f"listens there): stop it, or {change}"
            ) from None
        if exc.errno == errno.EACCES:
            raise fail(
                f"no permission to listen on port {port} on {host} (ports below 1024 need "
                f"privileges): {change}"
            ) from None
        raise fail(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}): {change}, "
            "or another address with --host (or TREADLE_HOST)"
        ) from None
    return listener


def _distributed_settings(command: str) -> Settings:
    settings = Settings()
    if settings.mode is not Mode.DISTRIBUTED or settings.database_url is None:
        raise fail(
            f"`treadle-server {command}` is for distributed mode: set TREADLE_DATABASE_URL (PostgreSQL) "
            "and TREADLE_REDIS_URL; for one machine without them use `treadle-server serve`"
        )
    return settings


def _logging(settings: Settings) -> None:
    from core import logs

    logs.configure(settings)


@app.command()
def api(
    host: Annotated[str | None, typer.Option(help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(help="Port to listen on.")] = None,
) -> None:
    """Run one API replica of distributed mode (run as many as needed behind a load balancer)."""
    import uvicorn

    from api.app import create_app

    settings = _distributed_settings("api")
    _logging(settings)
    try:
        application = create_app(settings)
    except TreadleError as exc:
        raise fail(exc.message) from exc
    uvicorn.run(
        application,
        host=host or settings.host,
        port=port or settings.port,
        log_config=None,
        access_log=False,
    )


@app.command()
def worker(
    device: Annotated[
        str | None,
        typer.Option(
            help="cuda:N, cuda or cpu (default: TREADLE_DEVICE; auto: the first GPU, else CPU)."
        ),
    ] = None,
    models: Annotated[
        list[str] | None,
        typer.Option(
            "--models", help="A base model to serve; repeat for more (default: TREADLE_MODELS)."
        ),
    ] = None,
    worker_id: Annotated[
        str | None, typer.Option(help="Stable id; default host-device-random.")
    ] = None,
    group_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Ranks (processes, one device each) serving the models together as one worker "
            "group; any rank ending ends the group (default: TREADLE_WORKER_GROUP_SIZE, 1).",
        ),
    ] = None,
    devices: Annotated[
        str | None,
        typer.Option(
            help="A group's devices, one per rank, comma-separated, e.g. cuda:0,cuda:1 "
            "(default: cuda:0 to cuda:N-1; with --device cpu, cpu for every rank)."
        ),
    ] = None,
) -> None:
    """Run one GPU worker of distributed mode: one per device, or one per group of devices
    with --group-size."""
    from api import dbschema
    from scheduler.celery_app import warn_if_root
    from scheduler.worker.process import (
        check_models,
        default_worker_id,
        group_devices,
        run_worker,
        run_worker_group,
    )

    settings = _distributed_settings("worker")
    if device is not None:
        settings.device = device
    if group_size is not None:
        settings.worker_group_size = group_size
    _logging(settings)
    warn_if_root()
    try:
        named = [d.strip() for d in devices.split(",") if d.strip()] if devices else None
        ranks = group_devices(settings.device, settings.worker_group_size, named)
        check_models(settings, models or settings.models, len(ranks))
        settings.secret_bytes()
        dbschema.require_head(Database(settings.resolved_database_url))
    except TreadleError as exc:
        raise fail(exc.message) from exc
    if len(ranks) == 1:
        settings.device = ranks[0]
        run_worker(
            settings,
            worker_id=worker_id or default_worker_id(settings.device),
            models=models or settings.models,
        )
        return
    status = run_worker_group(
        settings,
        worker_id=worker_id or default_worker_id(ranks[0]),
        models=models or settings.models,
        devices=ranks,
    )
    if status:
        raise typer.Exit(status)


@app.command()
def beat() -> None:
    """Run the periodic jobs of distributed mode (exactly one instance)."""
    from api import dbschema
    from scheduler.beat import run_beat

    settings = _distributed_settings("beat")
    _logging(settings)
    try:
        dbschema.require_head(Database(settings.resolved_database_url))
    except TreadleError as exc:
        raise fail(exc.message) from exc
    run_beat(settings, SystemClock())


@app.command()
def probe(
    file: Annotated[
        Path, typer.Option(help="The liveness file: the probed process's TREADLE_LIVENESS_FILE.")
    ],
    max_age: Annotated[
        float, typer.Option(min=0, help="Seconds since its last touch beyond which it is stuck.")
    ],
) -> None:
    """Exit 0 when a worker's or beat's liveness file was touched at most --max-age seconds
    ago, else 1 with the reason: the exec probe of processes that serve no HTTP. It opens no
    database and loads no engine."""
    from core import liveness

    reason = liveness.staleness(file, max_age)
    if reason is not None:
        typer.echo(f"not alive: {reason}", err=True)
        raise typer.Exit(code=1)


@app.command()
def migrate(
    revision: Annotated[str, typer.Option(help="Target revision.")] = "head",
) -> None:
    """Upgrade the database schema (run before starting servers after an upgrade)."""
    from api import dbschema

    settings = Settings()
    _logging(settings)
    announce_writes(settings)
    if settings.database_url is None:
        settings.ensure_data_dir()
    database = Database(settings.resolved_database_url)
    dbschema.upgrade(database, revision)
    console.print(f"database at revision [green]{dbschema.current_revision(database)}[/]")


@app.command()
def downgrade(revision: Annotated[str, typer.Argument(help="Target revision, or 'base'.")]) -> None:
    """Downgrade the database schema to an older revision."""
    from api import dbschema

    settings = Settings()
    _logging(settings)
    announce_writes(settings)
    database = Database(settings.resolved_database_url)
    dbschema.downgrade(database, revision)
    console.print(f"database at revision [yellow]{dbschema.current_revision(database)}[/]")


def _limits_text(value: int | None) -> str:
    return "none" if value is None else f"{value / 1e6:.2f}"


def _resource_limit_option(name: str, what: str) -> Any:
    default = getattr(tenants.DEFAULT_LIMITS, name)
    return typer.Option(
        f"--{name.replace('_', '-')}",
        metavar="N|default",
        help=f"{what}: a number, or 'default' for the server's ({default:,}).",
        show_default=False,
    )


MaxTrainingRuns = Annotated[
    str | None, _resource_limit_option("max_training_runs", "Live training runs allowed")
]
MaxLoraParameters = Annotated[
    str | None,
    _resource_limit_option("max_lora_parameters", "LoRA parameters allowed across live runs"),
]
MaxQueuedOps = Annotated[
    str | None, _resource_limit_option("max_queued_ops", "Operations queued or running allowed")
]
MaxSamplingRequests = Annotated[
    str | None,
    _resource_limit_option("max_sampling_requests", "Sampling requests queued or running allowed"),
]


def _resource_limits(**given: str | None) -> dict[str, int | None]:
    """The resource limits given on the command line: a number, or None for 'default'."""
    limits: dict[str, int | None] = {}
    for name, text in given.items():
        if text is None:
            continue
        if text.strip().lower() == "default":
            limits[name] = None
            continue
        try:
            limits[name] = int(text.replace(",", ""))
        except ValueError:
            option = "--" + name.replace("_", "-")
            raise fail(f"{option} takes a whole number or 'default', not {text[:40]!r}") from None
    return limits


def _resource_limit_text(tenant: Tenant, name: str) -> str:
    own: int | None = getattr(tenant, name)
    if own is None:
        return f"{getattr(tenants.DEFAULT_LIMITS, name):,} (default)"
    return f"{own:,}"


@tenants_cli.command("create")
def tenants_create(
    name: str,
    max_sessions: Annotated[int, typer.Option(help="Concurrent sessions allowed.")] = 4,
    max_lora_rank: Annotated[int, typer.Option(help="Largest LoRA rank allowed.")] = 64,
    spend_limit: Annotated[
        float | None,
        typer.Option(help="Monthly spend limit in dollars (also: tenants set-limit)."),
    ] = None,
    max_training_runs: MaxTrainingRuns = None,
    max_lora_parameters: MaxLoraParameters = None,
    max_queued_ops: MaxQueuedOps = None,
    max_sampling_requests: MaxSamplingRequests = None,
) -> None:
    """Create a tenant. Resource limits not given follow the server's defaults."""
    limits = _resource_limits(
        max_training_runs=max_training_runs,
        max_lora_parameters=max_lora_parameters,
        max_queued_ops=max_queued_ops,
        max_sampling_requests=max_sampling_requests,
    )
    settings = Settings()
    try:
        with open_database(settings, writes=True).transaction() as db:
            tenant = tenants.create_tenant(
                db,
                SystemClock(),
                name,
                max_concurrent_sessions=max_sessions,
                max_lora_rank=max_lora_rank,
                spend_limit_micros=None if spend_limit is None else round(spend_limit * 1_000_000),
                limits=limits,
            )
            console.print(f"created tenant [bold]{tenant.name}[/] ({tenant.id})")
    except TreadleError as exc:
        raise fail(exc.message) from exc


@tenants_cli.command("update")
def tenants_update(
    name: str,
    max_sessions: Annotated[int | None, typer.Option(help="Concurrent sessions allowed.")] = None,
    max_lora_rank: Annotated[int | None, typer.Option(help="Largest LoRA rank allowed.")] = None,
    spend_limit: Annotated[
        float | None,
        typer.Option(help="Monthly spend limit in dollars (also: tenants set-limit)."),
    ] = None,
    no_spend_limit: Annotated[bool, typer.Option(help="Remove the spend cap.")] = False,
    max_training_runs: MaxTrainingRuns = None,
    max_lora_parameters: MaxLoraParameters = None,
    max_queued_ops: MaxQueuedOps = None,
    max_sampling_requests: MaxSamplingRequests = None,
) -> None:
    """Change a tenant's limits; those not given stay as they are."""
    limits = _resource_limits(
        max_training_runs=max_training_runs,
        max_lora_parameters=max_lora_parameters,
        max_queued_ops=max_queued_ops,
        max_sampling_requests=max_sampling_requests,
    )
    try:
        with open_database(Settings(), writes=True).transaction() as db:
            tenant = tenants.update_tenant_limits(
                db,
                tenants.find_tenant(db, name),
                clock=SystemClock(),
                max_concurrent_sessions=max_sessions,
                max_lora_rank=max_lora_rank,
                spend_limit_micros=None if spend_limit is None else round(spend_limit * 1_000_000),
                clear_spend_limit=no_spend_limit,
                limits=limits,
            )
            console.print(f"updated tenant [bold]{tenant.name}[/]")
    except TreadleError as exc:
        raise fail(exc.message) from exc


@tenants_cli.command("list")
def tenants_list() -> None:
    """List tenants with their limits."""
    table = Table(
        Column("id", no_wrap=True),
        "name",
        "max sessions",
        "max rank",
        "spend limit",
        "max runs",
        "max LoRA params",
        "max queued ops",
        "max sampling",
        "created",
    )
    with open_database(Settings()).transaction() as db:
        for t in tenants.list_tenants(db):
            table.add_row(
                t.id,
                t.name,
                str(t.max_concurrent_sessions),
                str(t.max_lora_rank),
                _limits_text(t.spend_limit_micros),
                *(_resource_limit_text(t, name) for name in tenants.RESOURCE_LIMIT_NAMES),
                t.created_at.isoformat(timespec="seconds"),
            )
    print_table(table)


def _limit_change(dollars: str | None, remove: bool, option: str) -> int | tenants.Keep | None:
    if remove:
        return None
    if dollars is None:
        return tenants.Keep.KEEP
    return _micros(dollars, option)


@tenants_cli.command("set-limit")
def tenants_set_limit(
    name: str,
    monthly: Annotated[
        str | None,
        typer.Option(metavar="DOLLARS", help="Most the tenant may spend per calendar month (UTC)."),
    ] = None,
    no_monthly: Annotated[
        bool, typer.Option("--no-monthly", help="Remove the monthly limit.")
    ] = False,
    per_session: Annotated[
        str | None, typer.Option(metavar="DOLLARS", help="Most one session may spend.")
    ] = None,
    no_per_session: Annotated[
        bool, typer.Option("--no-per-session", help="Remove the per-session limit.")
    ] = False,
) -> None:
    """Set a tenant's spend limits. Over a limit, new priced work is answered 402 (the tinker
    SDK pauses until the limit is raised); work already accepted finishes."""
    if (monthly is not None and no_monthly) or (per_session is not None and no_per_session):
        raise fail("pass a limit or its --no- option, not both")
    if monthly is None and not no_monthly and per_session is None and not no_per_session:
        raise fail("pass --monthly, --no-monthly, --per-session or --no-per-session")
    monthly_micros = _limit_change(monthly, no_monthly, "--monthly")
    session_micros = _limit_change(per_session, no_per_session, "--per-session")
    try:
        with open_database(Settings(), writes=True).transaction() as db:
            tenant = tenants.set_spend_limits(
                db,
                SystemClock(),
                tenants.find_tenant(db, name),
                monthly_micros=monthly_micros,
                per_session_micros=session_micros,
            )
            console.print(
                f"tenant [bold]{tenant.name}[/]: monthly limit "
                f"{_limits_text(tenant.spend_limit_micros)}, per-session limit "
                f"{_limits_text(tenant.session_spend_limit_micros)}"
            )
    except TreadleError as exc:
        raise fail(exc.message) from exc


def _api_secret(settings: Settings) -> bytes:
    """The secret the API hashes keys with. A database named by URL (not SQLite) is one that
    API replicas share, and they hash with TREADLE_SERVER_SECRET: a key hashed with the
    embedded secret under the data directory would never authenticate there."""
    if (
        settings.server_secret is None
        and settings.database_url is not None
        and not settings.database_url.startswith("sqlite")
    ):
        raise fail(
            f"TREADLE_SERVER_SECRET is not set, and keys on {database_name(settings)} must be "
            "hashed with the secret its API replicas use: set TREADLE_SERVER_SECRET to that "
            "value (a key made with another secret would never authenticate)"
        )
    return settings.secret_bytes()


@keys_cli.command("create")
def keys_create(
    tenant: str,
    name: Annotated[str, typer.Option(help="A label for the key.")] = "",
    scope: Annotated[str, typer.Option(help="tenant or admin.")] = "tenant",
) -> None:
    """Create an API key. It is shown once: store it now."""
    settings = Settings()
    require_database_url(settings)  # before the secret: which database is the first question
    try:
        secret = _api_secret(settings)
        with open_database(settings, writes=True).transaction() as db:
            row, key = apikeys.issue_api_key(
                db,
                SystemClock(),
                secret,
                tenants.find_tenant(db, tenant),
                name=name,
                scope=scope,
            )
    except TreadleError as exc:
        raise fail(exc.message) from exc
    err_console.print(
        f"created {scope} key [bold]{row.id}[/] for tenant {tenant}; it is shown only once:"
    )
    typer.echo(key)


@keys_cli.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
) -> None:
    """List API keys (never their secrets)."""
    table = Table(
        Column("key id", no_wrap=True), "tenant", "name", "scope", "created", "last used", "revoked"
    )
    with open_database(Settings()).transaction() as db:
        tenant_id = tenants.find_tenant(db, tenant).id if tenant else None
        names = {t.id: t.name for t in tenants.list_tenants(db)}
        for k in apikeys.list_api_keys(db, tenant_id):
            table.add_row(
                k.id,
                names.get(k.tenant_id, k.tenant_id),
                k.name,
                k.scope,
                k.created_at.isoformat(timespec="seconds"),
                k.last_used_at.isoformat(timespec="seconds") if k.last_used_at else "never",
                k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else "",
            )
    print_table(table)


@keys_cli.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke an API key by its id; requests with it then get 401."""
    try:
        with open_database(Settings(), writes=True).transaction() as db:
            apikeys.revoke_api_key(db, SystemClock(), key_id)
    except TreadleError as exc:
        raise fail(exc.message) from exc
    console.print(f"revoked key [bold]{key_id}[/]")


@prices_cli.command("set")
def prices_set(
    base_model: Annotated[str, typer.Argument(help="A base model, or '*' for every model.")],
    kind: Annotated[str, typer.Argument(help=f"One of {', '.join(USAGE_KINDS)}.")],
    price: Annotated[
        str,
        typer.Argument(
            help="Dollars per unit: per 1M tokens (training, sampling_prefill, sampling_sample), "
            "per GB-month (storage) or per checkpoint."
        ),
    ],
    cached: Annotated[
        str | None,
        typer.Option(help="Dollars per 1M cached prefill tokens (sampling_prefill only)."),
    ] = None,
    effective: Annotated[
        str | None,
        typer.Option(
            help="When it takes effect, ISO 8601 with a zone (e.g. 2027-01-01T00:00Z); "
            "default: as soon as allowed, the first whole minute at least "
            "TREADLE_PRICE_DELAY_SECONDS (60) from now. Never sooner."
        ),
    ] = None,
) -> None:
    """Add a price version; earlier versions stay as they were, for the usage they priced."""
    unit_micros = _micros(price, "the price")
    cached_micros = None if cached is None else _micros(cached, "--cached")
    effective_from = None if effective is None else _utc_time(effective)
    try:
        settings = Settings()
        with open_database(settings, writes=True).transaction() as db:
            rate = pricebook.set_price(
                db,
                SystemClock(),
                base_model=base_model,
                kind=kind,
                unit_micros=unit_micros,
                cached_unit_micros=cached_micros,
                effective_from=effective_from,
                delay=timedelta(seconds=settings.price_delay_seconds),
            )
    except TreadleError as exc:
        raise fail(exc.message) from exc
    console.print(
        f"{rate.base_model} {rate.kind}: ${_dollars(rate.unit_micros)} "
        f"{pricebook.unit_of(rate.kind)} from {rate.effective_from.isoformat()} (version {rate.id})"
    )


@prices_cli.command("list")
def prices_list() -> None:
    """The prices in force now, per base model and kind ('*': every model without its own)."""
    now = SystemClock().now()
    with open_database(Settings()).reader() as db:
        rates = pricebook.prices_in_force(db, now)
        scheduled = [r for r in pricebook.price_history(db) if r.effective_from > now]
    table = Table("model", "kind", "price ($)", "cached ($)", "unit", "since", "version")
    for r in rates:
        table.add_row(*_price_cells(r), r.effective_from.isoformat(timespec="seconds"), str(r.id))
    print_table(table)
    if scheduled:
        console.print(
            f"{len(scheduled)} version(s) take effect later; `treadle-server admin prices "
            "history` lists them"
        )


@prices_cli.command("history")
def prices_history(
    base_model: Annotated[str | None, typer.Option("--model", help="Only this model.")] = None,
    kind: Annotated[str | None, typer.Option(help="Only this kind.")] = None,
) -> None:
    """Every price version, latest effective first, with when and by whom it was set."""
    now = SystemClock().now()
    with open_database(Settings()).reader() as db:
        rates = pricebook.price_history(db, base_model=base_model, kind=kind)
        in_force = {r.id for r in pricebook.prices_in_force(db, now)}
    table = Table(
        "model", "kind", "price ($)", "cached ($)", "unit", "effective from", "state", "version"
    )
    for r in rates:
        state = (
            "scheduled" if r.effective_from > now else "in force" if r.id in in_force else "past"
        )
        table.add_row(
            *_price_cells(r), r.effective_from.isoformat(timespec="seconds"), state, str(r.id)
        )
    print_table(table)


def _micros(dollars: str, what: str) -> int:
    """Dollars as written on the command line, exactly, in micro-units."""
    try:
        amount = Decimal(dollars.strip().lstrip("$").replace(",", "")) * 1_000_000
    except InvalidOperation:
        raise fail(f"{what} is {dollars[:40]!r}; give dollars as a number, e.g. 0.22") from None
    if not amount.is_finite() or amount != amount.to_integral_value():
        raise fail(f"{what} {dollars[:40]} is finer than a micro-dollar; round it to 6 decimals")
    return int(amount)


def _dollars(micros: int) -> str:
    """Micro-units as dollars, with as many decimals as they need (at least two)."""
    whole, frac = divmod(micros, 1_000_000)
    return f"{whole}.{f'{frac:06d}'.rstrip('0').ljust(2, '0')}"


def _utc_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise fail(
            f"--effective {text[:40]!r} is not an ISO 8601 time; write e.g. 2027-01-01T00:00Z"
        ) from None
    if value.tzinfo is None:
        raise fail(f"--effective {text[:40]} has no time zone; append Z for UTC")
    return value.astimezone(UTC)


def _price_cells(rate: Rate) -> tuple[str, str, str, str, str]:
    cached = "" if rate.cached_unit_micros is None else _dollars(rate.cached_unit_micros)
    return (
        rate.base_model,
        rate.kind,
        _dollars(rate.unit_micros),
        cached,
        pricebook.unit_of(rate.kind),
    )


@tenants_cli.command("link-stripe")
def tenants_link_stripe(
    tenant: str,
    customer: Annotated[str, typer.Argument(help="The Stripe customer id (cus_...).")],
) -> None:
    """Bill a tenant's usage to a Stripe customer (Billing meters, pushed hourly)."""
    try:
        with open_database(Settings(), writes=True).transaction() as db:
            row = tenants.link_stripe_customer(
                db, SystemClock(), tenants.find_tenant(db, tenant), customer, actor="operator"
            )
    except TreadleError as exc:
        raise fail(exc.message) from exc
    console.print(f"tenant [bold]{row.name}[/] is billed to Stripe customer [bold]{customer}[/]")


def _stripe_settings() -> Settings:
    settings = Settings()
    if settings.stripe_api_key is None:
        raise fail(
            "TREADLE_STRIPE_API_KEY is not set: set it to a Stripe secret or restricted key "
            "with Billing meter access"
        )
    return settings


@billing_cli.command("push")
def billing_push() -> None:
    """Push every settled hour's unpushed usage to Stripe now."""
    from billing.stripe_push import push_from_settings

    settings = _stripe_settings()
    _logging(settings)
    try:
        report = push_from_settings(open_database(settings, writes=True), settings, SystemClock())
    except TreadleError as exc:
        raise fail(exc.message) from exc
    assert report is not None  # a key is set
    if not report.ran:
        raise fail("another Stripe push is running on this database; try again when it ends")
    console.print(
        f"pushed {report.pushed} meter events ({report.value_micros / 1e6:.6f} in money), "
        f"{report.repeats} of them already held by Stripe"
    )
    if report.too_old:
        err_console.print(
            f"[yellow]{len(report.too_old)} hours with usage are past Stripe's 35-day limit "
            "and were not pushed[/]"
        )
    for push in report.unconfirmed:
        err_console.print(
            f"[yellow]{push.identifier} ({push.value:,} micro-units) was meant for Stripe long "
            "enough ago that Stripe may have forgotten its identifier, and is not sent again: "
            "run `treadle-server admin billing reconcile` over its hour, then "
            f"`treadle-server admin billing resolve {push.identifier} --held` or --not-held[/]"
        )


@billing_cli.command("resolve")
def billing_resolve(
    identifier: Annotated[str, typer.Argument(help="The meter event's identifier.")],
    held: Annotated[
        bool,
        typer.Option(
            "--held/--not-held",
            help="Stripe holds its value (mark it accepted), or does not (the next push sends it).",
        ),
    ],
) -> None:
    """Settle a meter event that `admin billing push` reports as unconfirmed, once `admin
    billing reconcile` showed whether Stripe holds its value."""
    from billing.stripe_parts import resolve

    settings = Settings()
    try:
        push = resolve(open_database(settings, writes=True), SystemClock(), identifier, held=held)
    except TreadleError as exc:
        raise fail(exc.message) from exc
    console.print(
        f"{identifier} ({push.value:,} micro-units) "
        + ("marked as held by Stripe" if held else "forgotten; the next push sends its value")
    )


def _period_bound(text: str, option: str) -> datetime:
    """An ISO date or time; UTC when it names no zone."""
    try:
        when = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise fail(
            f"{option} {text[:40]!r} is not an ISO 8601 date or time; write e.g. 2027-01-01"
        ) from None
    return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)


@billing_cli.command("reconcile")
def billing_reconcile(
    since: Annotated[
        str | None, typer.Option(help="Start (ISO, UTC); default: this month's first day.")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="End, exclusive (ISO, UTC); default: the last settled hour.")
    ] = None,
) -> None:
    """Compare Stripe's meter totals with the ledger per tenant and usage kind; exits with 1
    when any differ."""
    from billing.stripe_push import gateway_from_settings
    from billing.stripe_reconcile import reconcile

    settings = _stripe_settings()
    gateway = gateway_from_settings(settings)
    assert gateway is not None
    clock = SystemClock()
    start = (
        _period_bound(since, "--since")
        if since
        else clock.now().replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    )
    end = _period_bound(until, "--until") if until else None
    _logging(settings)
    try:
        result = reconcile(
            open_database(settings, writes=True),  # each run's result is kept
            gateway,
            clock,
            since=start,
            until=end,
            meter_prefix=settings.stripe_meter_prefix,
            settle_seconds=settings.stripe_settle_seconds,
        )
    except TreadleError as exc:
        raise fail(exc.message) from exc
    if not result.balances:
        console.print(
            f"Nothing to compare over {result.since.isoformat()} .. {result.until.isoformat()}: "
            "no whole settled hour in it, or no linked tenant with usage or a meter there. "
            "Pass an earlier --since, or link tenants with `admin tenants link-stripe`."
        )
        return
    table = Table(
        "tenant",
        "meter",
        "stripe",
        "ledger",
        "recorded as pushed",
        "difference",
        "",
        title=f"{result.since.isoformat()} .. {result.until.isoformat()} (micro-units)",
    )
    for b in result.balances:
        table.add_row(
            b.tenant_name,
            b.event_name,
            f"{b.stripe_micros:,}",
            f"{b.ledger_micros:,}",
            f"{b.recorded_micros:,}",
            f"{b.stripe_micros - b.ledger_micros:+,}",
            ("[red]differs[/]" if b.meter_found else "[red]no meter in Stripe[/]")
            if b.differs
            else "",
        )
    print_table(table)
    if result.differences:
        err_console.print(f"[bold red]{len(result.differences)} meters differ from the ledger[/]")
        raise typer.Exit(code=1)
    console.print("Stripe matches the ledger")


def main() -> None:
    app()
