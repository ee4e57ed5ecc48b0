"""A worker group: one base model served by several ranks (processes, one device each), rank 0
driving the others with torch.distributed.

Every rank holds a whole replica of every run's LoRA adapter and AdamW moments, and by default
of the base model too; engines built with `EngineSettings.shard_base` instead hold 1/N of the
base each (FSDP2, `fsdp`), and then run their passes and decode steps in lockstep (see
`GroupEngine`). Training is data parallel. Rank 0 validates a forward_backward batch once, gives each
rank a contiguous slice of every op's datums (`sharding`), and merges the ranks' results, so
the host sees what one engine would return. Gradients accumulate on each rank and are summed
once, inside `optim_step`, before the clip norm, so every rank clips and steps on the same
gradient and the replicas stay bitwise equal. Everything that only reads a run (saves,
exports, memory, `gradients_pending`) is answered by rank 0 alone, with no collective.

Sampling is split by sample: rank 0 validates a request and fixes its seed, deals its sample
indices out to the least-loaded ranks and buffers the start; each `sample_step` sends every
rank its starts and aborts, every rank steps its own decode loops, and rank 0 merges the
shares of each request as they finish (samples are keyed by their index in the request, so
the result is what one engine samples). Rank 0 keeps each request's tokens so far from the
ranks' reports, so `sample_progress` needs no collective.

The unit rank 0 sends is one engine call (a command), not a host step: the host does its
database writes and store reads between engine calls, on rank 0 only, so it can drive a
`GroupEngine` as it drives an `Engine`. Commands and outcomes travel over a gloo group (CPU
sockets, no device copies); gradients over the default group (NCCL on GPUs, gloo on CPU).

Failure is fail-stop. An op that fails on any rank fails as a whole and its run's gradients
are put back on every rank, as one engine does. Anything else that leaves the replicas
possibly different (a rank refusing what another accepted, a collective that failed or timed
out) raises `GroupFailed`, and so does every later call that would need the other ranks (an
op, a sample step, a merged export of a sharded base); calls answered from rank 0's replica
alone (run ids, saves, adapter exports, memory, progress) still answer, from the state it had
when the group failed. The process is expected to exit so that the whole group restarts and
its runs are restored from their snapshots. A merged export of a sharded base whose write
alone failed on rank 0, after every rank's gathers, fails as an op and leaves the group
serving.

This module knows nothing of the control plane (database, queues, object storage).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpu_worker import checkpoint
from gpu_worker.engine import Engine
from gpu_worker.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardOp,
    ForwardBackwardResult,
    LoraSpec,
    OpError,
    OptimStepResult,
    SampleRequest,
    SampleResult,
    UnsupportedInput,
    UserInputError,
)
from gpu_worker.sharding import merge_result, merge_samples, shard_ops, split_samples
from gpu_worker.validation import CheckedOp, check_adam

log = logging.getLogger(__name__)


class GroupFailed(RuntimeError):
    """The group's replicas can no longer be trusted to be equal (a rank diverged, died or
    timed out); the process should exit so the whole group restarts."""


class GroupComm:
    """This rank's place in the group and its channels. The default process group must be
    initialised (by every rank, with the timeout a collective may take); this adds the gloo
    control group, whose `idle_timeout` bounds how long a follower waits for rank 0's next
    command, so it is much longer: a worker may sit idle."""

    def __init__(self, idle_timeout: timedelta) -> None:
        if not dist.is_initialized():
            raise RuntimeError("init_process_group first: a group needs the default group")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.control = dist.new_group(backend="gloo", timeout=idle_timeout)
        self.data = dist.group.WORLD

    def broadcast(self, obj: object = None) -> Any:
        """Rank 0's `obj` on every rank (others pass nothing)."""
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def scatter(self, objs: list[Any] | None = None) -> Any:
        """Rank r gets rank 0's `objs[r]` (others pass nothing)."""
        out: list[Any] = [None]
        dist.scatter_object_list(out, objs if self.rank == 0 else None, src=0, group=self.control)
        return out[0]

    def gather(self, obj: object) -> list[Any]:
        """Every rank's `obj`, by rank, on rank 0 (an empty list elsewhere)."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out or []

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by the sum over ranks, as one flat all-reduce.

        A rank that got no datums of a run has no gradient (None); it joins with zeros. A
        parameter stays without a gradient only when it has none on every rank, as on one
        engine (AdamW skips such a parameter rather than decaying it).
        """
        if not params:
            return
        device = params[0].device
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.data)
        chosen = [p for p, h in zip(params, has.tolist(), strict=True) if h]
        if not chosen:
            return
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in chosen]
        )
        dist.all_reduce(flat, group=self.data)
        offset = 0
        for p in chosen:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


