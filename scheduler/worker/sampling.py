"""Sample ops on the engine's decode loops: started as they are claimed, finished a decode step
at a time, so that a sample never waits for a whole batch and training ops run between steps.

What each in-flight op needs to be recorded (its wire request) is kept here until its job
finishes; the tokens of ops whose requester streams them are handed out as they are chosen.
Recording the outcomes and publishing the tokens are the worker host's.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from core import checkpoints, runs
from core.clock import Clock
from core.db import Database
from core.errors import ErrorCode, NotFound
from core.objectstore import ArtifactStore
from core.tables import ModelVersion, SamplingSession, Session, TrainingRun
from gpu_worker import protocol as ep
from scheduler import convert
from scheduler.failures import OpFailure, Refused
from scheduler.ops import PROTO, STREAMED, decode_json_payload
from scheduler.worker.claimed import Task
from scheduler.worker.execute import guarded, usage_lines
from scheduler.worker.outcome import Outcome
from treadle.types import SampleRequest

if TYPE_CHECKING:
    from gpu_worker.engine import Engine

log = logging.getLogger(__name__)

Progress = dict[int, tuple[int, list[int]]]
"""Sample index -> (offset of the first new token, the new tokens)."""

PROGRESS_EVERY_SECONDS = 0.1
"""How often a streamed op's new tokens are published at most: each publication is a message
to every API process, and a tenth of a second is smooth enough to read."""


@dataclasses.dataclass
class _InFlight:
    task: Task
    wire: SampleRequest
    streamed: bool
    published: dict[int, int] = dataclasses.field(default_factory=dict)
    """Tokens published so far, by sample index."""
    published_at: float = float("-inf")  # the first tokens go out at once

    def new_tokens(self, chosen: list[list[int]]) -> Progress:
        """The tokens of `chosen` (by sample index) not published yet, now counted as
        published."""
        new: Progress = {}
        for index, tokens in enumerate(chosen):
            offset = self.published.get(index, 0)
            if len(tokens) > offset:
                new[index] = (offset, tokens[offset:])
                self.published[index] = len(tokens)
        return new


@dataclasses.dataclass
class Decoded:
    """What one decode step ended."""

    finished: list[tuple[Task, Outcome, Progress]]
    """Each with its outcome and, when streamed, the tokens not yet published (so the stream
    is whole before the op is recorded)."""
    interrupted: list[Task]
    """Dropped because their decode loop failed: to be queued again, not failed, since the
    fault may be any job of the loop."""


class SampleJobs:
    def __init__(
        self,
        engine: Engine,
        store: ArtifactStore,
        database: Database,
        clock: Clock,
        *,
        progress_every_seconds: float = PROGRESS_EVERY_SECONDS,
    ) -> None:
        self.engine = engine
        self.store = store
        self.database = database
        self.clock = clock
        self.progress_every = progress_every_seconds
        self._in_flight: dict[str, _InFlight] = {}

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def running(self, op_id: str) -> bool:
        return op_id in self._in_flight

    def start(
        self, tasks: list[Task], restore: Callable[[str], Outcome | None] | None = None
    ) -> dict[str, Outcome]:
        """Start `tasks` on the engine's decode loops; returns the outcomes of those refused at
        once. `restore` brings a live sample's training run into the engine when it is not
        there (the host's recovery); without it such a sample fails. A task already in flight
        here is left to the job running it."""
        outcomes: dict[str, Outcome] = {}
        revoked = self._revoked(tasks)
        for task in tasks:
            if task.id in self._in_flight:
                # Claimed again while it runs here (its claim was taken back meanwhile): the job in
                # flight records it; a second one under its key would be refused by the engine.
                log.warning(
                    "sample %s is already running here; its second claim is ignored", task.id
                )
                continue
            try:
                if task.id in revoked:
                    raise Refused(revoked[task.id])
                if task.live_run_id is not None and restore is not None:
                    lost = restore(task.live_run_id)
                    if lost is not None:
                        outcomes[task.id] = lost
                        continue
                payload = decode_json_payload(task.payload, task.payload_codec)
                streamed = payload.pop(STREAMED, False) is True
                wire = SampleRequest.model_validate(payload)
                request = convert.sample_request(
                    wire, run_id=self._sampler_run(task), base_model=task.base_model
                )
                refused = self._start(task.id, request)
                if refused is not None:
                    outcomes[task.id] = Outcome.failed(OpFailure.of_engine(refused))
                    continue
                self._in_flight[task.id] = _InFlight(task, wire, streamed)
            except ep.UserInputError as exc:
                outcomes[task.id] = Outcome.failed(OpFailure.of_input(exc))
            except Refused as exc:
                outcomes[task.id] = Outcome.failed(exc.failure)
            except Exception as exc:
                log.exception("preparing sample %s failed", task.id)
                outcomes[task.id] = Outcome.failed(
                    OpFailure.server(f"sampling failed on the server ({type(exc).__name__}); retry")
                )
        return outcomes

    def _start(self, key: str, request: ep.SampleRequest) -> ep.OpError | None:
        try:
            return self.engine.sample_start(key, request)
        except Exception:
            # Whatever part of the job joined a loop must not decode for an op failed here.
            self.engine.sample_abort([key])
            raise

    def step(self) -> Decoded:
        """One decode step of every loop; the ops that finished or were interrupted in it."""
        decoded = Decoded([], [])
        for key, result in self.engine.sample_step():
            job = self._in_flight.pop(key, None)
            if job is None:
                log.error("the engine finished sample %s, which this worker does not run", key)
                continue
            task, wire = job.task, job.wire
            rest: Progress = {}
            if isinstance(result, ep.OpError) and result.interrupted:
                decoded.interrupted.append(task)
                continue
            if isinstance(result, ep.OpError):
                outcome = Outcome.failed(OpFailure.of_engine(result))
            else:
                outcome = guarded(
                    task,
                    lambda r=result, w=wire: Outcome(  # type: ignore[misc]
                        result=convert.sample_output(w, r),
                        codec=PROTO,
                        usage=usage_lines(r.usage),
                    ),
                )
                if job.streamed:
                    rest = job.new_tokens([list(s.tokens) for s in result.sequences])
            decoded.finished.append((task, outcome, rest))
        return decoded

    def progress(self) -> list[tuple[str, Progress]]:
        """The tokens chosen since their last publication, of each streamed op in flight whose
        last publication is at least `progress_every_seconds` old."""
        now = time.monotonic()
        due = []
        for key, job in self._in_flight.items():
            if not job.streamed or now - job.published_at < self.progress_every:
                continue
            new = job.new_tokens(self.engine.sample_progress(key))
            if new:
                job.published_at = now
                due.append((key, new))
        return due

    def abort(self) -> None:
        """Drop every job in flight (their ops are requeued or failed by the caller)."""
        self._in_flight.clear()
        self.engine.sample_abort()

    def _revoked(self, tasks: list[Task]) -> dict[str, OpFailure]:
        """Why each sample on saved weights or a live run may no longer run, by task id (one
        or two reads per batch).

        The API checked access when it accepted the request, but the checkpoint may have been
        deleted or unpublished since, and weights already loaded here must not outlive that; a
        live run may have been unloaded, or its session ended, since.
        """
        on_weights = {t.target_id for t in tasks if t.sampler_version_id is not None}
        live_runs = {t.live_run_id for t in tasks if t.live_run_id is not None}
        if not on_weights and not live_runs:
            return {}
        revoked: dict[str, OpFailure] = {}
        with self.database.reader() as db:
            if live_runs:
                revoked.update(_live_refusals(db, tasks, live_runs))
            if not on_weights:
                return revoked
            rows = db.execute(
                select(SamplingSession.id, SamplingSession.model_path, ModelVersion)
                .outerjoin(ModelVersion, ModelVersion.id == SamplingSession.model_version_id)
                .where(SamplingSession.id.in_(on_weights))
            ).all()
            found = {sampler_id: (path, version) for sampler_id, path, version in rows}
            for task in tasks:
                if task.target_id not in on_weights:
                    continue
                path, version = found.get(task.target_id, (None, None))
                try:
                    checkpoints.require_sampleable(version, task.tenant_id, self.clock, path)
                except NotFound as exc:
                    revoked[task.id] = OpFailure.of(exc)
        return revoked

    def _sampler_run(self, task: Task) -> str | None:
        """The engine run holding the sampler's weights, loaded on first use (a live sampler's:
        its training run's); None = base model."""
        if task.live_run_id is not None:
            return task.live_run_id
        if task.sampler_version_id is None:
            return None
        run_id = f"sampler:{task.sampler_version_id}"
        if run_id not in self.engine.run_ids():
            with self.database.reader() as db:
                version = db.get(ModelVersion, task.sampler_version_id)
                uri = version.artifact_uri if version is not None else None
            if uri is None:
                raise Refused(
                    OpFailure.user(
                        "the weights of this sampling session were deleted; create a new "
                        "sampling client",
                        ErrorCode.NOT_FOUND,
                    )
                )
            self.engine.load_state(run_id, self.store.open_dir(uri), include_optimizer=False)
        return run_id


def _live_refusals(db: OrmSession, tasks: list[Task], run_ids: set[str]) -> dict[str, OpFailure]:
    """Why each live sample may no longer run, by task id: its run ended (unloaded, failed,
    its session ended) since the API accepted the request."""
    rows = db.execute(
        select(TrainingRun, Session.status)
        .outerjoin(Session, Session.id == TrainingRun.session_id)
        .where(TrainingRun.id.in_(run_ids))
    ).all()
    found = {run.id: (run, status) for run, status in rows}
    refused: dict[str, OpFailure] = {}
    for task in tasks:
        if task.live_run_id is None:
            continue
        run, status = found.get(task.live_run_id, (None, None))
        reason = (
            f"training run {task.live_run_id} no longer exists; sample a live run"
            if run is None
            else runs.live_refusal(run, status)
        )
        if reason is not None:
            refused[task.id] = OpFailure.user(reason)
    return refused
