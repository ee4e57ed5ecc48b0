"""The lineage graph of a registry package: which runs saved its versions, which runs were
loaded from them, and which versions were promoted from or into them, followed across the
tenant's packages in both directions (ancestors and descendants), up to a bound.

Reads only. Nodes are runs (`run:<id>`) and versions (`version:<id>`); edges are `saved`
(run → version), `loaded` (version → the run loaded from it) and `promoted` (source version →
promoted version). Everything read is the tenant's own: the walk never leaves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from core import registry
from core.tables import ModelPackage, ModelVersion, TrainingRun

MAX_NODES = 500


@dataclass(frozen=True)
class Node:
    id: str
    kind: Literal["run", "version"]
    label: str
    status: str
    created_at: datetime
    package: str | None = None
    version: int | None = None


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    relation: Literal["saved", "loaded", "promoted"]


@dataclass(frozen=True)
class Graph:
    nodes: list[Node]
    edges: list[Edge]
    truncated: bool


def _run_node(run: TrainingRun) -> Node:
    return Node(f"run:{run.id}", "run", run.id, run.status, run.created_at)


def _version_node(version: ModelVersion, package_name: str) -> Node:
    label = f"{package_name}:{version.version}"
    return Node(
        f"version:{version.id}",
        "version",
        label,
        version.status,
        version.created_at,
        package_name,
        version.version,
    )


def package_lineage(
    db: OrmSession, tenant_id: str, name: str, *, max_nodes: int = MAX_NODES
) -> Graph:
    """The graph around every version of package `name` (deleted ones included: history)."""
    package = registry.get_package(db, tenant_id, name)
    names: dict[str, str] = {}
    nodes: dict[str, Node] = {}
    edges: set[Edge] = set()
    versions: dict[str, ModelVersion] = {}
    runs: dict[str, TrainingRun] = {}
    frontier_versions = set(
        db.scalars(select(ModelVersion.id).where(ModelVersion.package_id == package.id))
    )
    frontier_runs: set[str] = set()
    truncated = False
    while frontier_versions or frontier_runs:
        if len(nodes) + len(frontier_versions) + len(frontier_runs) > max_nodes:
            truncated = True
            room = max(0, max_nodes - len(nodes))
            frontier_versions = set(sorted(frontier_versions)[:room])
            frontier_runs = set(sorted(frontier_runs)[: max(0, room - len(frontier_versions))])
        new_versions = _versions(db, tenant_id, frontier_versions)
        new_runs = _runs(db, tenant_id, frontier_runs)
        _package_names(db, {v.package_id for v in new_versions} - names.keys(), names)
        for version in new_versions:
            versions[version.id] = version
            nodes[f"version:{version.id}"] = _version_node(version, names[version.package_id])
        for run in new_runs:
            runs[run.id] = run
            nodes[f"run:{run.id}"] = _run_node(run)
        if truncated:
            break
        next_versions: set[str] = set()
        next_runs: set[str] = set()
        ids = [v.id for v in new_versions]
        for version in new_versions:
            if version.source_version_id is not None:
                next_versions.add(version.source_version_id)
            elif version.training_run_id is not None:
                next_runs.add(version.training_run_id)
        for promoted in db.scalars(
            select(ModelVersion.id).where(
                ModelVersion.tenant_id == tenant_id, ModelVersion.source_version_id.in_(ids)
            )
        ):
            next_versions.add(promoted)
        for loaded in db.scalars(
            select(TrainingRun.id).where(
                TrainingRun.tenant_id == tenant_id, TrainingRun.loaded_from_version_id.in_(ids)
            )
        ):
            next_runs.add(loaded)
        run_ids = [r.id for r in new_runs]
        for run in new_runs:
            if run.loaded_from_version_id is not None:
                next_versions.add(run.loaded_from_version_id)
        for saved in db.scalars(
            select(ModelVersion.id).where(
                ModelVersion.tenant_id == tenant_id,
                ModelVersion.training_run_id.in_(run_ids),
                ModelVersion.source_version_id.is_(None),
            )
        ):
            next_versions.add(saved)
        frontier_versions = next_versions - versions.keys()
        frontier_runs = next_runs - runs.keys()
    for version in versions.values():
        target = f"version:{version.id}"
        if version.source_version_id is not None:
            edges.add(Edge(f"version:{version.source_version_id}", target, "promoted"))
        elif version.training_run_id is not None:
            edges.add(Edge(f"run:{version.training_run_id}", target, "saved"))
    for run in runs.values():
        if run.loaded_from_version_id is not None:
            edges.add(Edge(f"version:{run.loaded_from_version_id}", f"run:{run.id}", "loaded"))
    kept = [e for e in edges if e.source in nodes and e.target in nodes]
    return Graph(
        sorted(nodes.values(), key=lambda n: (n.created_at, n.id)),
        sorted(kept, key=lambda e: (e.source, e.target, e.relation)),
        truncated,
    )


def _versions(db: OrmSession, tenant_id: str, ids: set[str]) -> list[ModelVersion]:
    if not ids:
        return []
    return list(
        db.scalars(
            select(ModelVersion).where(
                ModelVersion.tenant_id == tenant_id, ModelVersion.id.in_(sorted(ids))
            )
        )
    )


def _runs(db: OrmSession, tenant_id: str, ids: set[str]) -> list[TrainingRun]:
    if not ids:
        return []
    return list(
        db.scalars(
            select(TrainingRun).where(
                TrainingRun.tenant_id == tenant_id, TrainingRun.id.in_(sorted(ids))
            )
        )
    )


def _package_names(db: OrmSession, ids: set[str], into: dict[str, str]) -> None:
    if ids:
        rows = db.execute(
            select(ModelPackage.id, ModelPackage.name).where(ModelPackage.id.in_(ids))
        )
        into.update({package_id: name for package_id, name in rows})