# --- commands: what rank 0 sends, one per engine call -------------------------------------


@dataclass
class CreateRun:
    run_id: str
    base_model: str
    lora: LoraSpec


@dataclass
class LoadState:
    run_id: str
    state: checkpoint.SavedState
    base_model: str | None


@dataclass
class RemoveRun:
    run_id: str


@dataclass
class ForwardBackward:
    """Each rank's slice of the batch follows in a scatter; then the runs whose ops failed on
    some rank, in a broadcast."""


@dataclass
class OptimStep:
    run_id: str
    adam: AdamParams


@dataclass
class ClearGradients:
    run_id: str


@dataclass
class ExportMerged:
    """Sent only when the base is sharded, once rank 0 has made `target` ready: every rank
    gathers the whole weights, rank 0 writes them there."""

    run_id: str
    target: checkpoint.MergedTarget


@dataclass
class SampleStep:
    """Each rank's `SampleShare` follows in a scatter."""


@dataclass
class SampleShare:
    """What one rank does in a sample step: drop `aborts`, start its shares of new requests
    (key, checked request, its sample indices), then step its decode loops."""

    starts: list[tuple[str, SampleRequest, list[int]]]
    aborts: list[str]


@dataclass
class ShareReport:
    """What one rank's sample step gave: its shares that finished, and the tokens its running
    shares chose since its last report (by key, per local sample)."""

    finished: list[tuple[str, SampleResult | OpError]]
    progress: dict[str, list[list[int]]]
    error: str | None = None


@dataclass
class Exit:
    pass


@dataclass
class Outcome:
    """How one rank's execution of a command ended: `kind` is "ok", "user" (a UserInputError,
    which every replica raises alike), "local" (a failure of this rank alone after every
    collective of the command was done, which left its replica as it was: rank 0 failing to
    write a merged export) or "error"."""

    kind: str
    value: Any = None
    message: str = ""
    unsupported: bool = False


def _apply(engine: Engine, comm: GroupComm, command: object) -> Outcome:
    try:
        if isinstance(command, CreateRun):
            engine.create_run(command.run_id, command.base_model, command.lora)
            return Outcome("ok")
        if isinstance(command, LoadState):
            engine.load_state_tensors(command.run_id, command.state, command.base_model)
            return Outcome("ok")
        if isinstance(command, RemoveRun):
            engine.remove_run(command.run_id)
            return Outcome("ok")
        if isinstance(command, OptimStep):
            return Outcome("ok", engine.optim_step(command.run_id, command.adam, comm.sum_grads))
        if isinstance(command, ClearGradients):
            engine.clear_gradients(command.run_id)
            return Outcome("ok")
        if isinstance(command, ExportMerged):
            engine.write_merged(command.run_id, command.target if comm.rank == 0 else None)
            return Outcome("ok")
        raise TypeError(f"unknown group command {command!r}")
    except UserInputError as exc:
        return Outcome("user", message=str(exc), unsupported=isinstance(exc, UnsupportedInput))
    except checkpoint.WriteFailed as exc:
        log.exception("writing a merged export failed on rank %d", comm.rank)
        return Outcome("local", message=str(exc))
    except Exception as exc:
        log.exception("group command %s failed on rank %d", type(command).__name__, comm.rank)
        return Outcome("error", message=f"{type(exc).__name__}: {exc}")


