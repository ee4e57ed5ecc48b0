"""The FastAPI application factory."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from api import admin, dbschema
from api import metrics as api_metrics
from api.deps import AppState
from api.errors import install_error_handlers
from api.hosts import AllowedHosts
from api.jsonbody import JsonBodyGuard
from api.limits import BodySizeLimit
from api.metrics import RequestMetrics
from api.openapi import install_openapi
from api.ratelimit import TokenBuckets
from api.readiness import Readiness
from api.request_log import RequestLog
from api.routes import (
    artifacts,
    audit,
    billing_usage,
    chat,
    checkpoints,
    client,
    cost_estimate,
    downloads,
    futures,
    hub,
    models,
    oai,
    registry,
    runs,
    sampling,
    sessions,
    training,
    usage,
    weights,
)
from billing import jobs as billing_jobs
from core import sessions as session_service
from core.clock import Clock, SystemClock
from core.objectstore import open_store
from core.settings import Mode, Settings
from scheduler import artifact_cache, artifact_gc, retention
from scheduler import metrics as scheduler_metrics
from scheduler.dispatch import CeleryDispatcher, Dispatcher
from scheduler.fleet_gauges import FleetGauges
from scheduler.notify import InProcessNotifier, Notifier, RedisNotifier
from scheduler.worker.embedded import embedded_dispatcher

logger = logging.getLogger(__name__)


def create_app(settings: Settings | None = None, *, clock: Clock | None = None) -> FastAPI:
    """Build the API for `settings` (embedded mode when none are given).

    The database must already be at the head revision, except the default embedded SQLite file,
    which Treadle owns and upgrades itself.
    """
    settings = settings or Settings()
    clock = clock or SystemClock()
    database = dbschema.open_database(settings)
    store = open_store(settings)
    notifier: Notifier
    dispatcher: Dispatcher
    if settings.mode is Mode.DISTRIBUTED:
        assert settings.redis_url is not None
        notifier = RedisNotifier(settings.redis_url)
        dispatcher = CeleryDispatcher(settings, clock)
    else:
        notifier = InProcessNotifier()
        dispatcher = embedded_dispatcher(settings, database, clock, notifier, store)
    state = AppState(
        settings=settings,
        database=database,
        clock=clock,
        server_secret=settings.secret_bytes(),
        telemetry_limiter=TokenBuckets(settings.telemetry_per_minute),
        notifier=notifier,
        dispatcher=dispatcher,
        store=store,
        readiness=Readiness(settings, database),
    )

    # The fleet's gauges come from the one process that runs everything here; in distributed
    # mode beat exports them (`scheduler.fleet_gauges`).
    fleet = [FleetGauges(database, clock)] if settings.mode is Mode.EMBEDDED else []
    metrics_registry = scheduler_metrics.registry_with(*fleet)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        metrics_port = scheduler_metrics.serve_port(settings, metrics_registry)
        if settings.metrics_token is None:
            logger.info(api_metrics.OFF_HINT)
        state.dispatcher.start()
        if isinstance(notifier, RedisNotifier):
            notifier.start_listening()
        periodic = [
            asyncio.create_task(_freeze_once_started(state)),
            asyncio.create_task(_sweep_expired_sessions(state)),
            asyncio.create_task(state.readiness.run_periodically()),
            # Each replica's own disk: its copies of S3 artifacts (`scheduler.artifact_cache`).
            asyncio.create_task(_trim_artifact_cache(state)),
        ]
        if settings.mode is Mode.EMBEDDED:  # distributed mode: `treadle-server beat` runs them
            periodic.append(asyncio.create_task(_run_billing_jobs(state)))
            periodic.append(asyncio.create_task(_prune_op_log(state)))
            periodic.append(asyncio.create_task(_collect_artifacts(state)))
        try:
            yield
        finally:
            for task in periodic:
                task.cancel()
            for task in periodic:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            # Back into the collector's reach, so what this app held can be freed once it stops.
            gc.unfreeze()
            await asyncio.to_thread(state.dispatcher.stop)
            if isinstance(notifier, RedisNotifier):
                notifier.stop()
            state.readiness.close()
            scheduler_metrics.stop_port(metrics_port)
            for gauges in fleet:
                gauges.close()
            database.dispose()

    app = FastAPI(title="Treadle", version="0.1.0", lifespan=lifespan)
    app.state.treadle = state
    app.state.metrics = metrics_registry
    install_error_handlers(app)
    install_openapi(app)
    # Routes are matched in this order, one by one: the routers of every op's requests (the
    # long-poll, training, sampling, the heartbeat) come first.
    for module in (
        futures,
        training,
        sampling,
        sessions,
        client,
        weights,
        models,
        hub,
        runs,
        checkpoints,
        artifacts,
        downloads,
        usage,
        billing_usage,
        audit,
        cost_estimate,
        registry,
        oai,
        chat,
    ):
        app.include_router(module.router)
    admin.install(app)
    app.include_router(api_metrics.router)
    # The last added runs first: hosts are checked before a body is read, and the size limit
    # bounds what the JSON checks buffer.
    app.add_middleware(JsonBodyGuard)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    if settings.allowed_hosts:
        app.add_middleware(AllowedHosts, patterns=settings.allowed_hosts)
    app.add_middleware(RequestMetrics)  # times every answer, refusals included
    app.add_middleware(RequestLog)  # outermost: every answer carries and logs its request id
    return app


def _expire_idle(state: AppState) -> list[str]:
    with state.database.transaction() as db:
        return session_service.expire_idle(db, state.clock, state.settings.session_ttl_seconds)


async def _freeze_once_started(state: AppState) -> None:
    """Once the engine has started (embedded mode: torch imported and the models sized, in the
    engine's thread; distributed mode: at once), freeze what start-up built out of the garbage
    collector's generations, so a full collection no longer walks it. Such collections made the
    slowest requests: 100-250 ms each once torch is loaded, against 20 ms for a week of hourly
    usage. Start-up's garbage is not collected first (a collection that long per start adds up
    where many apps start, as in tests); the little there is stays until the app stops."""
    while not state.dispatcher.wait_ready(0):
        if state.dispatcher.failure is not None:
            return
        await asyncio.sleep(0.25)
    gc.freeze()


async def _sweep_expired_sessions(state: AppState) -> None:
    """Expire silent sessions periodically so their slots and resources are freed."""
    while True:
        await asyncio.sleep(state.settings.expiry_sweep_seconds)
        try:
            expired = await asyncio.to_thread(_expire_idle, state)
            if expired:
                logger.info("expired %d idle sessions", len(expired))
        except Exception:
            logger.exception("session expiry sweep failed")


async def _run_billing_jobs(state: AppState) -> None:
    """Run billing's periodic jobs (storage metering first at start-up, so missed hours are
    caught up at once); each job keeps to its own interval."""
    while True:
        try:
            await asyncio.to_thread(
                billing_jobs.run_periodic, state.database, state.settings, state.clock
            )
        except Exception:
            logger.exception("billing jobs failed")
        await asyncio.sleep(billing_jobs.tick_seconds(state.settings))


async def _collect_artifacts(state: AppState) -> None:
    """Remove artifacts nothing needs any more (`scheduler.artifact_gc`)."""
    while True:
        await asyncio.to_thread(
            artifact_gc.run_periodic, state.database, state.settings, state.clock, state.store
        )
        await asyncio.sleep(artifact_gc.EVERY_SECONDS)


async def _trim_artifact_cache(state: AppState) -> None:
    """Remove this process's cached artifact files nothing will read again."""
    while True:
        await asyncio.to_thread(
            artifact_cache.run_periodic, state.database, state.settings, state.clock, state.store
        )
        await asyncio.sleep(artifact_cache.EVERY_SECONDS)


async def _prune_op_log(state: AppState) -> None:
    """Empty the op log's payloads that nothing can replay any more (`scheduler.retention`)."""
    while True:
        await asyncio.to_thread(retention.run_periodic, state.database, state.settings, state.clock)
        await asyncio.sleep(retention.EVERY_SECONDS)
