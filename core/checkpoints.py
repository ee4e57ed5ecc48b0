"""Checkpoints: saved weights registered as immutable model versions.

Each training run has a model package (named after the run); every save adds a version to it,
with numbers allocated under the package's row lock. A checkpoint's public name is its tinker
path, `tinker://<run>/<weights|sampler_weights|external_weights>/<name>`. A save's version is
`pending` while its artifact uploads (`begin_upload`) and gets its path when it becomes `ready`
(`register`), or turns `failed`. Deleting marks the version deleted and frees its path; the
caller removes the artifact unless another version still uses it, and `scheduler.artifact_gc`
removes those of overwritten, failed and expired versions (`collectable`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, SQLColumnExpression, and_, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.orm import aliased, object_session

from core import references
from core.clock import Clock
from core.errors import ConfigurationError, InvalidInput, NotFound
from core.tables import (
    ModelAlias,
    ModelPackage,
    ModelVersion,
    Session,
    SessionStatus,
    TrainingRun,
    VersionStatus,
)
from treadle.types.checkpoints import checkpoint_name_problem

# A tinker path's segment names the kind of save that made it; `external` (what the tinker
# protocol calls every export) stands for both export kinds, which share one segment.
KIND_BY_SEGMENT = {
    "weights": "training",
    "sampler_weights": "sampler",
    "external_weights": "external",
}
# An export is a PEFT adapter folder (`adapter`) or a merged Hugging Face model (`merged`).
EXPORT_KINDS = ("adapter", "merged")
SEGMENT_BY_KIND = {kind: segment for segment, kind in KIND_BY_SEGMENT.items()} | {
    kind: "external_weights" for kind in EXPORT_KINDS
}
MIN_TTL_SECONDS = 3600
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600


def tinker_path(run_id: str, kind: str, name: str) -> str:
    return f"tinker://{run_id}/{SEGMENT_BY_KIND[kind]}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """(run id, kind, name) of a tinker path; InvalidInput says what a valid one looks like."""
    if not path.startswith("tinker://"):
        raise InvalidInput(f"checkpoint path {path!r} must start with tinker://")
    parts = path.removeprefix("tinker://").split("/")
    if len(parts) != 3 or not all(parts) or parts[1] not in KIND_BY_SEGMENT:
        raise InvalidInput(
            f"checkpoint path {path!r} is malformed; expected tinker://<run id>/"
            "<weights|sampler_weights|external_weights>/<name>"
        )
    return parts[0], KIND_BY_SEGMENT[parts[1]], parts[2]


def check_name(name: str) -> str:
    """`name` if it is a valid checkpoint name (see `treadle.types.CheckpointName`)."""
    problem = checkpoint_name_problem(name)
    if problem is not None:
        raise InvalidInput(problem)
    return name


def check_ttl(ttl_seconds: int | None) -> int | None:
    if ttl_seconds is not None and not MIN_TTL_SECONDS <= ttl_seconds <= MAX_TTL_SECONDS:
        raise InvalidInput(
            f"ttl_seconds {ttl_seconds} is outside {MIN_TTL_SECONDS}..{MAX_TTL_SECONDS} (1 hour to 10 years); "
            "pass a value in range, or none to keep the checkpoint until deleted"
        )
    return ttl_seconds


def _package_for_run(db: OrmSession, clock: Clock, run: TrainingRun) -> ModelPackage:
    """The run's live package, locked; made on its first save.

    Two first saves (or a save and `registry.create_package(training_run_id=…)`) may race: the
    partial unique index on a live package's `training_run_id` (or on its name) refuses the
    second insert, which then takes the package the first one made.
    """
    query = (
        select(ModelPackage)
        .where(ModelPackage.training_run_id == run.id, ModelPackage.deleted_at.is_(None))
        .with_for_update()
    )
    for _ in range(3):
        package = db.scalar(query)
        if package is not None:
            return package
        package = ModelPackage(
            id="pkg_" + uuid.uuid4().hex[:16],
            tenant_id=run.tenant_id,
            name=_free_package_name(db, run.tenant_id, run.id),
            base_model=run.base_model,
            training_run_id=run.id,
            created_at=clock.now(),
            updated_at=clock.now(),
        )
        try:
            with db.begin_nested():
                db.add(package)
        except IntegrityError:
            continue  # taken meanwhile (the run's package, or the name): read again
        return db.scalar(query) or package
    raise ConfigurationError(
        f"could not create the package of training run {run.id}: other requests kept taking "
        "its name; save again"
    )


def _free_package_name(db: OrmSession, tenant_id: str, wanted: str) -> str:
    """`wanted`, or `<wanted>-2`, `-3`, ... when a live package of the tenant holds the name
    (one the tenant created or renamed to it)."""
    taken = set(
        db.scalars(
            select(ModelPackage.name).where(
                ModelPackage.tenant_id == tenant_id,
                ModelPackage.deleted_at.is_(None),
                or_(
                    ModelPackage.name == wanted,
                    ModelPackage.name.startswith(wanted + "-", autoescape=True),
                ),
            )
        )
    )
    name, n = wanted, 1
    while name in taken:
        n += 1
        name = f"{wanted}-{n}"
    return name


def find_by_path(db: OrmSession, path: str) -> ModelVersion | None:
    return db.scalar(
        select(ModelVersion).where(
            ModelVersion.tinker_path == path, ModelVersion.status != VersionStatus.DELETED
        )
    )


@dataclass(frozen=True)
class Lineage:
    """Where a save came from beyond its run (whose steps, tokens and loaded-from version
    `register` reads itself): the save op, who sent it, the base model's revision and the
    artifact's files as `[{"path", "size_bytes", "sha256"}]`."""

    session_id: str | None = None
    seq_id: int | None = None
    created_by_key_id: str | None = None
    base_revision: str | None = None
    files: list[dict[str, Any]] | None = None


