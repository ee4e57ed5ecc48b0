"""The worker host: runs queued operations on an Engine and records their results.

It is the only part of the scheduler that imports the engine. Each `step()` claims what is
ready — for every training run the op whose seq_id comes next, and as many pending samples as
the decode loops have room for — executes the training ops (forward_backward ops of different
runs together, as one multi-LoRA pass), starts the samples on the engine's decode loops, and
runs one decode step of every loop (while samples decode, it looks for new work at most every
CLAIM_WHILE_DECODING_SECONDS). Each result is recorded with its usage in one transaction
as it is ready: a training op's in its step, a sample's in the step its last token is chosen.
So samples join and leave the loops between decode steps, and neither a new sample nor another
run's training op waits for a long sample to end. Waiters are then woken through the notifier.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
from datetime import timedelta

from sqlalchemy import select

from billing.ledger import record_usage
from billing.prices import PriceCache
from core import checkpoints, runs
from core.clock import Clock
from core.db import Database
from core.errors import TreadleError
from core.objectstore import ArtifactStore
from core.settings import Settings
from core.tables import (
    ModelVersion,
    Operation,
    SamplingSession,
    Session,
    SessionStatus,
    TrainingRun,
    WorkerStatus,
)
from gpu_worker.catalog import Catalog
from gpu_worker.engine import Engine, EngineSettings
from scheduler import metrics, oplog, workers
from scheduler.failures import OpFailure
from scheduler.notify import Notifier
from scheduler.ops import OpKind
from scheduler.served import tokenizer_key
from scheduler.worker import handover, op_lines
from scheduler.worker.claimed import Task
from scheduler.worker.execute import Executor, failed_forward_backwards
from scheduler.worker.outcome import Outcome
from scheduler.worker.recovery import RestoreImpossible, restore_run
from scheduler.worker.sampling import SampleJobs
from treadle.types.tokenizer_files import TOKENIZER_FILES
from treadle.wire import DEFAULT_MAX_BODY_BYTES

log = logging.getLogger(__name__)


def build_engine(
    settings: Settings, preload: list[str] | None = None, *, shard_base: bool = False
) -> Engine:
    """The engine for these settings; `preload` models are loaded now rather than on first use.
    With `shard_base` (a worker group's ranks alone) the base weights are sharded over the
    group and only the `preload` models are served."""
    return Engine(
        EngineSettings(
            shard_base=shard_base,
            device=settings.device,
            precision=settings.precision,
            num_threads=settings.torch_threads,
            max_lora_rank=settings.engine_max_lora_rank,
            aliases=dict(settings.model_aliases),
            models=tuple(preload or ()),
            catalog_entries=tuple(
                Catalog.hf_folder(name, path, devices=settings.model_devices.get(name, 1))
                for name, path in settings.model_folders.items()
            ),
        )
    )


def start_host(
    settings: Settings,
    database: Database,
    clock: Clock,
    store: ArtifactStore,
    notifier: Notifier,
    *,
    worker_id: str,
    models: list[str],
    distributed: bool,
    engine: Engine | None = None,
    group_size: int = 1,
) -> WorkerHost:
    """The engine and its host for one process, registered as worker `worker_id`.

    A distributed worker loads its models now and runs only the runs placed on it; the
    embedded engine loads each model on first use (the server starts at once) and runs all.
    `engine` is one built already, with `models` loaded (a worker group's of `group_size`
    ranks).
    """
    host = WorkerHost(
        database,
        clock,
        engine
        if engine is not None
        else build_engine(settings, preload=models if distributed else None),
        store,
        notifier,
        worker_id=worker_id,
        gap_timeout_seconds=settings.gap_timeout_seconds,
        snapshot_every_steps=settings.snapshot_every_steps,
        max_attempts=settings.max_op_attempts,
        max_request_bytes=settings.max_request_bytes,
        owned_only=distributed,
        lease_seconds=settings.worker_lease_seconds,
    )
    host.register(models, store, group_size=group_size)
    return host


# How often the engine looks for runs whose sessions ended, to free their memory.
EVICT_EVERY_SECONDS = 15.0

# How often a host with samples in flight looks for work between its decode steps. Each look is
# a read and, when anything is queued anywhere (other workers' ops, samples beyond this host's
# room), a write transaction; at every decode step (milliseconds) that loads the database for
# nothing, and 20 ms delays a newcomer by about one decode step.
CLAIM_WHILE_DECODING_SECONDS = 0.02

# How often a failing claim (e.g. a locked database) is logged at most while decoding goes on.
CLAIM_WARNING_EVERY_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class SnapshotDue:
    """A run's state is to be saved after the op just recorded; `previous` is then deleted."""

    previous: str | None


class WorkerHost:
    def __init__(
        self,
        database: Database,
        clock: Clock,
        engine: Engine,
        store: ArtifactStore,
        notifier: Notifier,
        *,
        worker_id: str = "embedded",
        gap_timeout_seconds: float = 120.0,
        max_sample_batch: int = 64,
        snapshot_every_steps: int = 10,
        owned_only: bool = False,
        lease_seconds: float = 15.0,
        max_attempts: int = 3,
        max_request_bytes: int = DEFAULT_MAX_BODY_BYTES,
        claim_while_decoding_seconds: float = CLAIM_WHILE_DECODING_SECONDS,
    ) -> None:
        self.database = database
        self.clock = clock
        self.engine = engine
        self.notifier = notifier
        self.worker_id = worker_id
        self.gap_timeout = timedelta(seconds=gap_timeout_seconds)
        self.store = store
        self.snapshot_every_steps = snapshot_every_steps
        # Distributed workers run only the runs and samplers placed on them; the embedded one
        # runs everything.
        self.owned_only = owned_only
        self.lease = timedelta(seconds=lease_seconds)
        self.max_attempts = max_attempts
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._gaps_checked_at = 0.0
        self._evicted_at = time.monotonic()
        self.claim_while_decoding = claim_while_decoding_seconds
        self._claimed_at = float("-inf")
        self._claim_warned_at = float("-inf")
        # Claimed and not yet recorded: the current step's ops, and the samples in flight.
        self._unrecorded: dict[str, Task] = {}
        # An op claimed again after an interruption, while it is in flight: nothing joins it.
        self._alone: str | None = None
        self.prices = PriceCache(clock)
        self.executor = Executor(
            engine, store, database, clock, max_request_bytes=max_request_bytes
        )
        self.samples = SampleJobs(engine, store, database, clock)
        self.max_sample_batch = max_sample_batch
        self._ready = oplog.ReadyQueries.build(worker_id if owned_only else None)

    # --- start-up -------------------------------------------------------------------------

    def register(self, models: list[str], store: ArtifactStore, group_size: int = 1) -> None:
        """Record this worker and what it serves; requeue ops a previous life left running.

        Each model's tokenizer files are published to the artifact store, from where the API
        serves them to clients (which then never need the Hugging Face hub).
        """
        infos = [self.engine.catalog.info(name) for name in models]
        # Per unit of LoRA rank, so the API can size a tenant's adapters without torch.
        lora_sizes = {name: self.engine.catalog.lora_parameters_per_rank(name) for name in models}
        for name in models:
            folder = store.local_dir(tokenizer_key(name))
            for file in self.engine.tokenizer_dir(name).iterdir():
                if file.is_file() and file.name in TOKENIZER_FILES:
                    shutil.copy2(file, folder / file.name)
            store.publish(tokenizer_key(name))
        now = self.clock.now()
        served = [
            {
                "name": name,
                "max_context_length": info.max_context_length,
                "vocab_size": info.vocab_size,
                "lora_parameters_per_rank": lora_sizes[name],
                "devices": self.engine.catalog.resolve(name).devices,
            }
            for name, info in zip(models, infos, strict=True)
        ]
        with self.database.transaction() as db:
            workers.register(
                db,
                self.worker_id,
                device=str(self.engine.device),
                models=served,
                lease_until=now + self.lease,
                now=now,
                group_size=group_size,
            )
            # Whatever this worker was running when it last stopped never finished: run it again.
            oplog.requeue_held_by(db, [self.worker_id])

    def renew_lease(self) -> WorkerStatus | None:
        """Extend this worker's lease and report what it holds; returns its status as
        `workers.renew` does (draining: asked to stop and hand its runs over; dead: it must
        stop)."""
        held = self.engine.run_ids()
        held_bytes = self.engine.frozen_memory_bytes()
        for run_id in held:
            try:
                held_bytes += self.engine.run_memory_bytes(run_id)
            except Exception:  # removed meanwhile
                continue
        with self.database.transaction() as db:
            return workers.renew(
                db,
                self.worker_id,
                lease_until=self.clock.now() + self.lease,
                held_runs=len(held),
                adapter_bytes=held_bytes,
            )

    def drain(self) -> int:
        """Step until nothing is ready or in flight; safe to call from several threads.

        Between steps it frees the runs whose sessions ended, every EVICT_EVERY_SECONDS
        (samples may keep it stepping for hours). Once `stop` is called it returns after the
        current step, giving back what is in flight.
        """
        total = 0
        with self._lock:
            while not self._closing.is_set():
                self._evict_when_due()
                done = self.step()
                if not done:
                    break
                total += done
            if self._closing.is_set() and self._unrecorded:
                self._release(counted=False)
        return total

    def stop(self) -> None:
        """Stop claiming and stepping: a `drain` in progress gives back what is in flight and
        returns after its current step. Only sets a flag, so a signal handler may call it."""
        self._closing.set()

    def close(self) -> None:
        """Stop stepping (after the current step) and give back what is in flight: its samples
        leave the decode loops and their ops are queued again for whichever worker runs next,
        without counting as an attempt (a stop on purpose interrupted nothing of theirs)."""
        self.stop()
        with self._lock:
            if self._unrecorded:
                self._release(counted=False)

    def hand_over(self, settings: Settings) -> dict[str, set[str]] | None:
        """Leave on purpose (`scheduler.worker.handover`): after `close`, save the runs held
        here and hand them over; returns worker id → targets to wake it for, or None when beat
        declared this worker dead first."""
        self.close()
        with self._lock:
            saved = handover.save_quiet_runs(
                self.engine,
                self.executor,
                self.store,
                self.database,
                self.clock,
                self.worker_id,
            )
            wake = handover.leave(self.database, self.clock, settings, self.worker_id)
        if wake is None:
            log.error(
                "worker %s was declared dead while leaving: beat moves its runs (%d saved)",
                self.worker_id,
                saved,
            )
        return wake

    def _evict_when_due(self) -> None:
        """`evict_ended` if EVICT_EVERY_SECONDS have passed since it last ran; the caller holds
        the step lock."""
        if time.monotonic() - self._evicted_at < EVICT_EVERY_SECONDS:
            return
        self._evicted_at = time.monotonic()
        try:
            self._evict_ended()
        except Exception:
            # Like a failed claim, it must not stop the samples in flight: try at the next turn.
            log.exception("freeing the runs whose sessions ended failed; retrying later")

    def evict_ended(self) -> list[str]:
        """Drop runs and samplers whose session ended or that moved away, freeing their memory.

        Sampler weights stay only while an open session may still sample them: once their
        checkpoint is deleted, expired, or unpublished with only other tenants' sessions on it,
        they go too.
        """
        with self._lock:
            return self._evict_ended()

    def _evict_ended(self) -> list[str]:
        held = self.engine.run_ids()
        if not held:
            return []
        with self.database.reader() as db:
            keep = set(
                db.scalars(
                    select(TrainingRun.id)
                    .join(Session, Session.id == TrainingRun.session_id)
                    .where(
                        TrainingRun.id.in_(held),
                        Session.status == SessionStatus.ACTIVE,
                        TrainingRun.status.in_(runs.HOLDING),
                        *((TrainingRun.worker_id == self.worker_id,) if self.owned_only else ()),
                    )
                )
            )
            samplers = set(
                db.scalars(
                    select(SamplingSession.model_version_id)
                    .join(Session, Session.id == SamplingSession.session_id)
                    .join(ModelVersion, ModelVersion.id == SamplingSession.model_version_id)
                    .where(
                        Session.status == SessionStatus.ACTIVE,
                        checkpoints.sampleable_by(SamplingSession.tenant_id, self.clock.now()),
                    )
                )
            )
        keep |= {f"sampler:{version}" for version in samplers}
        dropped = [run_id for run_id in held if run_id not in keep]
        for run_id in dropped:
            self.engine.remove_run(run_id)
        if dropped:
            log.info("freed %d runs whose sessions ended", len(dropped))
        return dropped

    # --- the loop body --------------------------------------------------------------------

    def step(self) -> int:
        """Execute everything ready now (while samples are in flight, claiming at most every
        `claim_while_decoding` seconds) and one decode step of the samples in flight; returns
        how many operations it claimed, and at least 1 while samples are in flight or when one
        finished (then `drain` goes on: what waited for the loops to run dry may be claimable).

        Every op is executed under its own guard, so one op's failure is that op's alone. A
        step that still fails as a whole (a fault outside any op's guard) drops the samples in
        flight and releases what was claimed and not recorded: each such op is queued again —
        and then claimed alone, so that it cannot take batch-mates down with it twice — or,
        once it has been tried `max_attempts` times, failed for good.
        """
        # A failed step's or interrupted samples' ops that could not be queued again then.
        stale = [t for t in self._unrecorded.values() if not self.samples.running(t.id)]
        if stale:
            self._requeue(stale, counted=True)
        tasks, given_up = self._claim_when_due()
        self._unrecorded.update((task.id, task) for task in tasks)
        decoded = 0
        try:
            self._execute(tasks)
            if self.samples.in_flight:
                decoded = self._decode()
        except Exception:
            log.exception(
                "an engine step failed; releasing its %d operations", len(self._unrecorded)
            )
            self._forget_unrecorded_runs()
            self._release(counted=True)
        return max(len(tasks) + given_up, 1 if self.samples.in_flight or decoded else 0)

    def _execute(self, tasks: list[Task]) -> None:
        """Run the training ops and record them; start the samples (recording those refused)."""
        outcomes: dict[str, Outcome] = {}
        training = []
        for task in tasks:
            if task.kind is OpKind.SAMPLE:
                continue
            lost = self._ensure_loaded(task)
            if lost is None:
                training.append(task)
            else:
                outcomes[task.id] = lost
        batchable = [t for t in training if t.kind is OpKind.FORWARD_BACKWARD]
        outcomes.update(self.executor.forward_backward(batchable))
        for task in training:
            if task.kind is not OpKind.FORWARD_BACKWARD:
                outcomes[task.id] = self.executor.run(task)
        # A live sample needs its run here (after a restart or a failover its training ops may
        # not have restored it yet); the run's own ops of this step ran just above.
        samples = [t for t in tasks if t.kind is OpKind.SAMPLE]
        outcomes.update(self.samples.start(samples, restore=self._restore))
        for task in tasks:
            if task.id not in outcomes:
                continue  # a sample now in flight
            due = self._record(task, outcomes[task.id])
            if due is not None:
                self._snapshot(task, due)

    def _decode(self) -> int:
        """One decode step: record the samples it finished, queue again those its failed loops
        interrupted (counted as attempts: one of them may be the fault, and it is then claimed
        alone, or given up), publish the others' new tokens; returns how many ended."""
        decoded = self.samples.step()
        for task, outcome, rest in decoded.finished:
            if rest:
                self.notifier.publish_progress(task.id, rest)
            self._record(task, outcome)
        if decoded.interrupted:
            self._requeue(decoded.interrupted, counted=True)
        for op_id, progress in self.samples.progress():
            self.notifier.publish_progress(op_id, progress)
        return len(decoded.finished) + len(decoded.interrupted)

    def _forget_unrecorded_runs(self) -> None:
        """Drop from the engine the training runs of a failed step's unrecorded ops: the engine
        may have applied an op whose result was never recorded, and running it again on that
        state would apply it twice. Their next op restores them from the op log instead."""
        for run_id in {
            t.target_id for t in self._unrecorded.values() if t.kind is not OpKind.SAMPLE
        }:
            try:
                if run_id in self.engine.run_ids():
                    self.engine.remove_run(run_id)
            except Exception:
                log.exception("could not drop %s from the engine after a failed step", run_id)

    def _release(self, *, counted: bool) -> None:
        """Drop the samples in flight from the decode loops and queue every claimed but
        unrecorded op again (they start over); `counted` as in `oplog.requeue`."""
        self.samples.abort()
        self._requeue(list(self._unrecorded.values()), counted=counted)

    def _requeue(self, tasks: list[Task], *, counted: bool) -> None:
        """Queue `tasks` again, or give up on those tried too often. If the database refuses,
        they stay claimed and unrecorded, and the next step tries again."""
        try:
            with self.database.transaction() as db:
                given_up = oplog.requeue(
                    db,
                    [task.id for task in tasks],
                    worker_id=self.worker_id,
                    max_attempts=self.max_attempts,
                    now=self.clock.now(),
                    counted=counted,
                )
                gave_up = [op_lines.GivenUp.of(op) for op in given_up]
        except Exception:
            log.exception("could not release %d operations; retrying at the next step", len(tasks))
            return
        for given in gave_up:
            metrics.observe_recorded(given.recorded)
            op_lines.log_given_up(given, self.worker_id)
        for task in tasks:
            self._unrecorded.pop(task.id, None)
            self.notifier.publish(task.id)

    def _ensure_loaded(self, task: Task) -> Outcome | None:
        """Restore a run this engine does not hold; a failure outcome if that is impossible."""
        if task.seq_id == 0:
            return None
        return self._restore(task.target_id)

    def _restore(self, run_id: str) -> Outcome | None:
        """Restore training run `run_id` unless this engine holds it; a failure outcome if that
        is impossible."""
        if run_id in self.engine.run_ids():
            return None
        try:
            restore_run(self.engine, self.store, self.database, self.executor, run_id)
        except RestoreImpossible as exc:
            self._fail_run(run_id, str(exc))
            return Outcome.failed(OpFailure.server(str(exc)))
        except Exception as exc:
            log.exception("restoring %s failed", run_id)
            return Outcome.failed(
                OpFailure.server(
                    f"restoring training run {run_id} failed ({exc}); "
                    "create a new training client from your last checkpoint"
                )
            )
        return None

    def _fail_run(self, run_id: str, reason: str) -> None:
        """Mark a run that can never be restored failed, so that its session's next requests
        on it are refused at once rather than queued to fail the same way. Its ops already
        queued fail as this one did, each trying the restore again."""
        log.error("training run %s failed: %s", run_id, reason)
        try:
            with self.database.transaction() as db:
                run = db.get(TrainingRun, run_id)
                if run is not None:
                    runs.fail(run)
        except Exception:
            # Its requests still fail one by one; marking it is tried again at the next one.
            log.exception("could not mark training run %s failed", run_id)

    def _snapshot(self, task: Task, due: SnapshotDue) -> None:
        """Save the run's state after this optimizer step, so recovery replays only a little."""
        assert task.seq_id is not None
        try:
            uri = self.executor.snapshot(task.tenant_id, task.target_id, task.seq_id)
        except Exception:
            log.exception(
                "snapshot of %s failed; recovery will replay from the previous one", task.target_id
            )
            return
        with self.database.transaction() as db:
            run = db.get(TrainingRun, task.target_id)
            if run is not None:
                runs.record_snapshot(run, task.seq_id, uri)
        if due.previous is not None and due.previous != uri:
            self.store.delete(due.previous)

    def _claim_when_due(self) -> tuple[list[Task], int]:
        """`_claim`, unless an op claimed alone is in flight, or samples are in flight and the
        last claim is under `claim_while_decoding` seconds old. A claim that fails claimed
        nothing: the samples in flight go on decoding."""
        if self._alone in self._unrecorded:
            return [], 0
        now = time.monotonic()
        if self.samples.in_flight and now - self._claimed_at < self.claim_while_decoding:
            return [], 0
        self._claimed_at = now
        try:
            return self._claim()
        except Exception as exc:
            if now - self._claim_warned_at >= CLAIM_WARNING_EVERY_SECONDS:
                self._claim_warned_at = now
                log.warning("claiming work failed (%s: %s); retrying", type(exc).__name__, exc)
            return [], 0

    def _claim(self) -> tuple[list[Task], int]:
        """Claim what is ready; also returns how many ops it gave up on instead."""
        # Look before taking the write lock: an idle engine must not contend with the API's
        # writes (on SQLite a contended BEGIN IMMEDIATE sleeps in the busy handler).
        # A plain connection, no ORM session: this runs twice per op, once finding nothing.
        with self.database.rows() as connection:
            training, samples = connection.execute(oplog.QUEUED_WORK).one()
        if not training and not samples:
            return [], 0
        now = self.clock.now()
        with self.database.transaction() as db:
            # Gaps are given up after minutes: looking for them once a second is plenty.
            if time.monotonic() - self._gaps_checked_at >= 1.0:
                self._gaps_checked_at = time.monotonic()
                oplog.release_gaps(db, now, self.gap_timeout)
            ready, given_up = oplog.claim(
                db,
                self._ready,
                worker_id=self.worker_id,
                now=now,
                max_attempts=self.max_attempts,
                # Samples queued since the look above wait for the wake-up their submission sends.
                max_samples=max(self.max_sample_batch - self.engine.sampling, 0) if samples else 0,
                busy=self.samples.in_flight > 0,
                training=training,
            )
            tasks = []
            for r in ready:
                failed = None
                if r.op.kind == OpKind.OPTIM_STEP.value:
                    # Every earlier op of the run is recorded by now: the step's window is whole.
                    failed = failed_forward_backwards(
                        db, r.op.target_id, r.op.seq_id, self.executor.max_request_bytes
                    )
                tasks.append(
                    Task.of(r.op, r.base_model, r.sampler_version_id, failed, r.live_run_id)
                )
                if r.op.attempts > 1:
                    self._alone = r.op.id
            gave_up = [op_lines.GivenUp.of(op) for op in given_up]
        for given in gave_up:
            metrics.observe_recorded(given.recorded)
            op_lines.log_given_up(given, self.worker_id)
        for op in given_up:
            self.notifier.publish(op.id)
        return tasks, len(given_up)

    def _record(self, task: Task, outcome: Outcome) -> SnapshotDue | None:
        try:
            stored = self._store(task, outcome)
        except TreadleError as exc:
            # The engine work succeeded but its bookkeeping was refused (e.g. a checkpoint name
            # taken meanwhile): report it as the op's error, leaving the rest unchanged.
            outcome = Outcome.failed(OpFailure.of(exc))
            stored = self._store(task, outcome)
        self._unrecorded.pop(task.id, None)
        # The client waits on this: wake it before counting and logging.
        self.notifier.publish(task.id)
        if stored is None:
            return None  # already recorded (a redelivery): counted and logged then
        recorded, due = stored
        # Once committed: a record rolled back is made again (or never) and counted then.
        metrics.observe_recorded(recorded)
        op_lines.log_recorded(task, recorded, outcome.error, self.worker_id)
        return due

    def _store(
        self, task: Task, outcome: Outcome
    ) -> tuple[metrics.RecordedOp, SnapshotDue | None] | None:
        """Record the outcome, its usage and the run's progress in one transaction; returns
        what the metrics count of it and whether the run's state is due for a snapshot (every
        few successful optimizer steps), or None when it was already recorded."""
        now = self.clock.now()
        op: Operation | oplog.Finished | None
        with self.database.transaction() as db:
            if outcome.error is not None:
                op = oplog.fail(db, task.id, now, outcome.error)
                if op is None:
                    return None  # already recorded (a redelivery); never record twice
            else:
                op = oplog.finish(db, task.id, now, outcome.result, outcome.codec)
                if op is None:
                    return None
                if outcome.apply is not None:
                    outcome.apply(db)
                record_usage(
                    db,
                    self.clock,
                    tenant_id=task.tenant_id,
                    api_key_id=task.api_key_id,
                    session_id=task.session_id,
                    operation_id=task.id,
                    base_model=task.base_model,
                    lines=outcome.usage,
                    rates=self.prices,
                )
            recorded = metrics.RecordedOp.of(op, outcome.usage if outcome.error is None else ())
            advanced = oplog.advance_run(
                db,
                task.kind,
                task.target_id,
                task.seq_id,
                now,
                outcome.progress if outcome.error is None else runs.NO_PROGRESS,
            )
            stepped = task.kind is OpKind.OPTIM_STEP and outcome.error is None
            due = None
            if (
                advanced is not None
                and stepped
                and not advanced.optim_steps % self.snapshot_every_steps
            ):
                due = SnapshotDue(previous=advanced.snapshot_uri)
        return recorded, due
