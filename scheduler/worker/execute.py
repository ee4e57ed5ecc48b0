"""What each operation kind does on the engine, and what it leaves to record (an `Outcome`).

Saves are in `saves`, samples in `sampling`; the failed-gradient window of an optimizer step is
decided here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pydantic import ValidationError
from sqlalchemy import BindParameter, Select, bindparam, func, select
from sqlalchemy.orm import Session as OrmSession

from billing.ledger import UsageLine
from core import checkpoints, runs
from core.clock import Clock
from core.db import Database
from core.objectstore import ArtifactStore
from core.tables import (
    ModelVersion,
    Operation,
    OpStatus,
    TrainingRun,
)
from gpu_worker import protocol as ep
from scheduler import convert, fb_proto
from scheduler.failures import OpFailure, Refused
from scheduler.ops import (
    JSON_ZSTD,
    PROTO,
    OpKind,
    decode_json_payload,
    decode_payload,
    refusal_of,
)
from scheduler.worker.claimed import FailedForwardBackward, Task
from scheduler.worker.outcome import Outcome
from scheduler.worker.saves import Saves
from treadle.proto import treadle_wire_pb2 as pb
from treadle.types import (
    CreateModelResponse,
    LoadWeightsResponse,
    OptimStepRequest,
    OptimStepResponse,
    UnloadModelResponse,
)
from treadle.wire import DEFAULT_MAX_BODY_BYTES, WireFormatError

if TYPE_CHECKING:
    from gpu_worker.engine import Engine

log = logging.getLogger(__name__)


def usage_lines(usage: ep.Usage) -> list[UsageLine]:
    return [
        UsageLine("training", usage.trained_tokens),
        UsageLine("sampling_prefill", usage.prefill_tokens),
        UsageLine("sampling_sample", usage.sampled_tokens),
    ]


def guarded(task: Task, work: Callable[[], Outcome]) -> Outcome:
    """`work`'s outcome, or the failure it raised, said as the API says it."""
    try:
        return work()
    except ep.UserInputError as exc:
        return Outcome.failed(OpFailure.of_input(exc))
    except Refused as exc:
        return Outcome.failed(exc.failure)
    except ValidationError as exc:
        # A stored request the wire types refuse (queued before their bounds, or written by
        # other means than the API) is the request's fault, said as the API says it.
        err = exc.errors()[0]
        where = ".".join(str(part) for part in err["loc"])
        return Outcome.failed(OpFailure.user(f"invalid {task.kind} request: {where}: {err['msg']}"))
    except Exception as exc:
        log.exception("operation %s (%s) failed", task.id, task.kind)
        return _server_failure(task, exc)


def _server_failure(task: Task, exc: Exception) -> Outcome:
    return Outcome.failed(
        OpFailure.server(
            f"{task.kind} failed on the server ({type(exc).__name__}); retry, "
            "and report it to the operator if it persists"
        )
    )


