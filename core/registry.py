"""The model registry: a tenant's packages, their versions' registry changes, and aliases.

This module owns packages' rows (create, rename, describe, tag, delete) and aliases' rows, and
the registry's changes to versions: promotion (a new version row sharing another's artifact),
deletion and TTLs, which it makes through `core.checkpoints` (the owner of versions' statuses).
Saves register their versions through `core.checkpoints.register`, not here. It never removes
files: a deleted version keeps its artifact URI, and the periodic artifact job removes what no
live version shares. Every lookup is scoped by tenant, so another tenant's package, version or
alias looks exactly like a missing one.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import String, cast, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session as OrmSession

from core import audit, checkpoints, references, runs
from core.clock import Clock
from core.errors import InvalidInput, NotFound
from core.tables import ModelAlias, ModelPackage, ModelVersion, VersionStatus

TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_TAGS = 32


@dataclass(frozen=True)
class AliasEntry:
    """An alias as listings show it; `latest` is virtual (kept by the registry itself)."""

    name: str
    version: int
    virtual: bool
    updated_at: datetime | None


# --- packages ---------------------------------------------------------------------------------


def _not_found(name: str) -> NotFound:
    return NotFound(f"package {name!r} not found; list yours with `treadle registry packages`")


def get_package(db: OrmSession, tenant_id: str, name: str, *, lock: bool = False) -> ModelPackage:
    query = select(ModelPackage).where(
        ModelPackage.tenant_id == tenant_id,
        ModelPackage.name == name,
        ModelPackage.deleted_at.is_(None),
    )
    package = db.scalar(query.with_for_update() if lock else query)
    if package is None:
        raise _not_found(name)
    return package


def check_tags(tags: list[str]) -> list[str]:
    if len(tags) > MAX_TAGS:
        raise InvalidInput(f"{len(tags)} tags given; pass at most {MAX_TAGS}")
    for tag in tags:
        if not TAG.fullmatch(tag):
            raise InvalidInput(
                f"tag {tag[:70]!r} is invalid; use 1 to 64 letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
    return sorted(set(tags))


def list_packages(
    db: OrmSession, tenant_id: str, *, tag: str | None, limit: int, offset: int
) -> tuple[list[ModelPackage], int]:
    """The tenant's live packages by name; with `tag`, only those carrying it."""
    conditions = [ModelPackage.tenant_id == tenant_id, ModelPackage.deleted_at.is_(None)]
    if tag is not None:
        check_tags([tag])
        # Tags hold no quotes or backslashes (`check_tags`), so the quoted tag matches exactly
        # one element of the stored JSON list on both databases.
        conditions.append(cast(ModelPackage.tags, String).contains(f'"{tag}"', autoescape=True))
    total = db.scalar(select(func.count()).select_from(ModelPackage).where(*conditions)) or 0
    rows = db.scalars(
        select(ModelPackage)
        .where(*conditions)
        .order_by(ModelPackage.name)
        .limit(limit)
        .offset(offset)
    )
    return list(rows), total


def _require_free_name(db: OrmSession, tenant_id: str, name: str) -> None:
    references.check_package_name(name)
    if references.live_package(db, tenant_id, name) is not None:
        raise _name_taken(name)


def _name_taken(name: str) -> InvalidInput:
    return InvalidInput(
        f"package name {name!r} is taken; pick another name, or rename or delete that package"
    )


def _run_package(db: OrmSession, run_id: str) -> str | None:
    """The name of the live package `run_id` saves into, if it has one."""
    return db.scalar(
        select(ModelPackage.name).where(
            ModelPackage.training_run_id == run_id, ModelPackage.deleted_at.is_(None)
        )
    )


def _run_has_package(run_id: str, current: str) -> InvalidInput:
    return InvalidInput(
        f"training run {run_id} already saves into package {current!r}; rename that "
        "package instead, or create this one without training_run_id"
    )


def create_package(
    db: OrmSession,
    clock: Clock,
    tenant_id: str,
    *,
    name: str,
    description: str | None,
    tags: list[str],
    base_model: str | None,
    training_run_id: str | None,
) -> ModelPackage:
    """A new empty package. With `training_run_id` it becomes that run's package: the run's
    future saves register in it (allowed while the run has no live package)."""
    _require_free_name(db, tenant_id, name)
    tags = check_tags(tags)
    if training_run_id is not None:
        run = runs.get_run(db, tenant_id, training_run_id)
        current = _run_package(db, run.id)
        if current is not None:
            raise _run_has_package(run.id, current)
        if base_model is not None and base_model != run.base_model:
            raise InvalidInput(
                f"base_model {base_model!r} differs from the run's {run.base_model!r}; omit "
                "base_model to take the run's"
            )
        base_model = run.base_model
    if base_model is None:
        raise InvalidInput("pass base_model (or training_run_id, to take that run's base model)")
    now = clock.now()
    package = ModelPackage(
        id="pkg_" + uuid.uuid4().hex[:16],
        tenant_id=tenant_id,
        name=name,
        description=description,
        tags=tags,
        base_model=base_model,
        training_run_id=training_run_id,
        created_at=now,
        updated_at=now,
    )
    _flush_name(db, name, package)
    return package


