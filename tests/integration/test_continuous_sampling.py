"""The worker host keeps one decode loop running: samples join and leave it between decode
steps, training ops run between them, and each result is recorded as soon as it is ready.

A real WorkerHost on the CPU engine (`treadle/tiny-1m`) and a migrated database, stepped by
hand so that what is in flight at each step is known. Every sample is seeded: run alone or
beside others it chooses the same tokens.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sqlalchemy import select

from core.objectstore import LocalArtifactStore
from core.tables import SamplingSession
from scheduler.notify import InProcessNotifier
from scheduler.ops import STREAMED, OpKind, encode_json_payload
from scheduler.submit import submit
from scheduler.worker.claimed import Task
from scheduler.worker.outcome import Outcome
from tests.scheduling import MODEL, Rows, cpu_engine, forward_backward_payload, migrated
from treadle.types import ModelInput, SampleRequest, SamplingParams
from treadle.wire import decode_forward_backward_output, decode_sample_response

if TYPE_CHECKING:
    from gpu_worker.engine import Engine
    from scheduler.worker.host import WorkerHost

pytestmark = pytest.mark.integration

LONG, SHORT = 64, 4
Progress = dict[int, tuple[int, list[int]]]


class RecordingNotifier(InProcessNotifier):
    """Keeps every publication in order: ("done", op) as an op is recorded or released,
    ("progress", op, progress) as a streamed op's tokens are chosen."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[Any, ...]] = []

    def publish(self, op_id: str) -> None:
        self.events.append(("done", op_id))
        super().publish(op_id)

    def publish_progress(self, op_id: str, progress: Progress) -> None:
        self.events.append(("progress", op_id, progress))

    def done(self) -> list[str]:
        return [event[1] for event in self.events if event[0] == "done"]

    def progress(self, op_id: str) -> list[Progress]:
        return [e[2] for e in self.events if e[0] == "progress" and e[1] == op_id]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return cpu_engine(tmp_path_factory.mktemp("engine"))


@pytest.fixture
def rows(database_url: str) -> Rows:
    return Rows(migrated(database_url))


@pytest.fixture
def notifier() -> RecordingNotifier:
    return RecordingNotifier()


@pytest.fixture
def host(rows: Rows, engine: Engine, notifier: RecordingNotifier, tmp_path: Path) -> WorkerHost:
    from scheduler.worker.host import WorkerHost

    host = WorkerHost(
        rows.database,
        rows.clock,
        engine,
        LocalArtifactStore(tmp_path / "artifacts"),
        notifier,
        claim_while_decoding_seconds=0.0,  # every step claims: tests count steps, not time
    )
    host.register([MODEL], host.store)
    return host


_seqs = itertools.count()


def _sample(
    rows: Rows,
    sampler_id: str,
    max_tokens: int,
    *,
    seed: int = 7,
    n: int = 1,
    streamed: bool = False,
) -> str:
    """Queue a seeded sample of the base model on `sampler_id`, as the API stores it."""
    seq = next(_seqs)
    request = SampleRequest(
        num_samples=n,
        prompt=ModelInput.from_ints([11, 12, 13, 14 + seq % 50]),
        sampling_params=SamplingParams(max_tokens=max_tokens, seed=seed, temperature=1.0),
        seq_id=seq,
    )
    body = request.model_dump(mode="json", exclude_none=True)
    if streamed:
        body[STREAMED] = True
    payload, codec = encode_json_payload(body)
    with rows.database.transaction() as db:
        tenant_id, session_id = db.execute(
            select(SamplingSession.tenant_id, SamplingSession.session_id).where(
                SamplingSession.id == sampler_id
            )
        ).one()
        return submit(
            db,
            rows.clock,
            tenant_id=tenant_id,
            session_id=session_id,
            target_id=sampler_id,
            seq_id=seq,
            kind=OpKind.SAMPLE,
            payload=payload,
            payload_codec=codec,
        ).request_id