class Executor:
    def __init__(
        self,
        engine: Engine,
        store: ArtifactStore,
        database: Database,
        clock: Clock,
        *,
        max_request_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.engine = engine
        self.store = store
        self.database = database
        self.clock = clock
        # The API refused bodies that expand past this; ops logged before a limit was lowered
        # are held to it here too, while they are decompressed.
        self.max_request_bytes = max_request_bytes
        self.saves = Saves(engine, store, database, clock)

    # --- forward_backward, batched across runs ------------------------------------------

    def forward_backward(self, tasks: list[Task]) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        ops: list[tuple[Task, ep.ForwardBackwardOp]] = []
        for task in tasks:
            # Each op is prepared under its own guard: whatever one op's payload does, its
            # batch-mates (other tenants' ops among them) still run.
            try:
                op = self._forward_backward_op(task)
            except (WireFormatError, ep.UserInputError) as exc:
                outcomes[task.id] = Outcome.failed(OpFailure.of_input(exc))
                continue
            except Refused as exc:
                outcomes[task.id] = Outcome.failed(exc.failure)
                continue
            except Exception as exc:
                log.exception("preparing forward_backward %s failed", task.id)
                outcomes[task.id] = _server_failure(task, exc)
                continue
            ops.append((task, op))
        if ops:
            try:
                results = self.engine.forward_backward_batch([op for _, op in ops])
            except Exception:
                log.exception("forward_backward batch failed")
                results = [
                    ep.OpError("server", "forward_backward failed on the server; retry")
                    for _ in ops
                ]
            for (task, op), result in zip(ops, results, strict=True):
                if isinstance(result, ep.OpError):
                    outcomes[task.id] = Outcome.failed(OpFailure.of_engine(result))
                else:
                    outcomes[task.id] = guarded(
                        task,
                        lambda r=result, t=task, o=op: Outcome(  # type: ignore[misc]
                            result=convert.forward_backward_output(r),
                            codec=PROTO,
                            usage=usage_lines(r.usage),
                            # A forward pass bills its tokens but trains nothing.
                            progress=runs.NO_PROGRESS
                            if o.forward_only
                            else runs.Progress(trained_tokens=r.usage.trained_tokens),
                        ),
                    )
        return outcomes

    def _forward_backward_op(self, task: Task) -> ep.ForwardBackwardOp:
        refusal = refusal_of(task.payload, task.payload_codec)
        if refusal is not None:  # refused at submission; it fails in its place
            raise Refused(refusal)
        msg = self._forward_backward_request(task)
        return ep.ForwardBackwardOp(
            run_id=task.target_id,
            data=fb_proto.datums(msg),
            loss_fn=msg.loss_fn,
            loss_fn_config=fb_proto.loss_config(msg),
            forward_only=msg.forward_only,
        )

    def _forward_backward_request(self, task: Task) -> pb.ForwardBackwardRequest:
        return _stored_forward_backward(task.payload, task.payload_codec, self.max_request_bytes)

    # --- everything else, one op at a time ---------------------------------------------

    def run(self, task: Task) -> Outcome:
        handlers: dict[OpKind, Callable[[Task], Outcome]] = {
            OpKind.CREATE_MODEL: self._create_model,
            OpKind.LOAD_WEIGHTS: self._load_weights,
            OpKind.OPTIM_STEP: self._optim_step,
            OpKind.SAVE_WEIGHTS: self.saves.weights,
            OpKind.SAVE_WEIGHTS_FOR_SAMPLER: self.saves.for_sampler,
            OpKind.SAVE_WEIGHTS_EXTERNAL: self.saves.external,
            OpKind.UNLOAD_MODEL: self._unload,
        }
        if task.kind is OpKind.OPTIM_STEP:
            # Before anything else about the step, so that replay reaches the same decision.
            refused_step = self._refuse_failed_gradients(task)
            if refused_step is not None:
                return refused_step
        refusal = refusal_of(task.payload, task.payload_codec)
        if refusal is not None:
            return Outcome.failed(refusal)
        return guarded(task, lambda: handlers[task.kind](task))

    def _refuse_failed_gradients(self, task: Task) -> Outcome | None:
        """Refuse an optimizer step whose gradients are missing a failed forward_backward.

        The step's window runs from the run's last successful optim_step, creation or load
        (or from an optim_step refused here, which discarded the window's gradients) to this
        op. If a forward_backward in it failed, the gradients are not the batch the client
        meant: stepping on them would train silently on part of it. The step fails instead,
        and the window's gradients are discarded so the client can send the batch again.
        The decision reads only ops recorded before this one, so replay reaches it again.
        """
        failed = task.failed_gradients
        if failed is None:  # not looked up when it was claimed (replay)
            with self.database.reader() as db:
                failed = failed_forward_backwards(
                    db, task.target_id, task.seq_id, self.max_request_bytes
                )
        if not failed:
            return None
        self.engine.clear_gradients(task.target_id)
        first = failed[0]
        others = (
            f" (and {len(failed) - 1} more failed forward_backward requests)"
            if len(failed) > 1
            else ""
        )
        reason = first.reason if len(first.reason) <= 500 else first.reason[:500] + "…"
        return Outcome.failed(
            OpFailure.user(
                f"optim_step refused: forward_backward request {first.request_id} (seq_id "
                f"{first.seq_id}) failed{others}, so the gradients accumulated since the last step "
                f"are not the whole batch; it failed with: {reason}. The run's weights and "
                "optimizer state are unchanged and the accumulated gradients were discarded: fix "
                "that request, send the batch's forward_backward requests again, then "
                "optim_step"
            )
        )

    def replay(self, task: Task) -> None:
        """Re-apply a recorded op's effect on the engine (recovery); its result is not kept."""
        if task.kind is OpKind.FORWARD_BACKWARD:
            msg = self._forward_backward_request(task)
            if not msg.forward_only:
                self.engine.forward_backward(
                    task.target_id, fb_proto.datums(msg), msg.loss_fn, fb_proto.loss_config(msg)
                )
        elif task.kind is OpKind.OPTIM_STEP:
            # Recovery replays the steps that succeeded and those that failed for the user's
            # reasons: running them again reproduces what they did to the gradients.
            self.run(task)
        elif task.kind in (OpKind.CREATE_MODEL, OpKind.LOAD_WEIGHTS, OpKind.UNLOAD_MODEL):
            outcome = self.run(task)
            if outcome.error is not None:
                raise RuntimeError(
                    f"replaying {task.kind} seq {task.seq_id} failed: {outcome.error.message}"
                )
        # Saves changed nothing on the engine: their artifacts are already stored.

    def snapshot(self, tenant_id: str, run_id: str, seq_id: int) -> str:
        """Save the run's full state after op `seq_id` (no gradients pending); returns its
        uri."""
        key = f"{tenant_id}/{run_id.replace(':', '_')}/snapshots/{seq_id}"
        folder = self.store.local_dir(key)
        self.engine.save_state(run_id, folder, include_optimizer=True)
        return self.store.publish(key)

    def _create_model(self, task: Task) -> Outcome:
        payload = decode_json_payload(task.payload, task.payload_codec)
        self.engine.create_run(
            task.target_id, payload["base_model"], convert.lora_spec(payload["lora_config"])
        )
        return Outcome.json(
            CreateModelResponse(model_id=task.target_id), apply=_activate(task.target_id)
        )

    def _load_weights(self, task: Task) -> Outcome:
        payload = decode_json_payload(task.payload, task.payload_codec)
        self.engine.load_state(
            task.target_id,
            self.store.open_dir(payload["artifact_uri"]),
            include_optimizer=bool(payload["optimizer"]),
            base_model=payload["base_model"],
        )

        def apply(db: OrmSession) -> None:
            _activate(task.target_id)(db)
            run = db.get(TrainingRun, task.target_id)
            if run is None:
                return
            # The version the API resolved (a reference may have moved since); payloads logged
            # before it was recorded name a tinker path.
            version_id = payload.get("version_id")
            version = (
                db.get(ModelVersion, version_id)
                if version_id is not None
                else checkpoints.find_by_path(db, payload["path"])
            )
            runs.loaded_from(run, version.id if version is not None else None)
            # Follow the engine's step counter: the checkpoint's with the optimizer, else 0.
            if not payload["optimizer"]:
                runs.set_steps(run, 0)
            elif version is not None and version.step is not None:
                runs.set_steps(run, version.step)

        return Outcome.json(
            LoadWeightsResponse(path=payload["path"], model_id=task.target_id), apply=apply
        )

    def _optim_step(self, task: Task) -> Outcome:
        request = OptimStepRequest.model_validate_json(
            decode_payload(task.payload, task.payload_codec)
        )
        result = self.engine.optim_step(task.target_id, convert.adam(request.adam_params))
        return Outcome.json(
            OptimStepResponse(metrics=result.metrics), progress=runs.Progress(optim_steps=1)
        )

    def _unload(self, task: Task) -> Outcome:
        self.engine.remove_run(task.target_id)

        def apply(db: OrmSession) -> None:
            run = db.get(TrainingRun, task.target_id)
            if run is not None:
                runs.unload(run)

        return Outcome.json(UnloadModelResponse(model_id=task.target_id), apply=apply)


def _failed_in_window() -> Select[str, int | None, str, str | None, str | None, bytes, str]:
    """Failed forward_backward and optim_step ops after the last op that left no gradients
    pending, before `seq_id`. Walks the run's (target_id, seq_id) index: usually a few rows."""
    run_id: BindParameter[str] = bindparam("run_id")
    seq_id: BindParameter[int] = bindparam("seq_id")
    start = (
        select(Operation.seq_id)
        .where(
            Operation.target_id == run_id,
            Operation.seq_id < seq_id,
            Operation.status == OpStatus.DONE,
            Operation.kind.in_(
                (OpKind.OPTIM_STEP.value, OpKind.CREATE_MODEL.value, OpKind.LOAD_WEIGHTS.value)
            ),
        )
        .order_by(Operation.seq_id.desc())
        .limit(1)
        .scalar_subquery()
    )
    return (
        select(
            Operation.id,
            Operation.seq_id,
            Operation.kind,
            Operation.error_category,
            Operation.error_message,
            Operation.payload,
            Operation.payload_codec,
        )
        .where(
            Operation.target_id == run_id,
            Operation.seq_id < seq_id,
            Operation.seq_id > func.coalesce(start, -1),
            Operation.status == OpStatus.FAILED,
            Operation.started_at.is_not(None),
            Operation.kind.in_((OpKind.FORWARD_BACKWARD.value, OpKind.OPTIM_STEP.value)),
        )
        .order_by(Operation.seq_id)
    )


_FAILED_IN_WINDOW = _failed_in_window()


def failed_forward_backwards(
    db: OrmSession, run_id: str, seq_id: int | None, max_body_bytes: int
) -> tuple[FailedForwardBackward, ...]:
    """The failed forward_backward ops whose gradients an optim_step at `seq_id` would miss.

    Its window starts after the run's last op that left no gradients pending: a successful
    optim_step, create_model or load_weights, or an optim_step refused for this very reason
    (a `user` failure with failed forward_backward ops in its own window). Forward-only ops
    never count, and neither do ops that never ran (a late arrival after its gap was given up
    is failed at once, after the step behind it ran).
    """
    if seq_id is None:
        return ()
    rows = db.execute(_FAILED_IN_WINDOW, {"run_id": run_id, "seq_id": seq_id}).all()
    pending: list[FailedForwardBackward] = []
    for request_id, op_seq, kind, category, message, payload, codec in rows:
        if kind == OpKind.OPTIM_STEP.value:
            if category == "user" and pending:
                pending = []  # that step was refused and discarded the window's gradients
        elif not _forward_only(payload, codec, max_body_bytes):
            assert op_seq is not None
            pending.append(FailedForwardBackward(request_id, op_seq, message or "unknown error"))
    return tuple(pending)


def _stored_forward_backward(
    payload: bytes, codec: str, max_body_bytes: int
) -> pb.ForwardBackwardRequest:
    """A logged forward_backward: the protobuf body as sent, stored as `proto+<compression>`,
    held to `max_body_bytes` while it is decompressed, its wire format checked again (the
    body may have been logged before the API checked it)."""
    return fb_proto.read(payload, codec.partition("+")[2], max_body_bytes)


def _forward_only(payload: bytes, codec: str, max_body_bytes: int) -> bool:
    """Whether a stored forward_backward op was a forward pass; a body that cannot be read
    counts as a forward_backward (it failed, and may have been one)."""
    try:
        if codec == JSON_ZSTD:
            return decode_json_payload(payload, codec).get("forward_only") is True
        return _stored_forward_backward(payload, codec, max_body_bytes).forward_only
    except Exception:
        return False


def _activate(run_id: str) -> Callable[[OrmSession], None]:
    def apply(db: OrmSession) -> None:
        run = db.get(TrainingRun, run_id)
        if run is not None:
            runs.activate(run)

    return apply