def _flush_name(db: OrmSession, name: str, new: ModelPackage | None = None) -> None:
    """Flush a new (`new`) or renamed package, in a savepoint. A concurrent request that took
    the name first, or gave the run a package first (a first save of the run), fails a partial
    unique index: the same refusal as a name or run package found taken."""
    try:
        with db.begin_nested():
            if new is not None:
                db.add(new)
    except IntegrityError as exc:
        run_id = new.training_run_id if new is not None else None
        current = _run_package(db, run_id) if run_id is not None else None
        if run_id is not None and current is not None:
            raise _run_has_package(run_id, current) from exc
        raise _name_taken(name) from exc


def update_package(
    db: OrmSession,
    clock: Clock,
    tenant_id: str,
    name: str,
    *,
    new_name: str | None = None,
    description: str | None = None,
    set_description: bool = False,
    tags: list[str] | None = None,
) -> ModelPackage:
    """Rename, describe or tag a package; what is not passed stays (`set_description` with
    `description=None` clears the description)."""
    package = get_package(db, tenant_id, name, lock=True)
    checked_tags = check_tags(tags) if tags is not None else None
    if new_name is not None and new_name != package.name:
        _require_free_name(db, tenant_id, new_name)
        package.name = new_name
    if set_description:
        package.description = description
    if checked_tags is not None:
        package.tags = checked_tags
    package.updated_at = clock.now()
    _flush_name(db, package.name)
    return package


def delete_package(db: OrmSession, clock: Clock, tenant_id: str, name: str) -> ModelPackage:
    """Delete a package and its versions, freeing its name; refused while aliases remain or a
    version is still uploading."""
    package = get_package(db, tenant_id, name, lock=True)
    aliases = list(
        db.scalars(
            select(ModelAlias.name)
            .where(ModelAlias.package_id == package.id)
            .order_by(ModelAlias.name)
        )
    )
    if aliases:
        raise InvalidInput(
            f"package {name!r} still has aliases {', '.join(aliases)}; delete them first "
            f"(`treadle registry unalias {name} <alias>`)"
        )
    versions = db.scalars(
        select(ModelVersion)
        .where(ModelVersion.package_id == package.id, ModelVersion.status != VersionStatus.DELETED)
        .order_by(ModelVersion.version)
        .with_for_update()
    ).all()
    uploading = [v.version for v in versions if v.status == VersionStatus.PENDING]
    if uploading:
        raise InvalidInput(
            f"package {name!r} has versions still uploading ({', '.join(map(str, uploading))}); "
            "retry once they are ready or failed"
        )
    for version in versions:
        checkpoints.retire(version)
    now = clock.now()
    package.deleted_at, package.updated_at = now, now
    db.flush()
    return package


def version_counts(
    db: OrmSession, package_ids: list[str], now: datetime
) -> dict[str, tuple[int, int | None]]:
    """(versions not deleted, the number `@latest` names: see `references.latest_version`)
    per package id."""
    live: dict[str, int] = {
        package_id: count
        for package_id, count in db.execute(
            select(ModelVersion.package_id, func.count())
            .where(
                ModelVersion.package_id.in_(package_ids),
                ModelVersion.status != VersionStatus.DELETED,
            )
            .group_by(ModelVersion.package_id)
        )
    }
    latest: dict[str, int] = {
        package_id: newest
        for package_id, newest in db.execute(
            select(ModelVersion.package_id, func.max(ModelVersion.version))
            .where(ModelVersion.package_id.in_(package_ids), references.usable(now))
            .group_by(ModelVersion.package_id)
        )
    }
    return {pid: (live.get(pid, 0), latest.get(pid)) for pid in package_ids}


# --- versions ---------------------------------------------------------------------------------


def list_versions(
    db: OrmSession,
    tenant_id: str,
    name: str,
    *,
    status: VersionStatus | None,
    limit: int,
    offset: int,
) -> tuple[list[ModelVersion], int]:
    """A package's versions, newest first; deleted ones only when asked for by `status`."""
    package = get_package(db, tenant_id, name)
    conditions = [ModelVersion.package_id == package.id]
    if status is None:
        conditions.append(ModelVersion.status != VersionStatus.DELETED)
    else:
        conditions.append(ModelVersion.status == status)
    total = db.scalar(select(func.count()).select_from(ModelVersion).where(*conditions)) or 0
    rows = db.scalars(
        select(ModelVersion)
        .where(*conditions)
        .order_by(ModelVersion.version.desc())
        .limit(limit)
        .offset(offset)
    )
    return list(rows), total


