"""How many database transactions one operation costs, end to end (submit, run, result).

Every transaction is a round trip to the database and, on SQLite, a turn at the write lock. An
op needs three writes: the acknowledged request (it must survive a crash of the server), the
claim, and the recorded result with its usage. Reads are authentication (one per HTTP
request), the long-poll's reads of the future, and the engine's cheap look for queued work,
each a statement on its own, outside any transaction. These ceilings hold the hot path to that; a change that adds a transaction per op fails here.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event

from tests.embedded_app import EmbeddedApp, datum, embedded_app

pytestmark = pytest.mark.integration

OPS = 20
# Statements per op at most, beside BEGIN: measured 16 for optim_step and 20 for forward_backward,
# which also records its usage. They were 22.5 and 28 before the submission queued its op with
# one insert and the record wrote its result with one update; 18 and 24 before the claim skipped
# the samples' query when none was queued and the record advanced the run, counting its steps
# and tokens, with one update instead of reading it first. An idle engine's poll adds one now
# and then.
STATEMENTS = {"optim_step": 17, "forward_backward": 21}


@pytest.fixture
def app(tmp_path: Path) -> Iterator[EmbeddedApp]:
    # No snapshots in the measured window: they are periodic, not per op.
    with embedded_app(tmp_path, snapshot_every_steps=10_000) as embedded:
        yield embedded


class TransactionCounter:
    """Counts SQLite transactions by how they begin, IMMEDIATE (writes) or DEFERRED (reads),
    and the statements run inside them (`statements`)."""

    def __init__(self, app: EmbeddedApp) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        event.listen(app.database.engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        with self._lock:
            if statement.startswith("BEGIN"):
                self.counts[statement.split()[-1]] += 1
            else:
                self.counts["statements"] += 1

    def take(self) -> Counter[str]:
        with self._lock:
            counts, self.counts = self.counts, Counter()
        return counts


def _optim_step(model_id: str, seq_id: int) -> dict[str, Any]:
    return {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-4}}


def _forward_backward(model_id: str, seq_id: int) -> dict[str, Any]:
    return {
        "model_id": model_id,
        "seq_id": seq_id,
        "data": [datum([5, 6, 7, 8])],
        "loss_fn": "cross_entropy",
    }


@pytest.mark.parametrize(
    ("route", "body"),
    [("optim_step", _optim_step), ("forward_backward", _forward_backward)],
)
def test_an_op_costs_three_writes_and_a_few_reads(app: EmbeddedApp, route: str, body: Any) -> None:
    headers = app.tenant()
    run = app.run(headers, rank=1)
    app.op(headers, route, body(run, 1))  # warm: first use loads and caches what it can
    counter = TransactionCounter(app)
    for seq in range(2, 2 + OPS):
        app.op(headers, route, body(run, seq))
    counts = counter.take()
    # Writes: the acknowledged request, the claim, the recorded result.
    assert counts["IMMEDIATE"] / OPS == 3, counts
    # Reads: authentication of the submit and of each long-poll, the future's state (read
    # before waiting and once woken), and the engine's look for work before it claims and
    # after it ran: each a statement on its own, in no transaction (`Database.rows()`). Only
    # the engine's sweep of ended sessions, every 15 s, may open a read transaction here.
    assert counts["DEFERRED"] <= 1, counts
    # Statements, beside the transactions: each is a round trip and a turn through SQLAlchemy.
    # The submit checks the key, reads the run, its session and the seq_id's twin, inserts
    # and touches the run; the claim reads what is ready and marks it; the record writes the
    # result and advances the run; the long-poll reads the future and its usage.
    assert counts["statements"] / OPS <= STATEMENTS[route], counts
