"""ORM tables of the control plane (DESIGN §4). Billing's tables live in `billing.tables`.

Conventions: string primary keys chosen by the application, timezone-aware UTC timestamps,
money in integer micro-units, JSON for free-form metadata. Every tenant-owned row carries
`tenant_id` so each query made for a tenant can be scoped by it.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """Stores aware datetimes as UTC and always returns them aware (SQLite drops the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime given to a UTC column; use an aware datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {  # noqa: RUF012
        datetime: UTCDateTime,
        dict[str, Any]: JSON,
        list[str]: JSON,
        list[dict[str, Any]]: JSON,
    }


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    max_concurrent_sessions: Mapped[int] = mapped_column(Integer)
    max_lora_rank: Mapped[int] = mapped_column(Integer)
    # Spend limits per billing period (a calendar month, UTC) and per session; NULL: none.
    spend_limit_micros: Mapped[int | None] = mapped_column(BigInteger)
    session_spend_limit_micros: Mapped[int | None] = mapped_column(BigInteger)
    # Resource limits; NULL means the server's default (core.tenants.DEFAULT_LIMITS).
    max_training_runs: Mapped[int | None] = mapped_column(Integer)
    max_lora_parameters: Mapped[int | None] = mapped_column(BigInteger)
    max_queued_ops: Mapped[int | None] = mapped_column(Integer)
    max_sampling_requests: Mapped[int | None] = mapped_column(Integer)
    stripe_customer_id: Mapped[str | None] = mapped_column(String(100))
    disabled: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime]


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # the public key id
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    name: Mapped[str] = mapped_column(String(200))
    scope: Mapped[str] = mapped_column(String(16))  # "tenant" | "admin"
    secret_hash: Mapped[str] = mapped_column(String(64))  # HMAC-SHA256 hex of the secret part
    created_at: Mapped[datetime]
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class SessionStatus(enum.StrEnum):
    """`sessions.status`; changed only by `core.sessions`."""

    ACTIVE = "active"
    FINISHED = "finished"
    EXPIRED = "expired"


class SessionKind(enum.StrEnum):
    """`sessions.kind`: a client's own session, or one the OpenAI-compatible API opened for an
    API key (which does not count against the concurrent-session quota)."""

    CLIENT = "client"
    SERVING = "serving"


class Session(Base):
    __tablename__ = "sessions"
    __table_args__ = (Index("ix_sessions_tenant_status", "tenant_id", "status"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    status: Mapped[str] = mapped_column(String(16))  # a SessionStatus
    kind: Mapped[str] = mapped_column(String(16), server_default=SessionKind.CLIENT.value)
    tags: Mapped[list[str]] = mapped_column(default=list)
    user_metadata: Mapped[dict[str, Any] | None]
    sdk_version: Mapped[str | None] = mapped_column(String(64))
    project_id: Mapped[str | None] = mapped_column(String(200))
    display_name: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime]
    last_heartbeat_at: Mapped[datetime]
    ended_at: Mapped[datetime | None]
    end_reason: Mapped[str | None] = mapped_column(String(32))
    end_detail: Mapped[str | None] = mapped_column(Text)


class RunStatus(enum.StrEnum):
    """`training_runs.status`; changed only by `core.runs`."""

    PENDING = "pending"  # created; its create_model or load has not finished
    ACTIVE = "active"
    UNLOADED = "unloaded"
    FAILED = "failed"


class TrainingRun(Base):
    """A LoRA training run (Tinker's "model"); id is `{session_id}:train:{model_seq_id}`."""

    __tablename__ = "training_runs"
    __table_args__ = (
        UniqueConstraint("session_id", "model_seq_id"),
        # The tenant's live runs, counted whenever it creates one.
        Index("ix_training_runs_tenant_status", "tenant_id", "status"),
    )

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    model_seq_id: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(200))
    lora_rank: Mapped[int] = mapped_column(Integer)
    lora_config: Mapped[dict[str, Any]]
    user_metadata: Mapped[dict[str, Any] | None]
    status: Mapped[str] = mapped_column(String(16))  # a RunStatus
    corrupted: Mapped[bool] = mapped_column(Boolean, default=False)
    worker_id: Mapped[str | None] = mapped_column(ForeignKey("workers.id"))
    # Highest seq_id executed, and the last snapshot replay can start from.
    executed_seq_id: Mapped[int] = mapped_column(BigInteger, default=0)
    snapshot_seq_id: Mapped[int | None] = mapped_column(BigInteger)
    snapshot_uri: Mapped[str | None] = mapped_column(Text)
    optim_steps: Mapped[int] = mapped_column(Integer, default=0)
    # Tokens of forward_backward ops executed so far, and the version the run was loaded from.
    tokens_trained: Mapped[int] = mapped_column(BigInteger, default=0)
    loaded_from_version_id: Mapped[str | None] = mapped_column(
        ForeignKey("model_versions.id", use_alter=True)
    )
    created_at: Mapped[datetime]
    last_request_at: Mapped[datetime]


