"""The model registry (a Treadle extension): packages, their versions, aliases and lineage.

Packages are addressed by name (`/registry/packages/{name}`), versions by number within their
package, aliases by name. Everything is the caller's own: another tenant's package, version or
alias answers 404 exactly like a missing one. Writes answer with the changed object (200) so a
client sees the result, except deletions (204).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi import Path as PathParameter
from sqlalchemy.orm import Session as OrmSession

from api.deps import CurrentPrincipal, DbSession, ReadSession, State
from api.openapi import error_responses
from api.views import package_view, version_view
from core import audit, lineage, registry
from core.apikeys import Principal
from core.clock import Clock
from core.tables import ModelVersion, VersionStatus
from treadle.types import (
    CreatePackageRequest,
    Cursor,
    LineageEdge,
    LineageNode,
    LineageResponse,
    PromoteVersionRequest,
    RegistryAlias,
    RegistryAliasesResponse,
    RegistryPackage,
    RegistryPackagesResponse,
    RegistryVersion,
    RegistryVersionsResponse,
    SetAliasRequest,
    SetCheckpointTtlRequest,
    UpdatePackageRequest,
)
from treadle.types.bounds import MAX_OFFSET
from treadle.types.registry import VersionStatus as WireVersionStatus

router = APIRouter(prefix="/api/v1/registry", tags=["registry"])

PACKAGE = "/packages/{name}"
VERSION = PACKAGE + "/versions/{version}"
ALIAS = PACKAGE + "/aliases/{alias}"
Name = Annotated[str, PathParameter(description="The package's name.", max_length=200)]
Number = Annotated[
    int, PathParameter(description="The version's number in its package.", ge=1, le=2**31 - 1)
]
AliasName = Annotated[str, PathParameter(description="The alias's name.", max_length=100)]
Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET)]
READ_ERRORS = error_responses(401, 403, 404, 422)
WRITE_ERRORS = error_responses(401, 403, 404, 413, 422)


def _versions(
    db: OrmSession, clock: Clock, tenant_id: str, package: str, rows: list[ModelVersion]
) -> list[RegistryVersion]:
    refs = registry.version_refs(
        db,
        tenant_id,
        {v.parent_version_id for v in rows if v.parent_version_id}
        | {v.source_version_id for v in rows if v.source_version_id},
    )
    aliases = registry.aliases_by_version(db, clock, rows[0].package_id) if rows else {}
    return [version_view(v, package, refs, aliases.get(v.id, [])) for v in rows]


def _audit(db: OrmSession, clock: Clock, principal: Principal, action: str, target: str) -> None:
    audit.record(
        db,
        clock,
        tenant_id=principal.tenant_id,
        actor=principal.key_id,
        action=action,
        target=target,
    )


# --- packages ---------------------------------------------------------------------------------


@router.get("/packages", response_model=RegistryPackagesResponse, responses=READ_ERRORS)
def list_packages(
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    tag: Annotated[str | None, Query(max_length=64, description="Only packages with it.")] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> RegistryPackagesResponse:
    """The caller's packages, by name."""
    rows, total = registry.list_packages(
        db, principal.tenant_id, tag=tag, limit=limit, offset=offset
    )
    counts = registry.version_counts(db, [p.id for p in rows], state.clock.now())
    return RegistryPackagesResponse(
        packages=[package_view(p, counts[p.id]) for p in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.post("/packages", response_model=RegistryPackage, responses=WRITE_ERRORS)
def create_package(
    body: CreatePackageRequest, principal: CurrentPrincipal, db: DbSession, state: State
) -> RegistryPackage:
    """A new empty package; with `training_run_id`, the package that run's saves go into."""
    package = registry.create_package(
        db,
        state.clock,
        principal.tenant_id,
        name=body.name,
        description=body.description,
        tags=body.tags,
        base_model=body.base_model,
        training_run_id=body.training_run_id,
    )
    return package_view(package, (0, None))


@router.get(PACKAGE, response_model=RegistryPackage, responses=READ_ERRORS)
def get_package(
    name: Name, principal: CurrentPrincipal, db: ReadSession, state: State
) -> RegistryPackage:
    package = registry.get_package(db, principal.tenant_id, name)
    return package_view(
        package, registry.version_counts(db, [package.id], state.clock.now())[package.id]
    )


@router.patch(PACKAGE, response_model=RegistryPackage, responses=WRITE_ERRORS)
def update_package(
    name: Name,
    body: UpdatePackageRequest,
    principal: CurrentPrincipal,
    db: DbSession,
    state: State,
) -> RegistryPackage:
    """Rename, describe or tag the package; fields left out stay as they are."""
    package = registry.update_package(
        db,
        state.clock,
        principal.tenant_id,
        name,
        new_name=body.name,
        description=body.description,
        set_description="description" in body.model_fields_set,
        tags=body.tags,
    )
    return package_view(
        package, registry.version_counts(db, [package.id], state.clock.now())[package.id]
    )


@router.delete(PACKAGE, status_code=204, responses=READ_ERRORS)
def delete_package(name: Name, principal: CurrentPrincipal, db: DbSession, state: State) -> None:
    """Delete the package and its versions, freeing the name; refused while it has aliases or
    a version still uploading."""
    registry.delete_package(db, state.clock, principal.tenant_id, name)
    _audit(db, state.clock, principal, "registry.package.deleted", name)


# --- versions ---------------------------------------------------------------------------------


@router.get(PACKAGE + "/versions", response_model=RegistryVersionsResponse, responses=READ_ERRORS)
def list_versions(
    name: Name,
    principal: CurrentPrincipal,
    db: ReadSession,
    state: State,
    status: Annotated[
        WireVersionStatus | None, Query(description="Only versions in this status.")
    ] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> RegistryVersionsResponse:
    """The package's versions, newest first (deleted ones only with `status=deleted`)."""
    rows, total = registry.list_versions(
        db,
        principal.tenant_id,
        name,
        status=VersionStatus(status) if status is not None else None,
        limit=limit,
        offset=offset,
    )
    return RegistryVersionsResponse(
        versions=_versions(db, state.clock, principal.tenant_id, name, rows),
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.get(VERSION, response_model=RegistryVersion, responses=READ_ERRORS)
def get_version(
    name: Name, version: Number, principal: CurrentPrincipal, db: ReadSession, state: State
) -> RegistryVersion:
    row = registry.get_version(db, principal.tenant_id, name, version)
    return _versions(db, state.clock, principal.tenant_id, name, [row])[0]


@router.delete(VERSION, status_code=204, responses=READ_ERRORS)
def delete_version(
    name: Name, version: Number, principal: CurrentPrincipal, db: DbSession, state: State
) -> None:
    """Delete the version; refused while an alias points at it or it is still uploading. Its
    files are removed later, once no other version or run needs them."""
    registry.delete_version(db, principal.tenant_id, name, version)
    _audit(db, state.clock, principal, "registry.version.deleted", f"{name}:{version}")


@router.put(VERSION + "/ttl", response_model=RegistryVersion, responses=WRITE_ERRORS)
def set_version_ttl(
    name: Name,
    version: Number,
    body: SetCheckpointTtlRequest,
    principal: CurrentPrincipal,
    db: DbSession,
    state: State,
) -> RegistryVersion:
    """Expire the version `ttl_seconds` from now (1 hour to 10 years), or never with null."""
    row = registry.set_version_ttl(
        db, state.clock, principal.tenant_id, name, version, body.ttl_seconds
    )
    return _versions(db, state.clock, principal.tenant_id, name, [row])[0]


@router.post(VERSION + "/promote", response_model=RegistryVersion, responses=WRITE_ERRORS)
def promote_version(
    name: Name,
    version: Number,
    body: PromoteVersionRequest,
    principal: CurrentPrincipal,
    db: DbSession,
    state: State,
) -> RegistryVersion:
    """Add the version to another package of the same base model (its files are shared, not
    copied); answers with the new version."""
    row = registry.promote(
        db,
        state.clock,
        principal.tenant_id,
        name,
        version,
        target=body.target_package,
        actor_key_id=principal.key_id,
    )
    _audit(
        db,
        state.clock,
        principal,
        "registry.version.promoted",
        f"{body.target_package}:{row.version}",
    )
    return _versions(db, state.clock, principal.tenant_id, body.target_package, [row])[0]


# --- aliases and lineage ----------------------------------------------------------------------


def _alias(entry: registry.AliasEntry) -> RegistryAlias:
    return RegistryAlias(
        name=entry.name, version=entry.version, virtual=entry.virtual, updated_at=entry.updated_at
    )


@router.get(PACKAGE + "/aliases", response_model=RegistryAliasesResponse, responses=READ_ERRORS)
def list_aliases(
    name: Name, principal: CurrentPrincipal, db: ReadSession, state: State
) -> RegistryAliasesResponse:
    """The package's aliases by name, with the virtual `latest` first when it has a version."""
    entries = registry.list_aliases(db, state.clock, principal.tenant_id, name)
    return RegistryAliasesResponse(aliases=[_alias(e) for e in entries])


@router.put(ALIAS, response_model=RegistryAlias, responses=WRITE_ERRORS)
def set_alias(
    name: Name,
    alias: AliasName,
    body: SetAliasRequest,
    principal: CurrentPrincipal,
    db: DbSession,
    state: State,
) -> RegistryAlias:
    """Point the alias at a ready version of the package, creating or moving it."""
    entry = registry.set_alias(
        db, state.clock, principal.tenant_id, name, alias, body.version, actor=principal.key_id
    )
    return _alias(entry)


@router.delete(ALIAS, status_code=204, responses=READ_ERRORS)
def delete_alias(
    name: Name, alias: AliasName, principal: CurrentPrincipal, db: DbSession, state: State
) -> None:
    registry.delete_alias(db, state.clock, principal.tenant_id, name, alias, actor=principal.key_id)


@router.get(PACKAGE + "/lineage", response_model=LineageResponse, responses=READ_ERRORS)
def package_lineage(name: Name, principal: CurrentPrincipal, db: ReadSession) -> LineageResponse:
    """Runs and versions around the package's versions, across the caller's packages."""
    graph = lineage.package_lineage(db, principal.tenant_id, name)
    return LineageResponse(
        package=name,
        nodes=[LineageNode(**dataclasses.asdict(n)) for n in graph.nodes],
        edges=[LineageEdge(**dataclasses.asdict(e)) for e in graph.edges],
        truncated=graph.truncated,
    )