def _tokens(rows: Rows, op_id: str) -> list[list[int]]:
    op = rows.op(op_id)
    assert op.status == "done", (op.status, op.error_message)
    assert op.result is not None
    return [list(s.tokens) for s in decode_sample_response(op.result).sequences]


def _twin(rows: Rows, sampler_id: str, op_id: str) -> str:
    """The same request again, as a new op (the next seq_id) on the same sampler."""
    op = rows.op(op_id)
    with rows.database.transaction() as db:
        return submit(
            db,
            rows.clock,
            tenant_id=op.tenant_id,
            session_id=op.session_id,
            target_id=sampler_id,
            seq_id=next(_seqs),
            kind=OpKind.SAMPLE,
            payload=op.payload,
            payload_codec=op.payload_codec,
        ).request_id


def _step_until(host: WorkerHost, done: Callable[[], bool], limit: int = 200) -> int:
    """Step until `done()`; returns the steps taken."""
    for steps in range(1, limit + 1):
        host.step()
        if done():
            return steps
    raise AssertionError(f"not done after {limit} steps")


def _loss(rows: Rows, op_id: str) -> float:
    op = rows.op(op_id)
    assert op.status == "done" and op.result is not None, op.error_message
    return decode_forward_backward_output(op.result).metrics["loss:sum"]


def test_a_short_sample_and_another_runs_training_op_finish_while_a_long_sample_decodes(
    rows: Rows, host: WorkerHost, notifier: RecordingNotifier
) -> None:
    tenant = rows.tenant()
    trained, twin = rows.run(tenant), rows.run(tenant)  # same seed: the same adapter
    sampler = rows.sampler(tenant)
    assert host.drain() == 2
    tokens = [(7 * i) % 200 + 10 for i in range(12)]

    # Alone, one after the other.
    long_alone = _sample(rows, sampler, LONG, seed=3)
    host.drain()
    short_alone = _sample(rows, sampler, SHORT, seed=4)
    host.drain()
    fb_alone = rows.training_op(
        twin, 1, OpKind.FORWARD_BACKWARD, forward_backward_payload(twin, 1, tokens)
    ).request_id
    host.drain()
    assert len(_tokens(rows, long_alone)[0]) == LONG  # it does not stop early

    # Together: the short sample and the training op arrive while the long sample decodes.
    long = _twin(rows, sampler, long_alone)
    assert host.step() == 1
    assert rows.op(long).status == "running"
    short = _twin(rows, sampler, short_alone)
    fb = rows.training_op(
        trained, 1, OpKind.FORWARD_BACKWARD, forward_backward_payload(trained, 1, tokens)
    ).request_id
    steps = _step_until(host, lambda: rows.op(short).status == "done")
    assert steps <= SHORT + 1
    assert rows.op(fb).status == "done"
    assert rows.op(long).status == "running"
    assert host.engine.sampling == 1
    host.drain()
    assert host.engine.sampling == 0

    recorded = [op for op in notifier.done() if op in (long, short, fb)]
    assert recorded == [fb, short, long]
    assert _tokens(rows, long) == _tokens(rows, long_alone)
    assert _tokens(rows, short) == _tokens(rows, short_alone)
    assert _loss(rows, fb) == pytest.approx(_loss(rows, fb_alone), rel=1e-6)