Grads = dict[str, list[torch.Tensor | None]]


Slice = tuple[list[ForwardBackwardResult | OpError | None], bool]


def _run_shard(engine: Engine, shard: list[CheckedOp | None]) -> tuple[Slice, Grads]:
    """This rank's slice of a batch: a result per op (None where it had no datums) and
    whether a failure may have left the ranks out of lockstep (a sharded base's passes failed
    part way); and the gradients its runs had before, to put back if the op fails on another
    rank."""
    present = [(i, op) for i, op in enumerate(shard) if op is not None]
    out: list[ForwardBackwardResult | OpError | None] = [None] * len(shard)
    saved: Grads = {}
    broken = False
    try:
        for _, op in present:
            if not op.forward_only and op.run_id in engine.run_ids():
                saved[op.run_id] = [
                    None if p.grad is None else p.grad.clone()
                    for p in engine.adapter(op.run_id).parameters()
                ]
        results = engine.execute_checked([op for _, op in present])
    except Exception as exc:  # the rank must still answer, so that no collective is skipped
        log.exception("forward_backward slice failed")
        results = [OpError("server", f"{type(exc).__name__}: {exc}") for _ in present]
        broken = engine.sharded
    for (i, _), result in zip(present, results, strict=True):
        out[i] = result
    return (out, broken), saved


def _restore(engine: Engine, saved: Grads, run_ids: Collection[str]) -> None:
    for run_id in run_ids:
        if run_id in saved:
            for p, grad in zip(engine.adapter(run_id).parameters(), saved[run_id], strict=True):
                p.grad = grad


class _Shares:
    """One rank's shares of sampling requests, and how much of each it has reported."""

    def __init__(self) -> None:
        self._reported: dict[str, list[int]] = {}  # key -> tokens reported, per local sample

    def step(self, engine: Engine, share: SampleShare) -> ShareReport:
        try:
            engine.sample_abort(share.aborts)
            for key in share.aborts:
                self._reported.pop(key, None)
            finished: list[tuple[str, SampleResult | OpError]] = []
            for key, req, indices in share.starts:
                refused = engine.sample_start(key, req, indices)
                if refused is None:
                    self._reported[key] = [0] * len(indices)
                else:
                    finished.append((key, refused))
            done = engine.sample_step()
            finished += done
            for key, _ in done:
                self._reported.pop(key, None)
            progress: dict[str, list[list[int]]] = {}
            for key, reported in self._reported.items():
                tokens = engine.sample_progress(key)
                if any(len(t) > n for t, n in zip(tokens, reported, strict=True)):
                    progress[key] = [t[n:] for t, n in zip(tokens, reported, strict=True)]
                    self._reported[key] = [len(t) for t in tokens]
            return ShareReport(finished, progress)
        except Exception as exc:  # answered all the same, so that no collective is skipped
            log.exception("sample step failed")
            return ShareReport([], {}, f"{type(exc).__name__}: {exc}")


def follow(engine: Engine, comm: GroupComm) -> None:
    """A follower's life (ranks > 0): run rank 0's commands on the local replica until it says
    Exit. It never touches the database, queues or object storage. A failed collective (rank 0
    gone, a timeout) raises, ending the process, and so the group."""
    shares = _Shares()
    while True:
        command = comm.broadcast()
        if isinstance(command, Exit):
            return
        if isinstance(command, SampleStep):
            comm.gather(shares.step(engine, comm.scatter()))
        elif isinstance(command, ForwardBackward):
            part, saved = _run_shard(engine, comm.scatter())
            comm.gather(part)
            _restore(engine, saved, comm.broadcast())
        else:
            comm.gather(_apply(engine, comm, command))