def get_version(
    db: OrmSession, tenant_id: str, name: str, number: int, *, lock: bool = False
) -> ModelVersion:
    """Version `number` of the package (not deleted); `lock` locks the package row first."""
    package = get_package(db, tenant_id, name, lock=lock)
    version = db.scalar(
        select(ModelVersion).where(
            ModelVersion.package_id == package.id,
            ModelVersion.version == number,
            ModelVersion.status != VersionStatus.DELETED,
        )
    )
    if version is None:
        raise _version_not_found(name, number)
    return version


def _version_not_found(name: str, number: int) -> NotFound:
    return NotFound(
        f"version {number} of package {name!r} not found; list its versions with "
        f"`treadle registry versions {name}`"
    )


def _require_usable(version: ModelVersion, clock: Clock, what: str, verb: str) -> None:
    """Refuse a version that is not ready, has no files or has expired."""
    state = version.status if version.status != VersionStatus.READY else None
    if state is None and version.artifact_uri is None:
        state = "without files"
    if state is None and version.expires_at is not None and version.expires_at <= clock.now():
        state = "expired"
    if state is not None:
        raise InvalidInput(f"{what} is {state}; {verb} a ready, unexpired version")


def delete_version(db: OrmSession, tenant_id: str, name: str, number: int) -> ModelVersion:
    """Retire a version (its tinker path is free again); refused while an alias points at it
    or it is still uploading."""
    version = get_version(db, tenant_id, name, number, lock=True)
    checkpoints.require_unaliased(db, version, "delete")
    if version.status == VersionStatus.PENDING:
        raise InvalidInput(
            f"version {number} of {name!r} is still uploading; retry once it is ready or failed"
        )
    checkpoints.retire(version)
    db.flush()
    return version


def set_version_ttl(
    db: OrmSession, clock: Clock, tenant_id: str, name: str, number: int, ttl_seconds: int | None
) -> ModelVersion:
    version = get_version(db, tenant_id, name, number, lock=True)
    # An expired version's files may already be collected: a new TTL must not revive it.
    _require_usable(version, clock, f"version {number} of {name!r}", "set the TTL of")
    checkpoints.set_ttl(version, clock, ttl_seconds)
    db.flush()
    return version