def test_a_step_that_fails_mid_decode_requeues_its_samples_and_they_complete_once(
    rows: Rows, host: WorkerHost, notifier: RecordingNotifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = rows.sampler(rows.tenant())
    long_alone = _sample(rows, sampler, LONG, seed=5)
    short_alone = _sample(rows, sampler, SHORT * 2, seed=6)
    host.drain()
    long, short = _twin(rows, sampler, long_alone), _twin(rows, sampler, short_alone)
    assert host.step() == 2  # both started, one token each
    assert host.engine.sampling == 2

    step = host.engine.sample_step
    calls = itertools.count()

    def faulty() -> list[Any]:
        if next(calls) == 1:
            raise RuntimeError("the device fell over")
        return step()

    monkeypatch.setattr(host.engine, "sample_step", faulty)
    recorded: Counter[str] = Counter()
    record = host._record

    def counted(task: Task, outcome: Outcome) -> Any:
        recorded[task.id] += 1
        return record(task, outcome)

    monkeypatch.setattr(host, "_record", counted)

    host.step()  # a good decode step
    host.step()  # the failing one: both go back to the queue, out of the loop
    assert host.engine.sampling == 0
    assert {rows.op(long).status, rows.op(short).status} == {"queued"}
    host.drain()
    assert recorded == {long: 1, short: 1}
    for op, alone in ((long, long_alone), (short, short_alone)):
        assert rows.op(op).attempts == 2
        assert _tokens(rows, op) == _tokens(rows, alone)
    assert host.engine.sampling == 0


def test_a_streamed_sample_publishes_its_tokens_as_chosen_and_an_unstreamed_one_nothing(
    rows: Rows, host: WorkerHost, notifier: RecordingNotifier
) -> None:
    sampler = rows.sampler(rows.tenant())
    host.samples.progress_every = 0.0  # every decode step, so that every path is taken
    streamed = _sample(rows, sampler, 24, seed=8, n=2, streamed=True)
    quiet = _sample(rows, sampler, 24, seed=9)
    host.drain()

    final = _tokens(rows, streamed)
    assert len(_tokens(rows, quiet)[0]) > 0
    assert notifier.progress(quiet) == []
    messages = notifier.progress(streamed)
    assert len(messages) > 1
    chosen: dict[int, list[int]] = {0: [], 1: []}
    for message in messages:
        for index, (offset, new) in message.items():
            assert offset == len(chosen[index])  # contiguous, nothing repeated
            assert new
            chosen[index] += new
    assert [chosen[0], chosen[1]] == final
    # Nothing after the op is recorded.
    last = max(i for i, e in enumerate(notifier.events) if e[0] == "progress")
    assert notifier.events.index(("done", streamed)) > last


def test_a_streamed_sample_publishes_at_most_once_per_interval(
    rows: Rows, host: WorkerHost, notifier: RecordingNotifier
) -> None:
    sampler = rows.sampler(rows.tenant())
    host.samples.progress_every = 3600.0
    streamed = _sample(rows, sampler, 24, seed=10, streamed=True)
    host.drain()
    # The first token at once, then nothing until the rest, just before the op is recorded.
    [tokens] = _tokens(rows, streamed)
    assert notifier.progress(streamed) == [{0: (0, tokens[:1])}, {0: (1, tokens[1:])}]


def test_an_interrupted_op_waits_for_the_loop_to_run_dry_then_runs_alone(
    rows: Rows, host: WorkerHost, notifier: RecordingNotifier, engine: Engine, tmp_path: Path
) -> None:
    from scheduler.worker.host import WorkerHost

    sampler = rows.sampler(rows.tenant())
    long = _sample(rows, sampler, LONG, seed=11)
    host.step()
    # Another worker claimed this one and restarted while running it: it was interrupted once.
    retried = _sample(rows, sampler, SHORT, seed=12)
    crashed = WorkerHost(
        rows.database,
        rows.clock,
        engine,
        LocalArtifactStore(tmp_path / "crashed"),
        notifier,
        worker_id="crashed",
    )
    crashed.register([MODEL], crashed.store)
    assert [task.id for task in crashed._claim()[0]] == [retried]
    crashed.register([MODEL], crashed.store)  # restarted: what it ran is queued again
    fresh = _sample(rows, sampler, SHORT, seed=13)

    _step_until(host, lambda: rows.op(long).status == "done")
    assert [rows.op(op).status for op in (retried, fresh)] == ["queued", "queued"]
    _step_until(host, lambda: rows.op(retried).status == "done")
    assert rows.op(fresh).status == "queued"  # nothing joined the retried op
    host.drain()
    assert [op for op in notifier.done() if op in (long, retried, fresh)] == [long, retried, fresh]
    assert rows.op(retried).attempts == 2


def test_a_host_that_stops_gives_its_samples_back_and_they_run_on_after_a_restart(
    rows: Rows, host: WorkerHost, notifier: RecordingNotifier, engine: Engine, tmp_path: Path
) -> None:
    from scheduler.worker.host import WorkerHost

    sampler = rows.sampler(rows.tenant())
    alone = [_sample(rows, sampler, LONG, seed=14), _sample(rows, sampler, SHORT, seed=15)]
    host.drain()
    again = [_twin(rows, sampler, op) for op in alone]
    host.step()
    host.close()
    assert engine.sampling == 0
    # A stop on purpose is no interrupted attempt: nothing makes them run alone afterwards.
    assert [(rows.op(op).status, rows.op(op).attempts) for op in again] == [("queued", 0)] * 2
    assert host.drain() == 0  # a closed host steps no more
    restarted = WorkerHost(
        rows.database, rows.clock, engine, LocalArtifactStore(tmp_path / "again"), notifier
    )
    restarted.register([MODEL], restarted.store)
    assert restarted.step() == 2  # claimed together again
    restarted.drain()
    for op, before in zip(again, alone, strict=True):
        assert _tokens(rows, op) == _tokens(rows, before)
        assert rows.op(op).attempts == 1


def test_a_stop_during_drain_under_steady_traffic_gives_back_the_samples_and_returns(
    rows: Rows, host: WorkerHost, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    sampler = rows.sampler(rows.tenant())
    step = host.step
    steps = itertools.count(1)

    def busy_step() -> int:
        # A new sample arrives at every step, so only the stop can end this drain.
        n = next(steps)
        if n > 50:
            raise AssertionError("drain() went on after the stop")
        if n == 4:
            host.stop()  # as the worker's shutdown signal does, while drain() steps
        _sample(rows, sampler, LONG, seed=16)
        return step()

    monkeypatch.setattr(host, "step", busy_step)
    host.drain()
    assert next(steps) == 5  # it returned after the step in progress
    assert engine.sampling == 0
    assert [(op.status, op.attempts) for op in rows.ops(sampler)] == [("queued", 0)] * 4


POISON_SEED = 99


def test_a_failing_decode_loop_requeues_its_samples_and_gives_up_on_the_poison_one_alone(
    rows: Rows, host: WorkerHost, notifier: RecordingNotifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpu_worker.sampling import Sampler

    sampler = rows.sampler(rows.tenant())
    alone = [_sample(rows, sampler, SHORT * 2, seed=seed) for seed in (21, 22)]
    host.drain()
    healthy = [_twin(rows, sampler, op) for op in alone]
    poison = _sample(rows, sampler, SHORT, seed=POISON_SEED)
    step = Sampler.step

    def fragile(self: Sampler) -> Any:  # any loop holding the poison request fails
        jobs = self._pending + [row.job for row in self._rows]
        if any(job.params.seed == POISON_SEED for job in jobs):
            raise RuntimeError("the poison request broke the loop")
        return step(self)

    monkeypatch.setattr(Sampler, "step", fragile)
    assert host.step() == 3  # all three start together; the loop fails at once
    assert [rows.op(op).status for op in (*healthy, poison)] == ["queued"] * 3
    host.drain()
    for op, before in zip(healthy, alone, strict=True):
        assert _tokens(rows, op) == _tokens(rows, before)
        assert rows.op(op).attempts == 2  # the failed loop, then alone
    failed = rows.op(poison)
    assert (failed.status, failed.attempts) == ("failed", host.max_attempts)
    assert "interrupted" in (failed.error_message or "")
    assert host.engine.sampling == 0


def test_a_failing_claim_leaves_the_samples_in_flight_decoding(
    rows: Rows,
    host: WorkerHost,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from sqlalchemy.exc import OperationalError

    sampler = rows.sampler(rows.tenant())
    decoding = _sample(rows, sampler, SHORT * 4, seed=23)
    host.step()
    waiting = _sample(rows, sampler, SHORT, seed=24)
    claim = host._claim

    def locked() -> Any:
        raise OperationalError("BEGIN IMMEDIATE", {}, Exception("database is locked"))

    monkeypatch.setattr(host, "_claim", locked)
    chosen = len(host.engine.sample_progress(decoding)[0])
    with caplog.at_level("WARNING", logger="scheduler.worker.host"):
        assert host.step() == 1
        assert host.step() == 1
    assert len(host.engine.sample_progress(decoding)[0]) == chosen + 2
    assert "database is locked" in caplog.text
    monkeypatch.setattr(host, "_claim", claim)
    host.drain()
    assert [rows.op(op).status for op in (decoding, waiting)] == ["done", "done"]


def test_while_samples_decode_claims_wait_their_interval_and_an_idle_host_claims_every_step(
    rows: Rows, host: WorkerHost
) -> None:
    sampler = rows.sampler(rows.tenant())
    host.claim_while_decoding = 3600.0
    decoding = _sample(rows, sampler, SHORT * 2, seed=25)
    assert host.step() == 1
    waiting = _sample(rows, sampler, SHORT, seed=26)
    for _ in range(3):
        host.step()
        assert rows.op(waiting).status == "queued"
    _step_until(host, lambda: rows.op(decoding).status == "done")
    host.step()  # nothing in flight: this one claims
    assert rows.op(waiting).status == "running"
    host.drain()
    assert rows.op(waiting).status == "done"


def test_a_sample_claimed_again_while_it_runs_here_finishes_once(
    rows: Rows, host: WorkerHost
) -> None:
    from scheduler import oplog

    sampler = rows.sampler(rows.tenant())
    alone = _sample(rows, sampler, SHORT * 4, seed=27)
    host.drain()
    again = _twin(rows, sampler, alone)
    host.step()
    with rows.database.transaction() as db:  # its claim was taken back meanwhile
        oplog.requeue(
            db,
            [again],
            worker_id=host.worker_id,
            max_attempts=3,
            now=rows.clock.now(),
            counted=False,
        )
    host.step()
    assert rows.op(again).status == "running" and host.samples.in_flight == 1
    _step_until(host, lambda: host.samples.in_flight == 0)
    assert _tokens(rows, again) == _tokens(rows, alone)
    assert host.engine.sampling == 0


def test_drain_frees_a_run_whose_session_ended_while_samples_decode(
    rows: Rows, host: WorkerHost, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from core import sessions
    from scheduler.worker import host as host_module

    tenant = rows.tenant()
    session = rows.session(tenant)
    ended = rows.run(tenant, session_id=session)
    sampler = rows.sampler(tenant)
    host.drain()
    assert ended in engine.run_ids()
    sample = _sample(rows, sampler, SHORT * 4, seed=28)
    host.step()
    with rows.database.transaction() as db:
        sessions.finish(
            db,
            rows.clock,
            tenant_id=tenant,
            session_id=session,
            reason="closed",
            detail=None,
            ttl_seconds=3600,
        )
    monkeypatch.setattr(host_module, "EVICT_EVERY_SECONDS", 0.0)  # between every two steps
    in_flight_when_freed: dict[str, int] = {}
    remove_run = engine.remove_run

    def watched(run_id: str) -> None:
        in_flight_when_freed[run_id] = host.samples.in_flight
        remove_run(run_id)

    monkeypatch.setattr(engine, "remove_run", watched)
    host.drain()
    assert rows.op(sample).status == "done"
    assert ended not in engine.run_ids()
    assert in_flight_when_freed[ended] == 1  # freed while the sample decoded, not after