class GroupEngine:
    """Rank 0's engine: the `Engine` methods the worker host calls, over the whole group.

    Calls that change a run are sent to every rank and run on each replica under one lock, so
    commands from the host and from other threads never interleave their collectives. Calls
    that only read go to the local replica.

    When the engines shard the base (`EngineSettings.shard_base`), every rank must run every
    decode step alike, so each sampling request is mirrored: every rank samples all of it
    (the same seed, so the same tokens) and rank 0 answers with its own copy, failing the
    group if another rank finished differently. A merged export gathers the weights on every
    rank.
    """

    def __init__(self, engine: Engine, comm: GroupComm) -> None:
        if comm.rank != 0:
            raise ValueError("a GroupEngine drives the group from rank 0; others run follow()")
        self.engine = engine
        self.comm = comm
        self._lock = threading.Lock()
        self._failed: str | None = None
        # runs with gradients not yet consumed somewhere in the group: rank 0 may hold none of
        # them (it got no datums), so the local replica cannot tell
        self._pending: set[str] = set()
        self._shares = _Shares()
        self._requests: dict[str, _Request] = {}  # started, not finished
        self._starts: list[tuple[str, SampleRequest]] = []  # to send with the next step
        self._aborts: set[str] = set()  # to send with the next step
        self._held: dict[str, SampleResult | OpError] = {}  # finished during a sample_batch
        self._batches = itertools.count()
        self._mirrored = engine.sharded

    @property
    def catalog(self) -> Any:
        return self.engine.catalog

    @property
    def device(self) -> torch.device:
        return self.engine.device

    # --- commands -------------------------------------------------------------------------

    def _command(self, command: object) -> Any:
        """Send `command`, run it here and on every rank, and return rank 0's value. Ranks that
        disagree on how it ended mean the replicas may differ: the group fails."""
        with self._lock:
            self._check()
            try:
                self.comm.broadcast(command)
                mine = _apply(self.engine, self.comm, command)
                outcomes: list[Outcome] = self.comm.gather(mine)
            except Exception as exc:
                raise self._fail(f"{type(command).__name__}: {type(exc).__name__}: {exc}") from exc
            if mine.kind == "local" and all(o.kind == "ok" for o in outcomes[1:]):
                raise RuntimeError(mine.message)  # the op fails; the replicas are untouched
            kinds = {o.kind for o in outcomes}
            if len(kinds) > 1:
                detail = "; ".join(
                    f"rank {r}: {o.kind} {o.message}" for r, o in enumerate(outcomes)
                )
                raise self._fail(f"ranks disagree on {type(command).__name__}: {detail}")
            if mine.kind == "error" and isinstance(command, OptimStep | ExportMerged):
                # it may have failed inside a collective (the ranks' all-reduces or gathers
                # no longer pair up), or half way through an update
                raise self._fail(f"{type(command).__name__} failed on every rank: {mine.message}")
            if mine.kind == "user":
                raise (UnsupportedInput if mine.unsupported else UserInputError)(mine.message)
            if mine.kind == "error":
                raise RuntimeError(mine.message)
            return mine.value

    def _check(self) -> None:
        if self._failed is not None:
            raise GroupFailed(self._failed)

    def _fail(self, reason: str) -> GroupFailed:
        log.error("worker group failed: %s", reason)
        self._failed = reason
        return GroupFailed(reason)

    def close(self) -> None:
        """Tell the followers to return from `follow` (once; a failed group sends nothing)."""
        with self._lock:
            if self._failed is None:
                self._failed = "the group was closed"
                self.comm.broadcast(Exit())

    def create_run(self, run_id: str, base_model: str, lora: LoraSpec) -> None:
        self._command(CreateRun(run_id, base_model, lora))
        self._pending.discard(run_id)

    def load_state(
        self,
        run_id: str,
        path: str | Path,
        include_optimizer: bool = True,
        base_model: str | None = None,
    ) -> None:
        """Read the state here and send it to every rank: followers need no access to it."""
        state = checkpoint.read_state(Path(path), include_optimizer)
        self._command(LoadState(run_id, state, base_model))
        self._pending.discard(run_id)

    def remove_run(self, run_id: str) -> None:
        self._command(RemoveRun(run_id))
        self._pending.discard(run_id)

    def optim_step(self, run_id: str, adam: AdamParams) -> OptimStepResult:
        self.engine.adapter(run_id)  # refused here, before any rank is asked:
        check_adam(adam)  # what is left to refuse is a non-finite gradient, which is cleared
        try:
            result: OptimStepResult = self._command(OptimStep(run_id, adam))
        except UserInputError:
            self._pending.discard(run_id)
            raise
        self._pending.discard(run_id)
        return result

    def clear_gradients(self, run_id: str) -> None:
        self._command(ClearGradients(run_id))
        self._pending.discard(run_id)

    def gradients_pending(self, run_id: str) -> bool:
        self.engine.adapter(run_id)  # an unknown run raises, as on one engine
        return run_id in self._pending

    def forward_backward(
        self,
        run_id: str,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float] | None = None,
    ) -> ForwardBackwardResult:
        (result,) = self.forward_backward_batch(
            [ForwardBackwardOp(run_id, data, loss_fn, loss_fn_config)]
        )
        if isinstance(result, OpError):
            if result.category == "user":
                raise (UnsupportedInput if result.unsupported else UserInputError)(result.message)
            raise RuntimeError(result.message)
        return result

    def forward_backward_batch(
        self, ops: list[ForwardBackwardOp]
    ) -> list[ForwardBackwardResult | OpError]:
        """Validate here, run each rank's slice, merge. An op that failed on any rank fails,
        and its run's gradients go back to what they were on every rank; so do the other ops
        of that run in the batch, whose gradients were rolled back with it."""
        with self._lock:
            self._check()
            prepared = self.engine.prepare_batch(ops)
            try:
                self.comm.broadcast(ForwardBackward())
                mine, saved = _run_shard(
                    self.engine, self.comm.scatter(shard_ops(prepared, self.comm.world))
                )
                slices: list[Slice] = self.comm.gather(mine)
                parts = [part for part, _ in slices]
                broken = [rank for rank, (_, b) in enumerate(slices) if b]
                results = [
                    p if isinstance(p, OpError) else merge_result([part[i] for part in parts])
                    for i, p in enumerate(prepared)
                ]
                # runs whose gradients an op may have changed on some rank before it failed
                failed = {
                    op.run_id
                    for op, result in zip(prepared, results, strict=True)
                    if isinstance(op, CheckedOp)
                    and not op.forward_only
                    and isinstance(result, OpError)
                }
                self.comm.broadcast(sorted(failed))
            except Exception as exc:
                raise self._fail(f"ForwardBackward: {type(exc).__name__}: {exc}") from exc
            if broken:
                _restore(self.engine, saved, failed)
                raise self._fail(
                    f"ForwardBackward failed part way on sharded ranks {broken}: their passes "
                    "may no longer be in lockstep"
                )
            _restore(self.engine, saved, failed)
            for i, op in enumerate(prepared):
                if not isinstance(op, CheckedOp) or op.forward_only:
                    continue
                if op.run_id in failed and isinstance(results[i], ForwardBackwardResult):
                    results[i] = OpError(
                        "server",
                        "another op of this run in the same batch failed on a rank of the "
                        "worker group, and the run's gradients were rolled back with it",
                    )
                elif isinstance(results[i], ForwardBackwardResult):
                    self._pending.add(op.run_id)
            return results

    # --- read-only calls: rank 0's replica -----------------------------------------------

    def tokenizer_dir(self, base_model: str) -> Path:
        return self.engine.tokenizer_dir(base_model)

    def run_ids(self) -> list[str]:
        return self.engine.run_ids()

    def adapter(self, run_id: str) -> Any:
        return self.engine.adapter(run_id)

    def steps(self, run_id: str) -> int:
        return self.engine.steps(run_id)

    def run_memory_bytes(self, run_id: str) -> int:
        return self.engine.run_memory_bytes(run_id)

    def frozen_memory_bytes(self) -> int:
        return self.engine.frozen_memory_bytes()

    def save_state(self, run_id: str, path: str | Path, include_optimizer: bool = True) -> None:
        """Written from rank 0's replica: the adapters and moments are equal on every rank.
        Gradients are not saved, as on one engine."""
        self.engine.save_state(run_id, path, include_optimizer)

    def export_adapter(self, run_id: str, path: str | Path) -> None:
        self.engine.export_adapter(run_id, path)

    def export_merged(self, run_id: str, path: str | Path) -> None:
        """On a sharded base every rank gathers the weights; whatever can fail on rank 0
        alone before that (an unknown run, a folder that cannot be made, the tokenizer) is
        done first, here, so that it fails before any rank is asked. A write that fails after
        the gathers fails the export alone: the replicas are as they were."""
        if self._mirrored:
            self._check()
            self._command(ExportMerged(run_id, self.engine.prepare_merged(run_id, path)))
        else:
            self.engine.export_merged(run_id, path)

    # --- sampling, split by sample over the ranks ------------------------------------------

    def sample_start(self, key: str, req: SampleRequest) -> OpError | None:
        """Validate `req` here and deal its samples out; every rank starts its share at the
        next `sample_step`. As on one engine: an OpError when refused, ValueError for a key
        in use."""
        with self._lock:
            return self._start(key, req)

    def _start(self, key: str, req: SampleRequest) -> OpError | None:
        self._check()
        if key in self._requests or key in self._held:
            raise ValueError(f"sample key {key!r} is already in use; give each job its own key")
        try:
            checked = self.engine.check_sample(req)  # the seed is fixed here, once for all
        except UserInputError as exc:
            return OpError.of_input(exc)
        loads = [0] * self.comm.world
        for request in self._requests.values():
            for rank, indices in request.shares.items():
                if rank not in request.done:
                    loads[rank] += len(indices)
        if self._mirrored:  # rank 0's share is the whole request; the others copy it
            shares = [list(range(req.num_samples))] + [[] for _ in range(self.comm.world - 1)]
        else:
            shares = split_samples(req.num_samples, loads)
        self._requests[key] = _Request(
            {rank: indices for rank, indices in enumerate(shares) if indices},
            progress=[[] for _ in range(req.num_samples)],
        )
        self._starts.append((key, checked))
        return None

    def sample_step(self) -> list[tuple[str, SampleResult | OpError]]:
        """One decode step on every rank; the requests whose last share finished in it, after
        those that finished during a `sample_batch`. A share that failed (its rank's loop
        failed: `interrupted`) fails its request, and the other shares are dropped."""
        with self._lock:
            out = list(self._held.items())
            self._held.clear()
            return out + self._step()

    def _step(self) -> list[tuple[str, SampleResult | OpError]]:
        self._check()
        if not self._requests and not self._aborts:
            return []  # no rank holds anything to step
        starts, self._starts = self._starts, []
        aborts, self._aborts = sorted(self._aborts), set()
        payload = [
            SampleShare(
                [
                    (key, req, self._requests[key].shares[0 if self._mirrored else rank])
                    for key, req in starts
                    if (0 if self._mirrored else rank) in self._requests[key].shares
                ],
                aborts,
            )
            for rank in range(self.comm.world)
        ]
        try:
            self.comm.broadcast(SampleStep())
            mine = self._shares.step(self.engine, self.comm.scatter(payload))
            reports: list[ShareReport] = self.comm.gather(mine)
        except Exception as exc:
            raise self._fail(f"SampleStep: {type(exc).__name__}: {exc}") from exc
        for rank, report in enumerate(reports):
            if report.error is not None:
                raise self._fail(f"SampleStep on rank {rank}: {report.error}")
        if self._mirrored:
            # a rank whose copy finished at another step would run other decode steps than
            # rank 0, and the next step's all-gathers would not pair up
            ends = [sorted(key for key, _ in report.finished) for report in reports]
            if any(end != ends[0] for end in ends):
                raise self._fail(f"SampleStep: mirrored requests finished apart: {ends}")
            reports = reports[:1]
        finished: list[tuple[str, SampleResult | OpError]] = []
        for rank, report in enumerate(reports):
            for key, new in report.progress.items():
                if key in self._requests:
                    request = self._requests[key]
                    for i, tokens in zip(request.shares[rank], new, strict=True):
                        request.progress[i].extend(tokens)
            for key, outcome in report.finished:
                if key not in self._requests:
                    continue  # its request already failed on another rank
                request = self._requests[key]
                if isinstance(outcome, OpError):
                    del self._requests[key]
                    self._aborts.add(key)  # the other shares are dropped at the next step
                    finished.append((key, outcome))
                    continue
                request.done[rank] = outcome
                for i, seq in zip(request.shares[rank], outcome.sequences, strict=True):
                    request.progress[i] = list(seq.tokens)
                if len(request.done) == len(request.shares):
                    del self._requests[key]
                    parts = [(request.shares[r], result) for r, result in request.done.items()]
                    finished.append((key, merge_samples(parts)))
        return finished

    def sample_progress(self, key: str) -> list[list[int]]:
        """Tokens chosen so far for each sample of `key`, as the ranks last reported them."""
        with self._lock:
            if key in self._requests:
                return [list(tokens) for tokens in self._requests[key].progress]
            held = self._held.get(key)
            if isinstance(held, SampleResult):
                return [list(s.tokens) for s in held.sequences]
            return []

    def sample_abort(self, keys: Collection[str] | None = None) -> None:
        """Drop requests (all when None); the ranks free their rows at the next step."""
        with self._lock:
            chosen = [*self._requests, *self._held] if keys is None else list(keys)
            for key in chosen:
                self._held.pop(key, None)
                if self._requests.pop(key, None) is not None:
                    self._aborts.add(key)
            self._starts = [(k, req) for k, req in self._starts if k in self._requests]

    def sample_batch(self, requests: list[SampleRequest]) -> list[SampleResult | OpError]:
        """Sample all requests to completion; other requests that finish meanwhile come out
        of the next `sample_step`."""
        with self._lock:
            out: dict[int, SampleResult | OpError] = {}
            keys: dict[str, int] = {}
            batch = next(self._batches)
            for i, req in enumerate(requests):
                key = f"{_BATCH_KEY}{batch}/{i}"
                refused = self._start(key, req)
                if refused is None:
                    keys[key] = i
                else:
                    out[i] = refused
            while any(i not in out for i in keys.values()):
                for key, outcome in self._step():
                    if key in keys:
                        out[keys[key]] = outcome
                    else:
                        self._held[key] = outcome
            return [out.get(i, OpError("server", "not executed")) for i in range(len(requests))]

    @property
    def sampling(self) -> int:
        """Requests started and not finished, or finished and not yet returned."""
        with self._lock:
            return len(self._requests) + len(self._held)


@dataclass
class _Request:
    """A sampling request in flight: its sample indices by rank, the shares that finished,
    and the tokens of each sample so far."""

    shares: dict[int, list[int]]
    done: dict[int, SampleResult] = field(default_factory=dict)
    progress: list[list[int]] = field(default_factory=list)


# sample_batch's own requests are keyed under this prefix, which no caller's key starts with
_BATCH_KEY = "\x00group_batch/"
