"""Rows of the scheduler's tables, made through their own write paths, for tests that call the
scheduler's functions directly (no HTTP, no app).

Tenants, sessions, training runs, samplers and operations are created by the functions the API
calls (`core.tenants`, `core.sessions`, `core.runs`, `scheduler.submit`), and workers by
`scheduler.workers`. One thing is written here instead: an op's recorded end, whose write path
(the worker host's) needs an engine and an executed op; `Rows.executed` marks ops done itself
and advances their run through `core.runs`.
"""

from __future__ import annotations

import itertools
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from api.dbschema import upgrade
from core import runs, sessions, tenants
from core.clock import Clock, FakeClock
from core.db import Database
from core.objectstore import LocalArtifactStore
from core.tables import Operation, SamplingSession, TrainingRun
from scheduler import oplog, workers
from scheduler.notify import InProcessNotifier
from scheduler.ops import OpKind, encode_json_payload, encode_proto_payload
from scheduler.submit import Submitted, submit, submit_training_op
from tests.builders import make_settings
from treadle.types import Datum, ForwardBackwardRequest, ModelInput, TensorData
from treadle.wire import encode_forward_backward_request

if TYPE_CHECKING:
    from gpu_worker.engine import Engine
    from scheduler.worker.host import WorkerHost

MODEL = "treadle/tiny-1m"


def migrated(database_url: str) -> Database:
    database = Database(database_url)
    upgrade(database)
    return database


def forward_backward_request(
    run_id: str, seq_id: int, tokens: list[int], *, forward_only: bool = False
) -> ForwardBackwardRequest:
    """A cross-entropy forward_backward predicting each next token of `tokens`."""
    return ForwardBackwardRequest(
        model_id=run_id,
        seq_id=seq_id,
        loss_fn="cross_entropy",
        forward_only=forward_only,
        data=[
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData(data=tokens[1:], dtype="int64"),
                    "weights": TensorData(data=[1.0] * (len(tokens) - 1), dtype="float32"),
                },
            )
        ],
    )


def forward_backward_payload(
    run_id: str, seq_id: int, tokens: list[int], *, forward_only: bool = False
) -> tuple[bytes, str]:
    """The same request, stored as the API stores a protobuf body."""
    request = forward_backward_request(run_id, seq_id, tokens, forward_only=forward_only)
    return encode_proto_payload(encode_forward_backward_request(request))