def register(
    db: OrmSession,
    clock: Clock,
    *,
    run: TrainingRun,
    kind: str,
    name: str | None,
    artifact_uri: str,
    size_bytes: int,
    sha256: str,
    ttl_seconds: int | None = None,
    user_metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    lineage: Lineage | None = None,
    pending: str | None = None,
) -> ModelVersion:
    """Add a ready version for `run`. A nameless one (sampler snapshots) has no tinker path.

    `pending` is the id `begin_upload` gave before the artifact was uploaded: that version
    becomes this one (ready) instead of a new one being added.
    """
    lineage = lineage or Lineage()
    held = _pending_upload(db, pending, artifact_uri) if pending is not None else None
    path = tinker_path(run.id, kind, check_name(name)) if name is not None else None
    if path is not None:
        existing = find_by_path(db, path)
        if existing is not None:
            if not overwrite:
                raise InvalidInput(
                    f"checkpoint {path} already exists; pick another name or pass overwrite=True"
                )
            require_unaliased(db, existing, "overwrite")
            existing.status, existing.tinker_path = VersionStatus.DELETED, None
            db.flush()
    package = _package_for_run(db, clock, run)
    latest = (
        held.version
        if held is not None
        else db.scalar(
            select(func.max(ModelVersion.version)).where(ModelVersion.package_id == package.id)
        )
    )
    now = clock.now()
    version = ModelVersion(
        id=held.id if held is not None else "mv_" + uuid.uuid4().hex[:16],
        tenant_id=run.tenant_id,
        package_id=package.id,
        version=latest if held is not None else (latest or 0) + 1,
        kind=kind,
        tinker_path=path,
        training_run_id=run.id,
        session_id=lineage.session_id,
        seq_id=lineage.seq_id,
        step=run.optim_steps,
        tokens_trained=run.tokens_trained,
        parent_version_id=run.loaded_from_version_id,
        base_model=run.base_model,
        base_revision=lineage.base_revision,
        created_by_key_id=lineage.created_by_key_id,
        files=lineage.files,
        lora_config=run.lora_config,
        user_metadata=user_metadata,
        artifact_uri=artifact_uri,
        size_bytes=size_bytes,
        sha256=sha256,
        status=VersionStatus.READY,
        expires_at=now + timedelta(seconds=ttl_seconds) if ttl_seconds else None,
        created_at=now,
    )
    if held is not None:
        version = db.merge(version)
    else:
        db.add(version)
    db.flush()
    return version


