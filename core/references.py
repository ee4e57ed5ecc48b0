"""Registry references: `package@alias` and `package:version`, accepted wherever a tinker path is.

A package name starts with a letter or digit and goes on with letters, digits, `.`, `_`, `-`
and `:` (a run's own package is named after the run, `<session>:train:<n>`), so a reference
is split at its last `@` (an alias) or at its last `:` followed by digits (a version number).
A bare package name is not a reference: it would read as a version of a shorter name.
`latest` is an alias every package has, kept by the registry itself: the newest version that is
ready, unexpired and still has its files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import ColumnElement, and_, or_, select
from sqlalchemy.orm import Session as OrmSession

from core.errors import InvalidInput, NotFound
from core.tables import ModelAlias, ModelPackage, ModelVersion, VersionStatus

PACKAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
ALIAS_NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,99}")
LATEST = "latest"


@dataclass(frozen=True)
class Reference:
    package: str
    alias: str | None = None
    version: int | None = None

    def __str__(self) -> str:
        return f"{self.package}@{self.alias}" if self.alias else f"{self.package}:{self.version}"


def is_reference(path: str) -> bool:
    """Whether `path` is meant as a registry reference rather than a tinker path."""
    return "://" not in path and ("@" in path or ":" in path)


def check_package_name(name: str) -> str:
    if not PACKAGE_NAME.fullmatch(name):
        raise InvalidInput(
            f"package name {name!r} is invalid; use 1 to 200 letters, digits, '.', '_', '-' or "
            "':', starting with a letter or digit"
        )
    return name


def check_alias_name(name: str) -> str:
    if not ALIAS_NAME.fullmatch(name):
        raise InvalidInput(
            f"alias {name!r} is invalid; use 1 to 100 letters, digits, '.', '_' or '-', "
            "starting with a letter"
        )
    return name


def parse(reference: str) -> Reference:
    """The parts of `reference`; InvalidInput says what a valid one looks like."""
    package, at, alias = reference.rpartition("@")
    if at:
        return Reference(check_package_name(package), alias=check_alias_name(alias))
    package, colon, number = reference.rpartition(":")
    if colon and number.isdigit() and int(number) >= 1:
        return Reference(check_package_name(package), version=int(number))
    raise InvalidInput(
        f"{reference!r} is not a checkpoint path or registry reference; pass tinker://<run id>/"
        "<weights|sampler_weights|external_weights>/<name>, <package>@<alias> or "
        "<package>:<version number>"
    )


def live_package(db: OrmSession, tenant_id: str, name: str) -> ModelPackage | None:
    return db.scalar(
        select(ModelPackage).where(
            ModelPackage.tenant_id == tenant_id,
            ModelPackage.name == name,
            ModelPackage.deleted_at.is_(None),
        )
    )


def usable(now: datetime) -> ColumnElement[bool]:
    """A version `@latest` may name at `now`: ready, unexpired, with its files."""
    return and_(
        ModelVersion.status == VersionStatus.READY,
        ModelVersion.artifact_uri.is_not(None),
        or_(ModelVersion.expires_at.is_(None), ModelVersion.expires_at > now),
    )


def latest_version(db: OrmSession, package_id: str, now: datetime) -> ModelVersion | None:
    """The package's newest usable version at `now` (`usable`): what `@latest` points at."""
    return db.scalar(
        select(ModelVersion)
        .where(ModelVersion.package_id == package_id, usable(now))
        .order_by(ModelVersion.version.desc())
        .limit(1)
    )


def lookup(db: OrmSession, tenant_id: str, reference: str, now: datetime) -> ModelVersion:
    """The version `reference` names among `tenant_id`'s packages (any status but deleted).

    Another tenant's package answers exactly like a missing one. Whether the version may be
    used (ready, not expired) is the caller's check, with its own message; `@latest` names
    the newest usable one at `now`.
    """
    ref = parse(reference)
    package = live_package(db, tenant_id, ref.package)
    if package is None:
        raise NotFound(
            f"package {ref.package!r} not found; list yours with `treadle registry packages`"
        )
    version: ModelVersion | None
    if ref.version is not None:
        version = db.scalar(
            select(ModelVersion).where(
                ModelVersion.package_id == package.id,
                ModelVersion.version == ref.version,
                ModelVersion.status != VersionStatus.DELETED,
            )
        )
    elif ref.alias == LATEST:
        version = latest_version(db, package.id, now)
    else:
        version = db.scalar(
            select(ModelVersion)
            .join(ModelAlias, ModelAlias.version_id == ModelVersion.id)
            .where(ModelAlias.package_id == package.id, ModelAlias.name == ref.alias)
        )
    if version is None:
        raise NotFound(
            f"{ref} not found; list the package's versions and aliases with "
            f"`treadle registry versions {ref.package}`"
        )
    return version