class SamplingSession(Base):
    __tablename__ = "sampling_sessions"
    __table_args__ = (UniqueConstraint("session_id", "sampling_session_seq_id"),)

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    sampling_session_seq_id: Mapped[int] = mapped_column(BigInteger)
    base_model: Mapped[str] = mapped_column(String(200))
    model_path: Mapped[str | None] = mapped_column(Text)
    training_run_id: Mapped[str | None] = mapped_column(ForeignKey("training_runs.id"))
    # The saved weights it samples from; None samples the base model.
    model_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    worker_id: Mapped[str | None] = mapped_column(ForeignKey("workers.id"))
    created_at: Mapped[datetime]


class OpStatus(enum.StrEnum):
    """`operations.status`; changed only by `scheduler.oplog`."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Operation(Base):
    """The op log and the futures table in one (DESIGN §4, §5)."""

    __tablename__ = "operations"
    __table_args__ = (
        UniqueConstraint("target_id", "seq_id"),
        Index("ix_operations_status_target", "status", "target_id"),
        # The tenant's queued and running ops, counted on every submission.
        Index("ix_operations_tenant_status", "tenant_id", "status"),
        # Retention's candidates: finished ops whose payload is still stored, oldest first.
        Index(
            "ix_operations_unpruned_finished_at",
            "finished_at",
            sqlite_where=text("payload_pruned_at IS NULL"),
            postgresql_where=text("payload_pruned_at IS NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the request_id
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"), index=True)
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))  # who submitted
    target_id: Mapped[str] = mapped_column(String(128))  # training run or sampling session
    seq_id: Mapped[int | None] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # an OpStatus
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    payload_codec: Mapped[str] = mapped_column(String(16))  # e.g. "json+zstd"
    # Set when retention emptied `payload` (a finished op older than its run's snapshot).
    payload_pruned_at: Mapped[datetime | None]
    result: Mapped[bytes | None] = mapped_column(LargeBinary)
    result_codec: Mapped[str | None] = mapped_column(String(32))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_category: Mapped[str | None] = mapped_column(String(16))  # user | server
    error_code: Mapped[str | None] = mapped_column(String(32))  # an ErrorCode; NULL before 0003
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # The cost estimate held against the spend limits while the op is queued or running.
    reserved_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    worker_id: Mapped[str | None] = mapped_column(ForeignKey("workers.id"))
    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class ModelPackage(Base):
    """A named family of model versions.

    A training run's saves register in the package whose `training_run_id` is the run (made on
    its first save, named after the run unless the tenant created or renamed it); any other
    package holds versions promoted into it. Names are unique among a tenant's live packages;
    a deleted package keeps its row (versions point at it) and frees its name.
    """

    __tablename__ = "model_packages"
    __table_args__ = (
        Index(
            "uq_model_packages_tenant_name_live",
            "tenant_id",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
        # A run saves into one live package.
        Index(
            "uq_model_packages_training_run_live",
            "training_run_id",
            unique=True,
            sqlite_where=text("deleted_at IS NULL AND training_run_id IS NOT NULL"),
            postgresql_where=text("deleted_at IS NULL AND training_run_id IS NOT NULL"),
        ),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(200))
    description: Mapped[str | None] = mapped_column(Text)
    tags: Mapped[list[str]] = mapped_column(default=list)
    base_model: Mapped[str] = mapped_column(String(200))
    training_run_id: Mapped[str | None] = mapped_column(ForeignKey("training_runs.id"))
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]


class VersionStatus(enum.StrEnum):
    """`model_versions.status`; changed only by `core.checkpoints`."""

    PENDING = "pending"
    READY = "ready"
    FAILED = "failed"
    DELETED = "deleted"


class ModelVersion(Base):
    """An immutable saved artifact: a checkpoint, sampler weights or an export."""

    __tablename__ = "model_versions"
    __table_args__ = (UniqueConstraint("package_id", "version"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    package_id: Mapped[str] = mapped_column(ForeignKey("model_packages.id"))
    version: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # training | sampler | adapter | merged
    tinker_path: Mapped[str | None] = mapped_column(String(512), unique=True)
    training_run_id: Mapped[str | None] = mapped_column(ForeignKey("training_runs.id"))
    # Lineage: the save's session and place in the run's order, the run's optimizer steps and
    # trained tokens at that point, and the version the run was loaded from (its parent).
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id"))
    seq_id: Mapped[int | None] = mapped_column(BigInteger)
    step: Mapped[int | None] = mapped_column(Integer)
    tokens_trained: Mapped[int | None] = mapped_column(BigInteger)
    parent_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    # A promoted version shares the artifact of the version it was promoted from.
    source_version_id: Mapped[str | None] = mapped_column(ForeignKey("model_versions.id"))
    base_model: Mapped[str | None] = mapped_column(String(200))
    base_revision: Mapped[str | None] = mapped_column(String(100))
    lora_config: Mapped[dict[str, Any] | None]
    user_metadata: Mapped[dict[str, Any] | None]
    created_by_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id"))
    artifact_uri: Mapped[str | None] = mapped_column(Text)
    # Every file of the artifact: [{"path", "size_bytes", "sha256"}], sorted by path.
    files: Mapped[list[dict[str, Any]] | None]
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    sha256: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))  # a VersionStatus
    public: Mapped[bool] = mapped_column(Boolean, default=False)
    expires_at: Mapped[datetime | None]
    created_at: Mapped[datetime]


class ModelAlias(Base):
    """A movable name for one version of a package (`latest`, `production`, any name)."""

    __tablename__ = "model_aliases"
    __table_args__ = (UniqueConstraint("package_id", "name"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    package_id: Mapped[str] = mapped_column(ForeignKey("model_packages.id"))
    name: Mapped[str] = mapped_column(String(100))
    version_id: Mapped[str] = mapped_column(ForeignKey("model_versions.id"))
    updated_at: Mapped[datetime]


class WorkerStatus(enum.StrEnum):
    """`workers.status`; changed only by `scheduler.workers`."""

    LIVE = "live"
    # Asked to drain: it takes no new placements, and hands its runs over as it stops.
    DRAINING = "draining"
    # Stopped on purpose, its runs handed over; registering again makes it live.
    LEFT = "left"
    DEAD = "dead"


class Worker(Base):
    """A GPU worker process; its lease is its liveness."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    hostname: Mapped[str] = mapped_column(String(200))
    device: Mapped[str] = mapped_column(String(32))
    models: Mapped[list[dict[str, Any]]] = mapped_column(default=list)
    status: Mapped[str] = mapped_column(String(16))  # a WorkerStatus
    # What the engine holds, reported with each lease renewal.
    held_runs: Mapped[int] = mapped_column(Integer, default=0)
    adapter_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # Ranks (devices) of a worker group serving as this worker; 1 for a plain worker.
    group_size: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    lease_expires_at: Mapped[datetime]
    registered_at: Mapped[datetime]
    # When it last handed its runs over and left (a drain or a stop on purpose).
    left_at: Mapped[datetime | None]


class AuditLog(Base):
    """Who did what to which tenant."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id"), index=True)
    actor: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str | None] = mapped_column(String(200))
    detail: Mapped[dict[str, Any] | None]
    created_at: Mapped[datetime]
