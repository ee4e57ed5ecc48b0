"""core.registry and core.lineage on SQLite and PostgreSQL: packages (create, rename, tags,
delete), versions (listing, promotion, deletion, TTLs), aliases with their audit entries, the
lineage graph, run packages' free names, and 20 concurrent promotions into one package."""

from __future__ import annotations

import itertools
import threading
from datetime import timedelta

import pytest
from sqlalchemy import select

from api import dbschema
from core import checkpoints, lineage, references, registry, runs, sessions, tenants
from core.clock import FakeClock
from core.db import Database
from core.errors import InvalidInput, NotFound
from core.tables import AuditLog, ModelPackage, ModelVersion, TrainingRun, VersionStatus

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"
_names = itertools.count()


def _tenant(database: Database, clock: FakeClock) -> str:
    with database.transaction() as db:
        tenant = tenants.create_tenant(
            db, clock, f"t{next(_names)}", max_concurrent_sessions=10, max_lora_rank=64
        )
        return tenant.id


def _run(database: Database, clock: FakeClock, tenant_id: str, *, base_model: str = MODEL) -> str:
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
            base_model=base_model,
            lora_config={"rank": 4},
            user_metadata=None,
        )
        return run.id


def _save(database: Database, clock: FakeClock, run_id: str, name: str) -> ModelVersion:
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
            artifact_uri=f"file:///artifacts/{run_id}/{name}",
            size_bytes=10,
            sha256="ab" * 32,
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


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def test_packages_create_rename_tag_list_and_delete(migrated: Database, clock: FakeClock) -> None:
    tenant, other = _tenant(migrated, clock), _tenant(migrated, clock)
    with migrated.transaction() as db:
        registry.create_package(
            db, clock, tenant, name="prod", description="d", tags=["b", "a", "a"],
            base_model=MODEL, training_run_id=None,
        )  # fmt: skip
        registry.create_package(
            db, clock, tenant, name="scratch_1", description=None, tags=["xy"],
            base_model=MODEL, training_run_id=None,
        )  # fmt: skip
    with pytest.raises(InvalidInput, match="is taken"), migrated.transaction() as db:
        registry.create_package(
            db, clock, tenant, name="prod", description=None, tags=[], base_model=MODEL,
            training_run_id=None,
        )  # fmt: skip
    with pytest.raises(InvalidInput, match="tag"), migrated.transaction() as db:
        registry.create_package(
            db, clock, tenant, name="p2", description=None, tags=['a"b'], base_model=MODEL,
            training_run_id=None,
        )  # fmt: skip
    with migrated.reader() as db:
        rows, total = registry.list_packages(db, tenant, tag=None, limit=10, offset=0)
        assert [p.name for p in rows] == ["prod", "scratch_1"] and total == 2
        assert rows[0].tags == ["a", "b"]
        tagged, _ = registry.list_packages(db, tenant, tag="a", limit=10, offset=0)
        assert [p.name for p in tagged] == ["prod"]
        # `_` is no wildcard, and another tenant sees none of them.
        assert registry.list_packages(db, tenant, tag="x_", limit=10, offset=0)[1] == 0
        with pytest.raises(InvalidInput, match="tag"):
            registry.list_packages(db, tenant, tag='a", "b', limit=10, offset=0)
        assert registry.list_packages(db, other, tag=None, limit=10, offset=0)[1] == 0
        with pytest.raises(NotFound):
            registry.get_package(db, other, "prod")
    with migrated.transaction() as db:
        renamed = registry.update_package(
            db, clock, tenant, "prod", new_name="production", set_description=True
        )
        assert (renamed.name, renamed.description, renamed.tags) == ("production", None, ["a", "b"])
    with migrated.transaction() as db:
        registry.delete_package(db, clock, tenant, "production")
    with migrated.transaction() as db:
        # The name is free again.
        registry.create_package(
            db, clock, tenant, name="production", description=None, tags=[], base_model=MODEL,
            training_run_id=None,
        )  # fmt: skip


def test_a_created_package_takes_a_runs_saves_once(migrated: Database, clock: FakeClock) -> None:
    tenant, other = _tenant(migrated, clock), _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    with pytest.raises(NotFound), migrated.transaction() as db:
        registry.create_package(
            db, clock, other, name="mine", description=None, tags=[], base_model=None,
            training_run_id=run,
        )  # fmt: skip
    with migrated.transaction() as db:
        package = registry.create_package(
            db, clock, tenant, name="chat", description=None, tags=[], base_model=None,
            training_run_id=run,
        )  # fmt: skip
        assert package.base_model == MODEL
    _save(migrated, clock, run, "a")
    assert _package_of(migrated, run) == "chat"
    with pytest.raises(InvalidInput, match="already saves into"), migrated.transaction() as db:
        registry.create_package(
            db, clock, tenant, name="chat2", description=None, tags=[], base_model=None,
            training_run_id=run,
        )  # fmt: skip