def begin_upload(
    db: OrmSession,
    clock: Clock,
    *,
    run: TrainingRun,
    kind: str,
    name: str | None,
    artifact_uri: str,
    overwrite: bool = False,
) -> ModelVersion:
    """A pending version for a save about to upload its artifact to `artifact_uri`.

    Committed before the upload starts, so an upload that dies half-way leaves a trace the
    artifact collector finds (failed, or pending past the grace period) instead of unnamed
    objects. It has no tinker path and no alias points at it until `register(pending=…)` makes
    it ready. A save run again (a redelivered op writes the same URI) gets the same version.
    A name already taken, or one an alias points at when overwriting, is refused here, before
    anything is uploaded.
    """
    if name is not None:
        path = tinker_path(run.id, kind, check_name(name))
        existing = find_by_path(db, path)
        if existing is not None and not overwrite:
            raise InvalidInput(
                f"checkpoint {path} already exists; pick another name or pass overwrite=True"
            )
        if existing is not None:
            require_unaliased(db, existing, "overwrite")
    again = db.scalar(
        select(ModelVersion).where(
            ModelVersion.artifact_uri == artifact_uri, ModelVersion.status == VersionStatus.PENDING
        )
    )
    if again is not None:
        return again
    package = _package_for_run(db, clock, run)
    latest = db.scalar(
        select(func.max(ModelVersion.version)).where(ModelVersion.package_id == package.id)
    )
    version = ModelVersion(
        id="mv_" + uuid.uuid4().hex[:16],
        tenant_id=run.tenant_id,
        package_id=package.id,
        version=(latest or 0) + 1,
        kind=kind,
        training_run_id=run.id,
        base_model=run.base_model,
        artifact_uri=artifact_uri,
        status=VersionStatus.PENDING,
        created_at=clock.now(),
    )
    db.add(version)
    db.flush()
    return version


def fail_upload(db: OrmSession, version_id: str) -> None:
    """The pending version's upload failed: it never becomes ready; its objects are collected."""
    version = db.get(ModelVersion, version_id)
    if version is not None and version.status == VersionStatus.PENDING:
        version.status = VersionStatus.FAILED


def fail_stale_uploads(db: OrmSession, clock: Clock, grace: timedelta) -> int:
    """Mark failed the versions pending for longer than `grace` (their uploader died)."""
    stale = db.scalars(
        select(ModelVersion)
        .where(
            ModelVersion.status == VersionStatus.PENDING,
            ModelVersion.created_at < clock.now() - grace,
        )
        .with_for_update(skip_locked=True)
    ).all()
    for version in stale:
        version.status = VersionStatus.FAILED
    return len(stale)


def _pending_upload(db: OrmSession, version_id: str, artifact_uri: str) -> ModelVersion:
    held = db.get(ModelVersion, version_id, with_for_update=True, populate_existing=True)
    if held is None or held.status == VersionStatus.DELETED:
        raise NotFound(
            f"the version the save to {artifact_uri} was uploading into was deleted meanwhile; "
            "save again"
        )
    if held.status != VersionStatus.PENDING or held.artifact_uri != artifact_uri:
        raise ConfigurationError(
            f"the upload of {artifact_uri} took longer than the artifact store's grace period "
            "and was given up; raise TREADLE_ARTIFACT_PENDING_GRACE_SECONDS, then save again"
        )
    return held


def _expired(version: ModelVersion, now: datetime) -> bool:
    return version.expires_at is not None and version.expires_at <= now


def resolve(db: OrmSession, clock: Clock, tenant_id: str, path: str) -> ModelVersion:
    """The live checkpoint at `path` that `tenant_id` may read: its own, or a published one.

    `path` is a tinker path or a registry reference (`package@alias`, `package:version`, see
    `core.references`); a reference names only the tenant's own packages.
    """
    if references.is_reference(path):
        named = references.lookup(db, tenant_id, path, clock.now())
        if (
            named.status != VersionStatus.READY
            or named.artifact_uri is None
            or _expired(named, clock.now())
        ):
            raise NotFound(
                f"{path} names version {named.version}, which is {_unusable(named, clock)}; "
                "point the reference at a ready version"
            )
        return named
    parse_tinker_path(path)
    version = find_by_path(db, path)
    if (
        version is None
        or (version.tenant_id != tenant_id and not version.public)
        or _expired(version, clock.now())
    ):
        raise _not_found(path)
    return version