class Rows:
    """Builds rows in `database` at the time `clock` says."""

    def __init__(self, database: Database, clock: FakeClock | None = None) -> None:
        self.database = database
        self.clock = clock or FakeClock()
        self._names = itertools.count()

    def tenant(self, **limits: int) -> str:
        """A new tenant's id; `limits` sets its resource limits (`core.tenants.ResourceLimits`)."""
        with self.database.transaction() as db:
            tenant = tenants.create_tenant(
                db,
                self.clock,
                f"tenant-{next(self._names)}",
                max_concurrent_sessions=100,
                max_lora_rank=64,
                limits=limits,
            )
            return tenant.id

    def session(self, tenant_id: str) -> str:
        with self.database.transaction() as db:
            return sessions.create_session(
                db, self.clock, tenant_id=tenant_id, api_key_id=None, ttl_seconds=3600
            ).id

    def run(
        self,
        tenant_id: str,
        *,
        base_model: str = MODEL,
        session_id: str | None = None,
        model_seq_id: int = 0,
        rank: int = 2,
        seed: int = 0,
    ) -> str:
        """A training run with its create_model op queued as seq 0, as `create_model` makes it."""
        session_id = session_id or self.session(tenant_id)
        lora = {"rank": rank, "seed": seed}
        with self.database.transaction() as db:
            run, _ = runs.create_training_run(
                db,
                self.clock,
                tenant_id=tenant_id,
                session_id=session_id,
                model_seq_id=model_seq_id,
                base_model=base_model,
                lora_config=lora,
                user_metadata=None,
            )
            payload, codec = encode_json_payload({"base_model": base_model, "lora_config": lora})
            submit(
                db,
                self.clock,
                tenant_id=tenant_id,
                session_id=session_id,
                target_id=run.id,
                seq_id=0,
                kind=OpKind.CREATE_MODEL,
                payload=payload,
                payload_codec=codec,
            )
            return run.id

    def sampler(
        self,
        tenant_id: str,
        *,
        base_model: str = MODEL,
        training_run_id: str | None = None,
        seq: int = 0,
    ) -> str:
        """A sampling session of the base model's weights, or with `training_run_id` a live one
        (`live:<run>`: the run's current weights)."""
        session_id = self.session(tenant_id)
        with self.database.transaction() as db:
            return runs.create_sampling_session(
                db,
                self.clock,
                tenant_id=tenant_id,
                session_id=session_id,
                seq=seq,
                base_model=base_model,
                model_path=None,
                training_run_id=training_run_id,
                model_version_id=None,
            ).id

    def worker(
        self,
        worker_id: str,
        models: list[str],
        *,
        lease_seconds: float = 15.0,
        dead: bool = False,
        group_size: int = 1,
        devices: dict[str, int] | None = None,
    ) -> None:
        """A worker registered now serving `models`, its lease ending `lease_seconds` from now;
        `dead` registers it with a lapsed lease and declares it (and any other lapsed) dead,
        as beat does. A worker group has `group_size` ranks; `devices` gives models that
        need several the devices it registers them with."""
        now = self.clock.now()
        needs = devices or {}
        with self.database.transaction() as db:
            workers.register(
                db,
                worker_id,
                device="cpu",
                models=[
                    {"name": name, **({"devices": needs[name]} if name in needs else {})}
                    for name in models
                ],
                lease_until=now + timedelta(seconds=-1 if dead else lease_seconds),
                now=now,
                group_size=group_size,
            )
            if dead:
                assert worker_id in workers.declare_dead_lapsed(db, now)

    def training_op(
        self,
        run_id: str,
        seq_id: int,
        kind: OpKind = OpKind.OPTIM_STEP,
        payload: tuple[bytes, str] | None = None,
    ) -> Submitted:
        """Submit an op on a run through `submit_training_op` (a JSON payload unless given)."""
        data, codec = payload or encode_json_payload(
            {"model_id": run_id, "seq_id": seq_id, "adam_params": {"learning_rate": 0.05}}
        )
        with self.database.transaction() as db:
            run = db.get(TrainingRun, run_id)
            assert run is not None
            return submit_training_op(
                db, self.clock, run=run, seq_id=seq_id, kind=kind, payload=data, payload_codec=codec
            )

    def sample_op(self, sampler_id: str, seq_id: int) -> str:
        """Submit a sampling request on a sampler, as `asample` does; returns its request id."""
        with self.database.transaction() as db:
            tenant_id, session_id = db.execute(
                select(SamplingSession.tenant_id, SamplingSession.session_id).where(
                    SamplingSession.id == sampler_id
                )
            ).one()
            payload, codec = encode_json_payload({"seq_id": seq_id, "num_samples": 1})
            return submit(
                db,
                self.clock,
                tenant_id=tenant_id,
                session_id=session_id,
                target_id=sampler_id,
                seq_id=seq_id,
                kind=OpKind.SAMPLE,
                payload=payload,
                payload_codec=codec,
            ).request_id

    def executed(self, run_id: str, seq_id: int) -> None:
        """Record the run's ops up to `seq_id` done and the run advanced past them, as the
        worker host records results (its `_store` needs an engine); seq_ids that never arrived
        count as released gaps."""
        with self.database.transaction() as db:
            for op in db.scalars(
                select(Operation).where(
                    Operation.target_id == run_id,
                    Operation.seq_id <= seq_id,
                    Operation.status.in_(("queued", "running")),
                )
            ):
                op.status, op.finished_at = "done", self.clock.now()
            advanced = oplog.advance_run(
                db, OpKind.FORWARD_BACKWARD, run_id, seq_id, self.clock.now()
            )
            assert advanced is not None

    def op(self, request_id: str) -> Operation:
        with self.database.reader() as db:
            op = db.get(Operation, request_id)
            assert op is not None
            return op

    def ops(self, target_id: str) -> list[Operation]:
        with self.database.reader() as db:
            return list(
                db.scalars(
                    select(Operation)
                    .where(Operation.target_id == target_id)
                    .order_by(Operation.seq_id)
                )
            )

    def training_run(self, run_id: str) -> TrainingRun:
        with self.database.reader() as db:
            run = db.get(TrainingRun, run_id)
            assert run is not None
            return run


def cpu_engine(root: Path) -> Engine:
    """The engine a worker builds from its settings (`build_engine`), on the CPU."""
    from scheduler.worker.host import build_engine

    return build_engine(make_settings(root, f"sqlite:///{root / 'unused.db'}", device="cpu"))


def worker_host(
    database: Database,
    clock: Clock,
    engine: Engine,
    artifacts: Path,
    **options: Any,
) -> WorkerHost:
    """A worker host as embedded mode builds it (`scheduler.worker.embedded`), on `engine`."""
    from scheduler.worker.host import WorkerHost

    return WorkerHost(
        database, clock, engine, LocalArtifactStore(artifacts), InProcessNotifier(), **options
    )