def test_a_run_package_takes_a_free_variant_of_the_run_name(
    migrated: Database, clock: FakeClock
) -> None:
    tenant = _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    with migrated.transaction() as db:
        for name in (run, f"{run}-2"):
            registry.create_package(
                db, clock, tenant, name=name, description=None, tags=[], base_model=MODEL,
                training_run_id=None,
            )  # fmt: skip
    _save(migrated, clock, run, "a")
    assert _package_of(migrated, run) == f"{run}-3"


def test_versions_promotion_aliases_and_deletion(migrated: Database, clock: FakeClock) -> None:
    tenant, other = _tenant(migrated, clock), _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    first, second = _save(migrated, clock, run, "a"), _save(migrated, clock, run, "b")
    source = _package_of(migrated, run)
    with migrated.transaction() as db:
        registry.create_package(
            db, clock, tenant, name="prod", description=None, tags=[], base_model=MODEL,
            training_run_id=None,
        )  # fmt: skip
        registry.create_package(
            db, clock, tenant, name="big", description=None, tags=[], base_model="other/model",
            training_run_id=None,
        )  # fmt: skip
    with pytest.raises(InvalidInput, match="same base model"), migrated.transaction() as db:
        registry.promote(db, clock, tenant, source, 2, target="big", actor_key_id=None)
    with pytest.raises(NotFound), migrated.transaction() as db:
        registry.promote(db, clock, other, source, 2, target="prod", actor_key_id=None)
    with migrated.transaction() as db:
        promoted = registry.promote(db, clock, tenant, source, 2, target="prod", actor_key_id=None)
        assert (promoted.version, promoted.tinker_path) == (1, None)
        assert promoted.source_version_id == second.id
        assert (promoted.artifact_uri, promoted.sha256) == (second.artifact_uri, second.sha256)
        registry.set_alias(db, clock, tenant, "prod", "production", 1, actor="k1")
    with migrated.transaction() as db:
        registry.set_alias(db, clock, tenant, source, "stable", 1, actor="k1")
        registry.set_alias(db, clock, tenant, source, "stable", 2, actor="k1")
        registry.set_alias(db, clock, tenant, source, "stable", 2, actor="k1")  # no change
        with pytest.raises(InvalidInput, match="kept by the registry"):
            registry.set_alias(db, clock, tenant, source, references.LATEST, 1, actor="k1")
    with migrated.reader() as db:
        assert references.lookup(db, tenant, "prod@production", clock.now()).id == promoted.id
        assert [
            (a.name, a.version, a.virtual) for a in registry.list_aliases(db, clock, tenant, source)
        ] == [
            ("latest", 2, True),
            ("stable", 2, False),
        ]
        audit = db.scalars(
            select(AuditLog).where(AuditLog.tenant_id == tenant).order_by(AuditLog.id)
        ).all()
        assert [(e.action, e.detail["from_version"], e.detail["to_version"]) for e in audit] == [  # type: ignore[index]
            ("registry.alias.created", None, 1),
            ("registry.alias.created", None, 1),
            ("registry.alias.moved", 1, 2),
        ]
    # A version an alias points at stays; the others can go, and their artifact stays.
    with pytest.raises(InvalidInput, match=f"{source}@stable"), migrated.transaction() as db:
        registry.delete_version(db, tenant, source, 2)
    with migrated.transaction() as db:
        registry.delete_version(db, tenant, source, 1)
    with migrated.reader() as db:
        gone = db.get(ModelVersion, first.id)
        assert gone is not None and gone.status == VersionStatus.DELETED
        assert (gone.tinker_path, gone.artifact_uri) == (None, first.artifact_uri)
        rows, total = registry.list_versions(db, tenant, source, status=None, limit=10, offset=0)
        assert [v.version for v in rows] == [2] and total == 1
        deleted, _ = registry.list_versions(
            db, tenant, source, status=VersionStatus.DELETED, limit=10, offset=0
        )
        assert [v.version for v in deleted] == [1]
    with (
        pytest.raises(InvalidInput, match="still has aliases stable"),
        migrated.transaction() as db,
    ):
        registry.delete_package(db, clock, tenant, source)
    with migrated.transaction() as db:
        registry.delete_alias(db, clock, tenant, source, "stable", actor="k1")
        with pytest.raises(NotFound):
            registry.delete_alias(db, clock, tenant, source, "stable", actor="k1")
    with migrated.transaction() as db:
        registry.delete_package(db, clock, tenant, source)
    with migrated.reader() as db:
        left = db.get(ModelVersion, second.id)
        assert left is not None and left.status == VersionStatus.DELETED
        # The promoted copy lives on, on the same artifact.
        assert (
            references.lookup(db, tenant, "prod:1", clock.now()).artifact_uri == second.artifact_uri
        )


