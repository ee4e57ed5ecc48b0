"""The save operations: a run's weights written to the artifact store and registered as an
immutable model version — save_weights (with the optimizer, to resume), save_weights_for_sampler
(to sample, optionally opening a sampling session on them) and save_weights_external (an adapter
or merged export)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy.orm import Session as OrmSession

from billing.ledger import UsageLine
from core import checkpoints, runs
from core.clock import Clock
from core.db import Database
from core.errors import ErrorCode, TreadleError
from core.ids import sampling_session_id
from core.objectstore import ArtifactStore
from core.tables import ModelVersion, TrainingRun
from gpu_worker import protocol as ep
from scheduler.failures import OpFailure, Refused
from scheduler.ops import decode_payload
from scheduler.worker.claimed import Task
from scheduler.worker.outcome import Outcome
from treadle.types import (
    SaveWeightsExternalRequest,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerRequest,
    SaveWeightsForSamplerResponse,
    SaveWeightsRequest,
    SaveWeightsResponse,
)

if TYPE_CHECKING:
    from gpu_worker.engine import Engine


class Saves:
    def __init__(
        self, engine: Engine, store: ArtifactStore, database: Database, clock: Clock
    ) -> None:
        self.engine = engine
        self.store = store
        self.database = database
        self.clock = clock

    def _write(
        self,
        task: Task,
        kind: str,
        name: str | None,
        *,
        optimizer: bool,
        export: str | None = None,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: dict[str, str] | None = None,
    ) -> tuple[int, Callable[[OrmSession], ModelVersion]]:
        """Write the run's weights to the store; returns their size and the callback that
        registers them as a model version (run with the result's other writes).

        A pending version is committed before the upload and becomes ready only with the
        result, once every file is in place; an upload that raises marks it failed.
        """
        key = f"{task.tenant_id}/{task.target_id.replace(':', '_')}/{kind}/{name or 'snapshot'}-{task.id}"
        uri = self.store.uri(key)
        pending = self._begin(task, kind, name, uri, overwrite=overwrite)
        try:
            folder = self.store.local_dir(key)
            if export == "merged":
                self.engine.export_merged(task.target_id, folder)
            elif export == "adapter":
                self.engine.export_adapter(task.target_id, folder)
            else:
                self.engine.save_state(task.target_id, folder, include_optimizer=optimizer)
            uri = self.store.publish(key)
            size, digest = self.store.size_and_digest(uri)
            files = [dataclasses.asdict(file) for file in self.store.files(uri)]
        except BaseException:
            with self.database.transaction() as db:
                checkpoints.fail_upload(db, pending)
            raise
        lineage = checkpoints.Lineage(
            session_id=task.session_id,
            seq_id=task.seq_id,
            created_by_key_id=task.api_key_id,
            base_revision=self.engine.catalog.revision(task.base_model),
            files=files,
        )

        def register(db: OrmSession) -> ModelVersion:
            run = db.get(TrainingRun, task.target_id)
            assert run is not None
            return checkpoints.register(
                db,
                self.clock,
                run=run,
                kind=kind,
                name=name,
                artifact_uri=uri,
                size_bytes=size,
                sha256=digest,
                ttl_seconds=ttl_seconds,
                user_metadata=user_metadata,
                overwrite=overwrite,
                lineage=lineage,
                pending=pending,
            )

        return size, register

    def _begin(self, task: Task, kind: str, name: str | None, uri: str, *, overwrite: bool) -> str:
        """The id of the pending version this save uploads for (committed at once)."""
        try:
            with self.database.transaction() as db:
                run = db.get(TrainingRun, task.target_id)
                assert run is not None
                return checkpoints.begin_upload(
                    db,
                    self.clock,
                    run=run,
                    kind=kind,
                    name=name,
                    artifact_uri=uri,
                    overwrite=overwrite,
                ).id
        except TreadleError as exc:
            raise Refused(OpFailure.of(exc)) from exc

    def weights(self, task: Task) -> Outcome:
        request = SaveWeightsRequest.model_validate_json(
            decode_payload(task.payload, task.payload_codec)
        )
        name = request.path or f"step-{task.seq_id}"
        _, register = self._write(
            task,
            "training",
            name,
            optimizer=True,
            ttl_seconds=request.ttl_seconds,
            overwrite=request.overwrite,
            user_metadata=request.user_metadata,
        )
        path = checkpoints.tinker_path(task.target_id, "training", name)
        return Outcome.json(
            SaveWeightsResponse(path=path), usage=[UsageLine("checkpoint", 1)], apply=register
        )

    def for_sampler(self, task: Task) -> Outcome:
        request = SaveWeightsForSamplerRequest.model_validate_json(
            decode_payload(task.payload, task.payload_codec)
        )
        if request.path is None and request.sampling_session_seq_id is None:
            raise ep.UserInputError(
                "save_weights_for_sampler needs a name (path) or a sampling_session_seq_id"
            )
        _, register = self._write(
            task,
            "sampler",
            request.path,
            optimizer=False,
            ttl_seconds=request.ttl_seconds,
            user_metadata=request.user_metadata,
        )
        if request.path is not None:
            path = checkpoints.tinker_path(task.target_id, "sampler", request.path)
            return Outcome.json(
                SaveWeightsForSamplerResponse(path=path),
                usage=[UsageLine("checkpoint", 1)],
                apply=register,
            )
        seq = request.sampling_session_seq_id
        assert seq is not None
        sampler_id = sampling_session_id(task.session_id, seq)

        def apply(db: OrmSession) -> None:
            version = register(db)
            runs.create_sampling_session(
                db,
                self.clock,
                tenant_id=task.tenant_id,
                session_id=task.session_id,
                seq=seq,
                base_model=task.base_model,
                model_path=None,
                training_run_id=task.target_id,
                model_version_id=version.id,
            )

        return Outcome.json(
            SaveWeightsForSamplerResponse(sampling_session_id=sampler_id),
            usage=[UsageLine("checkpoint", 1)],
            apply=apply,
        )

    def external(self, task: Task) -> Outcome:
        request = SaveWeightsExternalRequest.model_validate_json(
            decode_payload(task.payload, task.payload_codec)
        )
        if request.age_encryption_recipients:
            raise Refused(
                OpFailure.user(
                    "age encryption of exports is not supported; omit age_encryption_recipients",
                    ErrorCode.UNSUPPORTED,
                )
            )
        kind = "merged" if request.merged else "adapter"
        size, register = self._write(
            task,
            kind,
            request.path,
            optimizer=False,
            export=kind,
            ttl_seconds=request.ttl_seconds,
        )
        path = checkpoints.tinker_path(task.target_id, kind, request.path)
        return Outcome.json(
            SaveWeightsExternalResponse(path=path, size_bytes=size),
            usage=[UsageLine("checkpoint", 1)],
            apply=register,
        )