def _unusable(version: ModelVersion, clock: Clock) -> str:
    if version.status == VersionStatus.READY and _expired(version, clock.now()):
        return "expired"
    if version.status == VersionStatus.READY:
        return "without files"
    return {VersionStatus.PENDING: "still uploading", VersionStatus.FAILED: "a failed save"}.get(
        VersionStatus(version.status), "deleted"
    )


def _not_found(path: str) -> NotFound:
    return NotFound(
        f"checkpoint {path} not found; list yours with RestClient.list_user_checkpoints()"
    )


def owned(
    db: OrmSession, clock: Clock, tenant_id: str, run_id: str, checkpoint_id: str
) -> ModelVersion:
    """A checkpoint of the tenant's own run, addressed as in REST paths (`weights/<name>`)."""
    path = f"tinker://{run_id}/{checkpoint_id}"
    version = resolve(db, clock, tenant_id, path)
    if version.tenant_id != tenant_id:
        # Another tenant's published checkpoint answers exactly like a missing one here.
        raise _not_found(path)
    return version


def list_checkpoints(
    db: OrmSession, clock: Clock, tenant_id: str, *, run_id: str | None, limit: int, offset: int
) -> tuple[list[ModelVersion], int]:
    now = clock.now()
    conditions = [
        ModelVersion.tenant_id == tenant_id,
        ModelVersion.status == VersionStatus.READY,
        ModelVersion.tinker_path.is_not(None),
        or_(ModelVersion.expires_at.is_(None), ModelVersion.expires_at > now),
    ]
    if run_id is not None:
        conditions.append(ModelVersion.training_run_id == run_id)
    total = db.scalar(select(func.count()).select_from(ModelVersion).where(*conditions)) or 0
    rows = db.scalars(
        select(ModelVersion)
        .where(*conditions)
        .order_by(ModelVersion.created_at.desc(), ModelVersion.id)
        .limit(limit)
        .offset(offset)
    )
    return list(rows), total


def latest_of_kind(db: OrmSession, run_id: str, kind: str) -> ModelVersion | None:
    return db.scalar(
        select(ModelVersion)
        .where(
            ModelVersion.training_run_id == run_id,
            ModelVersion.kind == kind,
            ModelVersion.status == VersionStatus.READY,
            ModelVersion.tinker_path.is_not(None),
        )
        .order_by(ModelVersion.version.desc())
        .limit(1)
    )