def test_version_ttl_reuses_the_checkpoint_bounds(migrated: Database, clock: FakeClock) -> None:
    tenant = _tenant(migrated, clock)
    run = _run(migrated, clock, tenant)
    _save(migrated, clock, run, "a")
    package = _package_of(migrated, run)
    with pytest.raises(InvalidInput, match="ttl_seconds"), migrated.transaction() as db:
        registry.set_version_ttl(db, clock, tenant, package, 1, 5)
    with migrated.transaction() as db:
        version = registry.set_version_ttl(db, clock, tenant, package, 1, 7200)
        assert version.expires_at == clock.now() + timedelta(seconds=7200)
    clock.advance(7200)
    with pytest.raises(InvalidInput, match="is expired"), migrated.transaction() as db:
        registry.set_alias(db, clock, tenant, package, "stable", 1, actor="k1")


def test_lineage_follows_saves_loads_and_promotions(migrated: Database, clock: FakeClock) -> None:
    tenant, other = _tenant(migrated, clock), _tenant(migrated, clock)
    parent_run = _run(migrated, clock, tenant)
    saved = _save(migrated, clock, parent_run, "a")
    child_run = _run(migrated, clock, tenant)
    with migrated.transaction() as db:
        child = db.get(TrainingRun, child_run)
        assert child is not None
        runs.loaded_from(child, saved.id)
    child_saved = _save(migrated, clock, child_run, "b")
    child_package = _package_of(migrated, child_run)
    with migrated.transaction() as db:
        registry.create_package(
            db, clock, tenant, name="prod", description=None, tags=[], base_model=MODEL,
            training_run_id=None,
        )  # fmt: skip
        promoted = registry.promote(
            db, clock, tenant, child_package, 1, target="prod", actor_key_id=None
        )
        promoted_id = promoted.id
    with migrated.reader() as db:
        graph = lineage.package_lineage(db, tenant, "prod")
        with pytest.raises(NotFound):
            lineage.package_lineage(db, other, "prod")
    edges = {(e.source, e.target, e.relation) for e in graph.edges}
    assert edges == {
        (f"run:{parent_run}", f"version:{saved.id}", "saved"),
        (f"version:{saved.id}", f"run:{child_run}", "loaded"),
        (f"run:{child_run}", f"version:{child_saved.id}", "saved"),
        (f"version:{child_saved.id}", f"version:{promoted_id}", "promoted"),
    }
    assert len(graph.nodes) == 5 and not graph.truncated
    with migrated.reader() as db:
        small = lineage.package_lineage(db, tenant, "prod", max_nodes=2)
    assert small.truncated and len(small.nodes) == 2


@pytest.fixture
def postgres(postgres_url: str) -> Database:
    database = Database(postgres_url)
    dbschema.upgrade(database)
    return database


def test_twenty_concurrent_promotions_get_consecutive_numbers(
    postgres: Database, clock: FakeClock
) -> None:
    tenant = _tenant(postgres, clock)
    run = _run(postgres, clock, tenant)
    _save(postgres, clock, run, "a")
    source = _package_of(postgres, run)
    with postgres.transaction() as db:
        registry.create_package(
            db, clock, tenant, name="prod", description=None, tags=[], base_model=MODEL,
            training_run_id=None,
        )  # fmt: skip
    start = threading.Barrier(20)
    numbers: list[int] = []
    failures: list[BaseException] = []

    def promote() -> None:
        try:
            start.wait()
            with postgres.transaction() as db:
                version = registry.promote(
                    db, clock, tenant, source, 1, target="prod", actor_key_id=None
                )
                numbers.append(version.version)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=promote) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert sorted(numbers) == list(range(1, 21))
