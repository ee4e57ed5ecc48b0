"""The registry's consistency under concurrent and unusual requests, on SQLite and PostgreSQL.

The races are interleaved by hand on PostgreSQL: one transaction is left open after its
change, the other runs in a thread until PostgreSQL shows it waiting on a row lock (or it ended
without waiting, and then its answer is the wrong one), then the first commits.
Also: what deletions and TTLs refuse, which runs keep a loaded artifact, what `@latest` names,
how foreign parent versions are shown, and that collection forgets a URI on every row.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import select, text

from api import dbschema
from core import checkpoints, references, registry, runs, sessions, tenants
from core.clock import FakeClock
from core.db import Database
from core.errors import InvalidInput, NotFound
from core.tables import ModelPackage, ModelVersion, TrainingRun, VersionStatus
from scheduler import artifact_gc

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"
_names = itertools.count()


def _tenant(database: Database, clock: FakeClock) -> str:
    with database.transaction() as db:
        tenant = tenants.create_tenant(
            db, clock, f"c{next(_names)}", max_concurrent_sessions=10, max_lora_rank=64
        )
        return tenant.id


def _run(database: Database, clock: FakeClock, tenant_id: str) -> str:
    with database.transaction() as db:
        session = sessions.create_session(
            db, clock, tenant_id=tenant_id, api_key_id=None, ttl_seconds=3600
        )
        run, _ = runs.create_training_run(
            db,
            clock,
            tenant_id=tenant_id,
            session_id=session.id,
            model_seq_id=0,
            base_model=MODEL,
            lora_config={"rank": 4},
            user_metadata=None,
        )
        return run.id


def _save(
    database: Database, clock: FakeClock, run_id: str, name: str | None, **options: Any
) -> ModelVersion:
    clock.advance(1)
    with database.transaction() as db:
        run = db.get(TrainingRun, run_id)
        assert run is not None
        version = checkpoints.register(
            db,
            clock,
            run=run,
            kind="training",
            name=name,
            artifact_uri=options.pop("artifact_uri", f"file:///artifacts/{run_id}/{name}"),
            size_bytes=10,
            sha256="ab" * 32,
            **options,
        )
        db.expunge(version)
        return version


def _package_of(database: Database, run_id: str) -> str:
    with database.reader() as db:
        name = db.scalar(
            select(ModelPackage.name).where(
                ModelPackage.training_run_id == run_id, ModelPackage.deleted_at.is_(None)
            )
        )
        assert name is not None
        return name


def _create(db: Any, clock: FakeClock, tenant: str, name: str, run: str | None = None) -> None:
    registry.create_package(
        db, clock, tenant, name=name, description=None, tags=[],
        base_model=None if run else MODEL, training_run_id=run,
    )  # fmt: skip


def _version(database: Database, version_id: str) -> ModelVersion:
    with database.reader() as db:
        version = db.get(ModelVersion, version_id)
        assert version is not None
        db.expunge(version)
        return version


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def postgres(postgres_url: str) -> Database:
    database = Database(postgres_url)
    dbschema.upgrade(database)
    return database


# --- races, interleaved on PostgreSQL -----------------------------------------------------------


def _meanwhile(database: Database, second: Callable[[], object]) -> Callable[[], object]:
    """Start `second` in a thread and return once it waits on a lock (or ended without);
    the returned function joins it and gives its result, or raises what it raised."""
    outcome: list[object] = []

    def work() -> None:
        try:
            outcome.append(second())
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=work)
    thread.start()
    deadline = time.monotonic() + 30
    waiting = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
    while thread.is_alive() and time.monotonic() < deadline:
        with database.reader() as db:
            if db.scalar(text(waiting)):
                break
        time.sleep(0.005)

    def result() -> object:
        thread.join()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return outcome[0]

    return result


def _delete_checkpoint(database: Database, clock: FakeClock, tenant: str, path: str) -> object:
    """What the DELETE checkpoint route does; returns the URI it would remove."""
    run_id, _, rest = path.removeprefix("tinker://").partition("/")
    with database.transaction() as db:
        version = checkpoints.owned(db, clock, tenant, run_id, rest)
        checkpoints.require_unaliased(db, version, "delete")
        return checkpoints.mark_deleted(version)


def test_a_checkpoint_deleted_while_it_is_promoted_keeps_its_files(
    postgres: Database, clock: FakeClock
) -> None:
    tenant = _tenant(postgres, clock)
    run = _run(postgres, clock, tenant)
    saved = _save(postgres, clock, run, "a")
    assert saved.tinker_path is not None
    with postgres.transaction() as db:
        _create(db, clock, tenant, "prod")
    with postgres.transaction() as db:
        copy = registry.promote(
            db, clock, tenant, _package_of(postgres, run), 1, target="prod", actor_key_id=None
        )
        deleting = _meanwhile(
            postgres, lambda: _delete_checkpoint(postgres, clock, tenant, saved.tinker_path or "")
        )
    # The deletion waited for the promotion, saw the copy and left the files to it.
    assert deleting() is None
    assert _version(postgres, copy.id).artifact_uri == saved.artifact_uri
    assert _version(postgres, saved.id).artifact_uri == saved.artifact_uri


def test_a_promotion_waiting_for_a_deletion_finds_the_version_gone(
    postgres: Database, clock: FakeClock
) -> None:
    tenant = _tenant(postgres, clock)
    run = _run(postgres, clock, tenant)
    saved = _save(postgres, clock, run, "a")
    package = _package_of(postgres, run)
    with postgres.transaction() as db:
        _create(db, clock, tenant, "prod")

    def promote() -> object:
        with postgres.transaction() as db:
            return registry.promote(db, clock, tenant, package, 1, target="prod", actor_key_id=None)

    with postgres.transaction() as db:
        version = checkpoints.owned(db, clock, tenant, run, "weights/a")
        checkpoints.require_unaliased(db, version, "delete")
        assert checkpoints.mark_deleted(version) == saved.artifact_uri
        promoting = _meanwhile(postgres, promote)
    with pytest.raises(NotFound, match="version 1"):
        promoting()


def test_an_alias_set_while_its_version_is_deleted_refuses_the_deletion(
    postgres: Database, clock: FakeClock
) -> None:
    tenant = _tenant(postgres, clock)
    run = _run(postgres, clock, tenant)
    saved = _save(postgres, clock, run, "a")
    package = _package_of(postgres, run)
    with postgres.transaction() as db:
        registry.set_alias(db, clock, tenant, package, "production", 1, actor="k")
        deleting = _meanwhile(
            postgres, lambda: _delete_checkpoint(postgres, clock, tenant, saved.tinker_path or "")
        )
    with pytest.raises(InvalidInput, match=f"{package}@production points at it"):
        deleting()
    assert _version(postgres, saved.id).status == VersionStatus.READY


def test_two_first_saves_of_a_run_share_one_package(postgres: Database, clock: FakeClock) -> None:
    tenant = _tenant(postgres, clock)
    run = _run(postgres, clock, tenant)
    with postgres.transaction() as db:
        first = checkpoints.begin_upload(
            db, clock, run=_get_run(db, run), kind="training", name="a", artifact_uri="file:///a"
        )

        def second() -> object:
            with postgres.transaction() as other:
                return checkpoints.begin_upload(
                    other, clock, run=_get_run(other, run), kind="training", name="b",
                    artifact_uri="file:///b",
                ).package_id  # fmt: skip

        saving = _meanwhile(postgres, second)
    assert saving() == first.package_id
    # And a package created for the run while its first save makes one is refused.
    other_run = _run(postgres, clock, tenant)
    with postgres.transaction() as db:
        checkpoints.begin_upload(
            db, clock, run=_get_run(db, other_run), kind="training", name="a",
            artifact_uri="file:///c",
        )  # fmt: skip

        def create() -> object:
            with postgres.transaction() as other:
                _create(other, clock, tenant, "mine", run=other_run)
            return None

        creating = _meanwhile(postgres, create)
    with pytest.raises(InvalidInput, match="already saves into package"):
        creating()


def _get_run(db: Any, run_id: str) -> TrainingRun:
    run = db.get(TrainingRun, run_id)
    assert run is not None
    return run


# --- refusals and what views show, on both databases -------------------------------------------


def test_uploading_versions_are_not_deleted(migrated: Database, clock: FakeClock) -> None:
    tenant = _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    _save(migrated, clock, run, "a")
    with migrated.transaction() as db:
        pending = checkpoints.begin_upload(
            db, clock, run=_get_run(db, run), kind="training", name="b", artifact_uri="file:///b"
        )
        pending_id = pending.id
    package = _package_of(migrated, run)
    with pytest.raises(InvalidInput, match="still uploading; retry"), migrated.transaction() as db:
        registry.delete_version(db, tenant, package, 2)
    with pytest.raises(InvalidInput, match=r"uploading \(2\); retry"), migrated.transaction() as db:
        registry.delete_package(db, clock, tenant, package)
    assert _version(migrated, pending_id).status == VersionStatus.PENDING
    # A version gone meanwhile (as before these refusals) is no server setting to raise.
    with migrated.transaction() as db:
        checkpoints.retire(db.get(ModelVersion, pending_id))  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="deleted meanwhile; save again"):
        _save(migrated, clock, run, "b", artifact_uri="file:///b", pending=pending_id)


def test_a_ttl_never_revives_an_expired_version(migrated: Database, clock: FakeClock) -> None:
    tenant = _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    _save(migrated, clock, run, "a", ttl_seconds=3600)
    package = _package_of(migrated, run)
    clock.advance(3601)
    with (
        pytest.raises(InvalidInput, match="is expired; set the TTL of a ready"),
        migrated.transaction() as db,
    ):
        registry.set_version_ttl(db, clock, tenant, package, 1, None)


def test_overwriting_an_aliased_checkpoint_is_refused_before_the_upload(
    migrated: Database, clock: FakeClock
) -> None:
    tenant = _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    _save(migrated, clock, run, "a")
    package = _package_of(migrated, run)
    with migrated.transaction() as db:
        registry.set_alias(db, clock, tenant, package, "production", 1, actor="k")
    with pytest.raises(InvalidInput, match="production points at it"), migrated.transaction() as db:
        checkpoints.begin_upload(
            db, clock, run=_get_run(db, run), kind="training", name="a",
            artifact_uri="file:///again", overwrite=True,
        )  # fmt: skip
    with migrated.reader() as db:
        assert (
            db.scalar(select(ModelVersion.id).where(ModelVersion.artifact_uri == "file:///again"))
            is None
        )


def test_latest_names_the_newest_usable_version(migrated: Database, clock: FakeClock) -> None:
    tenant = _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    _save(migrated, clock, run, "a")
    _save(migrated, clock, run, "b", ttl_seconds=3600)
    files_gone = _save(migrated, clock, run, "c")
    with migrated.transaction() as db:
        version = db.get(ModelVersion, files_gone.id)
        assert version is not None
        version.artifact_uri = None  # as after a crash between removal and the row's change
    package = _package_of(migrated, run)
    with migrated.reader() as db:
        package_id = registry.get_package(db, tenant, package).id
        latest = references.latest_version(db, package_id, clock.now())
        assert latest is not None and latest.version == 2
        assert registry.version_counts(db, [package_id], clock.now())[package_id] == (3, 2)
        with pytest.raises(NotFound, match="version 3, which is without files"):
            checkpoints.resolve(db, clock, tenant, f"{package}:3")
    clock.advance(3600)
    with migrated.reader() as db:
        assert references.lookup(db, tenant, f"{package}@latest", clock.now()).version == 1
        assert registry.version_counts(db, [package_id], clock.now())[package_id] == (3, 1)
        assert [a.version for a in registry.list_aliases(db, clock, tenant, package)] == [1]


def test_a_parent_of_another_tenant_shows_only_its_public_path(
    migrated: Database, clock: FakeClock
) -> None:
    owner, tenant = _tenant(migrated, clock), _tenant(migrated, clock)
    owner_run, run = _run(migrated, clock, owner), _run(migrated, clock, tenant)
    published = _save(migrated, clock, owner_run, "base")
    with migrated.transaction() as db:
        checkpoints.set_public(db.get(ModelVersion, published.id), True)  # type: ignore[arg-type]
        runs.loaded_from(_get_run(db, run), published.id)
    child = _save(migrated, clock, run, "child")
    own_child = _save(migrated, clock, owner_run, "own")
    with migrated.reader() as db:
        wanted = {published.id, own_child.id}
        assert registry.version_refs(db, tenant, wanted) == {published.id: published.tinker_path}
        assert registry.version_refs(db, owner, wanted) == {
            published.id: f"{_package_of(migrated, owner_run)}:1",
            own_child.id: f"{_package_of(migrated, owner_run)}:2",
        }
    assert _version(migrated, child.id).parent_version_id == published.id
    with migrated.transaction() as db:
        checkpoints.set_public(db.get(ModelVersion, published.id), False)  # type: ignore[arg-type]
    with migrated.reader() as db:
        assert registry.version_refs(db, tenant, {published.id}) == {}


# --- artifacts a run may replay, and collection ------------------------------------------------


class _Store:
    """Records the artifacts collection removes (it only calls `delete`)."""

    def __init__(self) -> None:
        self.deleted: list[str] = []

    def delete(self, uri: str) -> None:
        self.deleted.append(uri)


def _collect(database: Database, clock: FakeClock, store: _Store, **options: Any) -> Any:
    return artifact_gc.collect(
        database,
        store,
        clock,
        pending_grace=timedelta(hours=1),
        **options,  # type: ignore[arg-type]
    )


def test_a_loaded_artifact_stays_while_the_loading_session_is_active(
    migrated: Database, clock: FakeClock
) -> None:
    tenant = _tenant(migrated, clock)
    source_run, run = _run(migrated, clock, tenant), _run(migrated, clock, tenant)
    loaded = _save(migrated, clock, source_run, "a")
    expiring = _save(migrated, clock, source_run, "b", ttl_seconds=3600)
    with migrated.transaction() as db:
        runs.loaded_from(_get_run(db, run), loaded.id)
    # Deleted by its owner: the files stay, named by the deleted version for collection.
    assert _delete_checkpoint(migrated, clock, tenant, loaded.tinker_path or "") is None
    assert _version(migrated, loaded.id).artifact_uri == loaded.artifact_uri
    store = _Store()
    assert _collect(migrated, clock, store).versions == 0
    # An expired version a run was loaded from (later, by load_state) stays too.
    with migrated.transaction() as db:
        runs.loaded_from(_get_run(db, run), expiring.id)
    clock.advance(3601)
    assert _collect(migrated, clock, store).versions == 1  # `loaded` only
    assert store.deleted == [loaded.artifact_uri]
    with migrated.transaction() as db:
        session_id = _get_run(db, run).session_id
        sessions.finish(
            db, clock, tenant_id=tenant, session_id=session_id, reason="success", detail=None,
            ttl_seconds=300,
        )  # fmt: skip
    assert _collect(migrated, clock, store).versions == 1
    assert store.deleted == [loaded.artifact_uri, expiring.artifact_uri]
    assert _version(migrated, expiring.id).artifact_uri is None


def test_collection_forgets_a_removed_artifact_on_every_row(
    migrated: Database, clock: FakeClock
) -> None:
    tenant = _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    first = _save(migrated, clock, run, "a", ttl_seconds=3600)
    second = _save(migrated, clock, run, None, artifact_uri=first.artifact_uri)
    with migrated.transaction() as db:
        checkpoints.retire(db.get(ModelVersion, second.id))  # type: ignore[arg-type]
    clock.advance(3601)
    store = _Store()
    # One row per batch: the first removal forgets the URI on both rows, so it is removed once.
    assert _collect(migrated, clock, store, batch=1).versions == 1
    assert store.deleted == [first.artifact_uri]
    assert {_version(migrated, v.id).artifact_uri for v in (first, second)} == {None}
