"""Each table's state has one owner module, and statuses are spelled by their enums.

Read from the source (AST), so the rule holds for code no test happens to run: a status written
as a bare string, or a status or training-run progress written outside its owner, fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from core.tables import OpStatus, RunStatus, SessionStatus, VersionStatus, WorkerStatus

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SERVER_PACKAGES = ("api", "billing", "core", "gpu_worker", "scheduler")
STATUS_VALUES = {
    member.value
    for enum in (OpStatus, RunStatus, SessionStatus, VersionStatus, WorkerStatus)
    for member in enum
}
# Who may write which attribute. `status` belongs to the module that owns its table.
STATUS_OWNERS = {
    "core/runs.py",
    "core/sessions.py",
    "core/checkpoints.py",
    "scheduler/oplog.py",
    "scheduler/workers.py",
}
RUN_PROGRESS = {
    "executed_seq_id",
    "optim_steps",
    "snapshot_seq_id",
    "snapshot_uri",
    "last_request_at",
    "loaded_from_version_id",
}
WRITERS = {
    "status": STATUS_OWNERS,
    **{column: {"core/runs.py"} for column in RUN_PROGRESS},
    # A run's or sampler's worker (core.runs), an operation's (scheduler.oplog).
    "worker_id": {"core/runs.py", "scheduler/oplog.py"},
    # An operation's emptied payload (op-log retention writes through scheduler.oplog).
    "payload_pruned_at": {"scheduler/oplog.py"},
    # A run's trained tokens (core.runs), and a version's record of them at its save.
    "tokens_trained": {"core/runs.py", "core/checkpoints.py"},
    # A package's deletion and the version an alias names belong to core.registry.
    "deleted_at": {"core/registry.py"},
    "version_id": {"core/registry.py"},
}

TABLES = {
    "Operation",
    "TrainingRun",
    "SamplingSession",
    "Session",
    "ModelVersion",
    "ModelPackage",
    "ModelAlias",
    "Worker",
}


def _is_status(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "status"


def _literals(node: ast.AST) -> list[str]:
    """Status values spelled as strings in `node` (a constant, or a tuple or list of them)."""
    items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
    return [
        item.value
        for item in items
        if isinstance(item, ast.Constant) and item.value in STATUS_VALUES
    ]


def _targets(node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> list[ast.expr]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    flat: list[ast.expr] = []
    for target in targets:
        flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
    return flat


def violations(source: str, path: str) -> list[str]:
    """What in `source` (the module at `path`, relative to the root) breaks the rules."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Compare) and any(map(_is_status, [node.left, *node.comparators])):
            for literal in _literals(node.left) + [
                value for side in node.comparators for value in _literals(side)
            ]:
                found.append(f"{path}:{line}: status compared with the literal {literal!r}")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "in_" and _is_status(func.value):
                for literal in (value for arg in node.args for value in _literals(arg)):
                    found.append(f"{path}:{line}: status.in_ with the literal {literal!r}")
            # Writes by keyword: `update(...).values(status=...)`, or a new row `Table(status=...)`.
            writes_row = (isinstance(func, ast.Attribute) and func.attr == "values") or (
                isinstance(func, ast.Name) and func.id in TABLES
            )
            for keyword in node.keywords if writes_row else ():
                if keyword.arg in WRITERS and path not in WRITERS[keyword.arg]:
                    found.append(f"{path}:{line}: writes {keyword.arg}= outside its owner")
            for keyword in node.keywords:
                if keyword.arg == "status" and _literals(keyword.value):
                    found.append(f"{path}:{line}: status= a literal")
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            for target in _targets(node):
                if not isinstance(target, ast.Attribute) or target.attr not in WRITERS:
                    continue
                if isinstance(target.value, ast.Name) and target.value.id == "self":
                    continue  # an object's own field, not a row's
                if path not in WRITERS[target.attr]:
                    found.append(f"{path}:{line}: writes .{target.attr} outside its owner")
                if target.attr == "status" and node.value is not None and _literals(node.value):
                    found.append(f"{path}:{line}: .status = a literal")
    return found


def _server_modules() -> list[Path]:
    return sorted(
        path
        for package in SERVER_PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if path.relative_to(ROOT).as_posix() != "core/tables.py"
    )


def test_statuses_are_spelled_by_their_enums_and_written_by_their_owners() -> None:
    found = [
        problem
        for path in _server_modules()
        for problem in violations(path.read_text(), path.relative_to(ROOT).as_posix())
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("snippet", "problem"),
    [
        ("op.status = 'queued'", ".status = a literal"),
        ("if run.status == 'active': pass", "compared with the literal 'active'"),
        ("q.where(Worker.status.in_(('live', 'dead')))", "status.in_ with the literal 'live'"),
        ("update(Operation).values(status=OpStatus.DONE)", "writes status= outside its owner"),
        ("run.executed_seq_id = 3", "writes .executed_seq_id outside its owner"),
        ("run.optim_steps += 1", "writes .optim_steps outside its owner"),
        ("update(Operation).values(payload_pruned_at=now)", "writes payload_pruned_at= outside"),
        ("run.tokens_trained += 10", "writes .tokens_trained outside its owner"),
        ("run.loaded_from_version_id = v.id", "writes .loaded_from_version_id outside"),
        ("op.status, op.finished_at = OpStatus.FAILED, now", "writes .status outside"),
        ("package.deleted_at = now", "writes .deleted_at outside its owner"),
        ("ModelAlias(name='prod', version_id=v.id)", "writes version_id= outside its owner"),
    ],
)
def test_the_check_catches_each_kind_of_breach(snippet: str, problem: str) -> None:
    assert any(problem in found for found in violations(snippet, "api/routes/x.py"))


def test_owners_may_write_their_own_state() -> None:
    assert violations("run.executed_seq_id = 3", "core/runs.py") == []
    assert violations("op.status = OpStatus.RUNNING", "scheduler/oplog.py") == []
    assert violations("alias.version_id = version.id", "core/registry.py") == []