def require_unaliased(db: OrmSession, version: ModelVersion, verb: str) -> None:
    """Refuse to retire a version an alias points at: an alias never names a deleted version.

    Locks the version's package row (as `registry.set_alias` does before it points an alias),
    then the version's row (as `registry.promote` does before it shares its artifact), and
    keeps both locks until the caller commits: an alias set or a promotion at the same moment
    waits for the retirement and then finds the version deleted, or the retirement waits and
    then sees the alias or the promoted copy. Packages are always locked before versions.
    """
    db.scalar(
        select(ModelPackage.id).where(ModelPackage.id == version.package_id).with_for_update()
    )
    locked = db.scalar(
        select(ModelVersion)
        .where(ModelVersion.id == version.id, ModelVersion.status != VersionStatus.DELETED)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    if locked is None:
        raise NotFound(
            f"cannot {verb} {version.tinker_path or 'this version'}: it was deleted meanwhile"
        )
    names = list(
        db.scalars(
            select(ModelAlias.name)
            .where(ModelAlias.version_id == version.id)
            .order_by(ModelAlias.name)
        )
    )
    if names:
        package = db.get(ModelPackage, version.package_id)
        label = package.name if package is not None else version.package_id
        raise InvalidInput(
            f"cannot {verb} {version.tinker_path or f'{label}:{version.version}'}: "
            f"{', '.join(f'{label}@{name}' for name in names)} points at it; move or delete "
            "those aliases first (treadle registry alias / unalias)"
        )


def mark_deleted(version: ModelVersion) -> str | None:
    """Retire a version; returns its artifact URI for the caller to remove (and clears it), or
    None when something else still needs the artifact: another version (a promoted copy) or a
    run that would replay a load of it (`_needed`). The version then keeps its URI, and the
    periodic artifact job removes the files once the last user is gone.

    Call `require_unaliased` first: its locks make the sharing check see a promotion committed
    meanwhile.
    """
    uri = version.artifact_uri
    version.status, version.tinker_path = VersionStatus.DELETED, None
    db = object_session(version)
    if uri is not None and db is not None:
        db.flush()
        if db.scalar(select(_needed(uri, version.id, None))):
            return None
    version.artifact_uri = None
    return uri


def _needed(
    uri: SQLColumnExpression[str | None] | str,
    version_id: SQLColumnExpression[str] | str,
    now: datetime | None,
) -> ColumnElement[bool]:
    """Whether a version other than `version_id` or a run still needs the artifact at `uri`.

    A version does while it is ready (with `now`: and unexpired) or uploading. A run does while
    its session is active and it was loaded from a version on that artifact: recovery replays
    the load (at seq 0 for a run created from a checkpoint, later for a load_state) by opening
    the loaded version's artifact. The run's snapshots cannot tell whether they were taken after
    the load (the load's seq id is not kept), so the run counts as a user until its session
    ends, and the artifact then goes with the next pass of the artifact job.
    """
    other = aliased(ModelVersion)
    ready: ColumnElement[bool] = other.status.in_((VersionStatus.READY, VersionStatus.PENDING))
    if now is not None:
        ready = and_(ready, or_(other.expires_at.is_(None), other.expires_at > now))
    by_version = (
        select(other.id).where(other.artifact_uri == uri, other.id != version_id, ready).exists()
    )
    loaded = aliased(ModelVersion)
    by_run = (
        select(TrainingRun.id)
        .join(loaded, loaded.id == TrainingRun.loaded_from_version_id)
        .join(Session, Session.id == TrainingRun.session_id)
        .where(loaded.artifact_uri == uri, Session.status == SessionStatus.ACTIVE)
        .exists()
    )
    return or_(by_version, by_run)


def _gone(now: datetime) -> ColumnElement[bool]:
    return or_(
        ModelVersion.status.in_((VersionStatus.DELETED, VersionStatus.FAILED)),
        ModelVersion.expires_at <= now,
    )


def collectable(db: OrmSession, clock: Clock, limit: int) -> list[ModelVersion]:
    """Up to `limit` versions whose artifact may be removed: deleted (overwritten), failed or
    expired, with no other ready, unexpired or pending version on the same artifact and no run
    that would replay a load of it (`_needed`)."""
    now = clock.now()
    needed = _needed(ModelVersion.artifact_uri, ModelVersion.id, now)
    return list(
        db.scalars(
            select(ModelVersion)
            .where(ModelVersion.artifact_uri.is_not(None), _gone(now), ~needed)
            .order_by(ModelVersion.created_at)
            .limit(limit)
            .with_for_update(of=ModelVersion, skip_locked=True)
        )
    )


def forget_artifact(db: OrmSession, clock: Clock, uri: str) -> int:
    """The artifact at `uri` was removed: no deleted, failed or expired version names it any
    more (every one of them, not only the one `collectable` picked). Returns how many did."""
    rows = db.scalars(
        select(ModelVersion).where(ModelVersion.artifact_uri == uri, _gone(clock.now()))
    ).all()
    for version in rows:
        version.artifact_uri = None
    return len(rows)


def set_public(version: ModelVersion, public: bool) -> None:
    """Published checkpoints can be read (sampled, loaded) by every tenant."""
    version.public = public


def require_sampleable(
    version: ModelVersion | None, tenant_id: str, clock: Clock, model_path: str | None
) -> ModelVersion:
    """The weights a sampling session of `tenant_id` samples, if it may still read them.

    Checked on every sample request, not only when the session is created: since then the
    owner may have deleted or overwritten the checkpoint, or it may have expired (nobody samples
    it any more), or the owner unpublished it (other tenants' sessions stop; the owner's own keep
    sampling). `model_path` is the path the session was created from, for the message.
    """
    what = f"checkpoint {model_path}" if model_path else "the weights of this sampling session"
    if (
        version is not None
        and version.status == VersionStatus.READY
        and _expired(version, clock.now())
    ):
        # Checked first: the artifact collector clears an expired version's artifact.
        raise NotFound(f"{what} has expired; create a new sampling client from a live checkpoint")
    if version is None or version.status != VersionStatus.READY or version.artifact_uri is None:
        raise NotFound(
            f"{what} was deleted or overwritten; create a new sampling client from a live "
            "checkpoint"
        )
    if _expired(version, clock.now()):
        raise NotFound(f"{what} has expired; create a new sampling client from a live checkpoint")
    if version.tenant_id != tenant_id and not version.public:
        raise NotFound(
            f"{what} is no longer published; ask its owner to publish it again, or sample from "
            "another checkpoint"
        )
    return version


def sampleable_by(tenant_id: SQLColumnExpression[str], now: datetime) -> ColumnElement[bool]:
    """`require_sampleable` as a condition on ModelVersion, for the tenant in `tenant_id`."""
    return and_(
        ModelVersion.status == VersionStatus.READY,
        ModelVersion.artifact_uri.is_not(None),
        or_(ModelVersion.expires_at.is_(None), ModelVersion.expires_at > now),
        or_(ModelVersion.tenant_id == tenant_id, ModelVersion.public.is_(True)),
    )


def set_ttl(version: ModelVersion, clock: Clock, ttl_seconds: int | None) -> None:
    check_ttl(ttl_seconds)
    version.expires_at = clock.now() + timedelta(seconds=ttl_seconds) if ttl_seconds else None


def live(version: ModelVersion, clock: Clock) -> bool:
    """Ready, named and not expired: what listings show and paths resolve to."""
    return (
        version.status == VersionStatus.READY
        and version.tinker_path is not None
        and not _expired(version, clock.now())
    )


def downloadable(version: ModelVersion, clock: Clock) -> bool:
    """Ready, with files, not expired: what a signed download link may still fetch (a version
    named only by a registry reference has no tinker path but downloads all the same)."""
    return (
        version.status == VersionStatus.READY
        and version.artifact_uri is not None
        and not _expired(version, clock.now())
    )


def has_public(db: OrmSession, clock: Clock, run_id: str) -> bool:
    """Whether any live checkpoint of `run_id` is published (its run is then readable by all)."""
    now = clock.now()
    found = db.scalar(
        select(ModelVersion.id)
        .where(
            ModelVersion.training_run_id == run_id,
            ModelVersion.public.is_(True),
            ModelVersion.status == VersionStatus.READY,
            ModelVersion.tinker_path.is_not(None),
            or_(ModelVersion.expires_at.is_(None), ModelVersion.expires_at > now),
        )
        .limit(1)
    )
    return found is not None


def retire(version: ModelVersion) -> None:
    """Delete a version for the registry: its tinker path is free at once, and it keeps its
    artifact URI, which a promoted version may share; the periodic artifact job removes the
    files no live version uses."""
    version.status, version.tinker_path = VersionStatus.DELETED, None


def copy_version(source: ModelVersion, **changes: Any) -> ModelVersion:
    """A ready version with `source`'s artifact and lineage, for promotion into another package
    (`changes` gives at least id, package_id, version and created_at): no tinker path, not
    published, no expiry, and `source_version_id` naming the origin."""
    shared = {
        column: getattr(source, column)
        for column in (
            "tenant_id",
            "kind",
            "training_run_id",
            "session_id",
            "seq_id",
            "step",
            "tokens_trained",
            "parent_version_id",
            "base_model",
            "base_revision",
            "lora_config",
            "user_metadata",
            "created_by_key_id",
            "artifact_uri",
            "files",
            "size_bytes",
            "sha256",
        )
    }
    return ModelVersion(
        **(shared | changes),
        tinker_path=None,
        source_version_id=source.id,
        public=False,
        expires_at=None,
        status=VersionStatus.READY,
    )