def promote(
    db: OrmSession,
    clock: Clock,
    tenant_id: str,
    name: str,
    number: int,
    *,
    target: str,
    actor_key_id: str | None,
) -> ModelVersion:
    """A new version of package `target` sharing version `number`'s artifact (nothing is
    copied), numbered next in `target` under its row lock.

    The source version's row is locked too (after the target package: packages are always
    locked before versions), so a concurrent deletion of it either waits and then sees the new
    copy sharing the artifact, or commits first and this finds the version gone.
    """
    if target == name:
        raise InvalidInput(f"version {number} is already in {name!r}; name another package")
    destination = get_package(db, tenant_id, target, lock=True)
    source_package = get_package(db, tenant_id, name)
    source = db.scalar(
        select(ModelVersion)
        .where(
            ModelVersion.package_id == source_package.id,
            ModelVersion.version == number,
            ModelVersion.status != VersionStatus.DELETED,
        )
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    if source is None:
        raise _version_not_found(name, number)
    _require_usable(source, clock, f"version {number} of {name!r}", "promote")
    base_model = source.base_model or source_package.base_model
    if base_model != destination.base_model:
        raise InvalidInput(
            f"version {number} of {name!r} is of base model {base_model!r} but package "
            f"{target!r} holds {destination.base_model!r}; promote into a package of the same "
            "base model"
        )
    latest = db.scalar(
        select(func.max(ModelVersion.version)).where(ModelVersion.package_id == destination.id)
    )
    version = checkpoints.copy_version(
        source,
        id="mv_" + uuid.uuid4().hex[:16],
        package_id=destination.id,
        version=(latest or 0) + 1,
        base_model=base_model,
        created_by_key_id=actor_key_id,
        created_at=clock.now(),
    )
    db.add(version)
    destination.updated_at = clock.now()
    db.flush()
    return version


# --- aliases ----------------------------------------------------------------------------------


def list_aliases(db: OrmSession, clock: Clock, tenant_id: str, name: str) -> list[AliasEntry]:
    package = get_package(db, tenant_id, name)
    entries = []
    latest = references.latest_version(db, package.id, clock.now())
    if latest is not None:
        entries.append(AliasEntry(references.LATEST, latest.version, True, None))
    rows = db.execute(
        select(ModelAlias.name, ModelVersion.version, ModelAlias.updated_at)
        .join(ModelVersion, ModelVersion.id == ModelAlias.version_id)
        .where(ModelAlias.package_id == package.id)
        .order_by(ModelAlias.name)
    )
    entries += [AliasEntry(alias, number, False, at) for alias, number, at in rows]
    return entries


def _check_settable(alias: str) -> str:
    references.check_alias_name(alias)
    if alias == references.LATEST:
        raise InvalidInput(
            "alias 'latest' is kept by the registry itself (it always names the newest ready "
            "version) and cannot be set or deleted; name another alias"
        )
    return alias


def set_alias(
    db: OrmSession, clock: Clock, tenant_id: str, name: str, alias: str, number: int, *, actor: str
) -> AliasEntry:
    """Point `alias` at version `number` of the package (a ready one), creating or moving it."""
    _check_settable(alias)
    version = get_version(db, tenant_id, name, number, lock=True)
    _require_usable(version, clock, f"version {number} of {name!r}", "point aliases at")
    row = db.scalar(
        select(ModelAlias).where(
            ModelAlias.package_id == version.package_id, ModelAlias.name == alias
        )
    )
    now = clock.now()
    if row is None:
        row = ModelAlias(
            id="al_" + uuid.uuid4().hex[:16],
            tenant_id=tenant_id,
            package_id=version.package_id,
            name=alias,
            version_id=version.id,
            updated_at=now,
        )
        db.add(row)
        _audit(db, clock, tenant_id, actor, "registry.alias.created", name, alias, None, number)
    elif row.version_id != version.id:
        previous = db.get(ModelVersion, row.version_id)
        row.version_id, row.updated_at = version.id, now
        before = previous.version if previous is not None else None
        _audit(db, clock, tenant_id, actor, "registry.alias.moved", name, alias, before, number)
    db.flush()
    return AliasEntry(alias, number, False, row.updated_at)


def delete_alias(
    db: OrmSession, clock: Clock, tenant_id: str, name: str, alias: str, *, actor: str
) -> None:
    _check_settable(alias)
    package = get_package(db, tenant_id, name, lock=True)
    row = db.scalar(
        select(ModelAlias).where(ModelAlias.package_id == package.id, ModelAlias.name == alias)
    )
    if row is None:
        raise NotFound(
            f"alias {alias!r} of package {name!r} not found; list them with "
            f"`treadle registry versions {name}`"
        )
    previous = db.get(ModelVersion, row.version_id)
    before = previous.version if previous is not None else None
    db.delete(row)
    _audit(db, clock, tenant_id, actor, "registry.alias.deleted", name, alias, before, None)
    db.flush()


def _audit(
    db: OrmSession,
    clock: Clock,
    tenant_id: str,
    actor: str,
    action: str,
    package: str,
    alias: str,
    before: int | None,
    after: int | None,
) -> None:
    audit.record(
        db,
        clock,
        tenant_id=tenant_id,
        actor=actor,
        action=action,
        target=f"{package}@{alias}",
        detail={"package": package, "alias": alias, "from_version": before, "to_version": after},
    )


# --- what views show --------------------------------------------------------------------------


def version_refs(db: OrmSession, tenant_id: str, version_ids: set[str]) -> dict[str, str]:
    """How to name each version id (parent and source versions) to `tenant_id`: its own as
    `<package>:<number>`; another tenant's (a run loaded from a published checkpoint) by its
    tinker path while it is published and has one, else not at all: another tenant's package
    names are never shown."""
    if not version_ids:
        return {}
    ids = sorted(version_ids)
    own = db.execute(
        select(ModelVersion.id, ModelPackage.name, ModelVersion.version)
        .join(ModelPackage, ModelPackage.id == ModelVersion.package_id)
        .where(ModelVersion.id.in_(ids), ModelVersion.tenant_id == tenant_id)
    )
    refs = {version_id: f"{name}:{number}" for version_id, name, number in own}
    published = db.execute(
        select(ModelVersion.id, ModelVersion.tinker_path).where(
            ModelVersion.id.in_(ids),
            ModelVersion.tenant_id != tenant_id,
            ModelVersion.public.is_(True),
            ModelVersion.status == VersionStatus.READY,
            ModelVersion.tinker_path.is_not(None),
        )
    )
    refs.update({version_id: path for version_id, path in published if path is not None})
    return refs


def aliases_by_version(db: OrmSession, clock: Clock, package_id: str) -> dict[str, list[str]]:
    """The package's aliases per version id, `latest` first where it points."""
    found: dict[str, list[str]] = {}
    latest = references.latest_version(db, package_id, clock.now())
    if latest is not None:
        found[latest.id] = [references.LATEST]
    for name, version_id in db.execute(
        select(ModelAlias.name, ModelAlias.version_id)
        .where(ModelAlias.package_id == package_id)
        .order_by(ModelAlias.name)
    ):
        found.setdefault(version_id, []).append(name)
    return found
