"""The engine: base models held once, many runs' LoRA adapters and AdamW states beside them.

One method per kind of op, shaped as the worker host sends them: forward and forward_backward
ops go through `forward_backward_batch` (`forward_backward` runs one op alone, as recovery
replays it). Samples and prompt logprobs join a running decode loop per base model
(`sample_start`, then one `sample_step` at a time, between which training ops may run) or are
sampled to completion by `sample_batch`. A sample sees its run's weights as they were when it
started: before an op changes or drops a run's adapter, the samples using it move to a frozen
copy. Ops on a run are expected in the caller's order (the scheduler enforces seq order);
gradients accumulate across forward_backward calls until optim_step. `forward_backward_batch`
executes several runs' ops as one multi-LoRA pass, each op failing or succeeding on its own.
Every op validates its input before touching state, so an op that raises `UserInputError`
leaves the run exactly as it was.

Calls are serialised by a lock: the LoRA row assignment lives on the model while a pass runs.
The engine knows nothing of HTTP, SQL, Celery or object storage; paths are local folders.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_worker import checkpoint, fsdp
from gpu_worker.catalog import Catalog, ModelEntry, count_parameters
from gpu_worker.decoding import DecodeLoops
from gpu_worker.lora import LoraAdapter, LoraContext, MultiLoraLinear, adapter_shapes, inject
from gpu_worker.protocol import (
    AdamParams,
    Datum,
    ForwardBackwardOp,
    ForwardBackwardResult,
    LoraSpec,
    ModelInfo,
    OpError,
    OptimStepResult,
    SampleRequest,
    SampleResult,
    UserInputError,
)
from gpu_worker.sampling import Job, Sampler, resolve_stop
from gpu_worker.training import TrainOp, plan_passes, run_ops
from gpu_worker.validation import (
    CheckedOp,
    check_adam,
    check_datums,
    check_lora_spec,
    check_loss_config,
    check_sampling,
    check_tokens,
)

log = logging.getLogger(__name__)

# sample_batch's own jobs are keyed under this prefix, which no caller's key starts with
_BATCH_KEY = "\x00sample_batch/"


@dataclass
class EngineSettings:
    device: str = "auto"  # "auto" (first CUDA device, else CPU), "cpu", "cuda", "cuda:1"
    precision: str = "auto"  # "auto" (bf16 on CUDA, fp32 on CPU), "fp32", "bf16-autocast", "bf16"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    max_lora_rank: int = 128
    # Datums are packed into passes of at most this many tokens (None: 512 on CPU, where
    # small passes stay in cache, and 16384 on CUDA).
    max_tokens_per_pass: int | None = None
    models: tuple[str, ...] = ()  # loaded at start; others load on first use
    catalog_entries: tuple[ModelEntry, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)
    cache_dir: str | None = None
    # Shard every base model's weights over the default process group (FSDP2, `fsdp`): only
    # for a worker group's ranks, which make the same engine calls in the same order. Such an
    # engine serves the `models` it loads at start and no others.
    shard_base: bool = False


@dataclass
class _Model:
    name: str
    model: Any
    ctx: LoraContext
    wrapped: dict[str, MultiLoraLinear]
    info: ModelInfo
    tokenizer: object | None = None


@dataclass
class _Run:
    run_id: str
    model: _Model
    adapter: LoraAdapter
    optimizer: torch.optim.AdamW
    steps: int = 0


# Called with a run's adapter parameters before optim_step reads their gradients; it may set
# or replace each `.grad` (a worker group sums the ranks' gradients here).
GradReduce = Callable[[list[torch.nn.Parameter]], None]


class Engine:
    def __init__(self, settings: EngineSettings | None = None) -> None:
        self.settings = settings or EngineSettings()
        if self.settings.num_threads:
            torch.set_num_threads(self.settings.num_threads)
        dev = self.settings.device
        if dev == "auto":
            dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(dev)
        on_cuda = self.device.type == "cuda"
        precision = self.settings.precision
        if precision == "auto":
            bf16_ok = on_cuda and torch.cuda.is_bf16_supported()
            precision = "bf16" if bf16_ok else "fp32"
        if precision not in ("fp32", "bf16-autocast", "bf16"):
            raise ValueError(f"precision {precision!r}: use auto, fp32, bf16-autocast or bf16")
        self.weight_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.autocast_dtype = torch.bfloat16 if precision.startswith("bf16") else None
        self.max_tokens_per_pass = self.settings.max_tokens_per_pass or (16384 if on_cuda else 512)
        self.catalog = Catalog(
            list(self.settings.catalog_entries), self.settings.aliases, self.settings.cache_dir
        )
        self._models: dict[str, _Model] = {}
        self._runs: dict[str, _Run] = {}
        self._lock = threading.RLock()
        self._loops = DecodeLoops(self._new_sampler)
        self._batches = itertools.count()
        self._mesh = fsdp.mesh_over_group(self.device) if self.settings.shard_base else None
        if self._mesh is not None and not self.settings.models:
            raise ValueError("an engine that shards its base models names them in `models`")
        for name in self.settings.models:
            self._load(name)

    @property
    def sharded(self) -> bool:
        """Whether the base models' weights are sharded over a worker group's ranks, which
        must then run every pass and decode step in lockstep."""
        return self._mesh is not None

    # --- catalog ------------------------------------------------------------------------

    def tokenizer_dir(self, base_model: str) -> Path:
        """Folder with the model's tokenizer files (tokenizer.json, tokenizer_config.json, …)."""
        return self.catalog.tokenizer_dir(base_model)

    def _model(self, name: str) -> _Model:
        canonical = self.catalog.resolve(name).name
        if canonical not in self._models:
            if self._mesh is not None:
                # loading is not a collective, so one rank alone could load a model the
                # others lack, and their passes would no longer match
                raise UserInputError(
                    f"this worker group shards its base models and serves only "
                    f"{', '.join(sorted(self._models))}, not {canonical}"
                )
            self._load(canonical)
        return self._models[canonical]

    def _load(self, name: str) -> None:
        canonical = self.catalog.resolve(name).name
        with self._lock:
            if canonical in self._models:
                return
            model = self.catalog.load_model(canonical, self.weight_dtype)
            if self._mesh is None:
                model.to(device=self.device, dtype=self.weight_dtype)
            else:
                # stays on the CPU: `shard_model` moves one unit at a time to the device and
                # keeps this rank's shard of it, so no device ever holds the whole model
                model.to(dtype=self.weight_dtype)
            ctx, wrapped = inject(model)
            info = self.catalog.info(canonical)
            info = ModelInfo(**{**info.__dict__, "num_parameters": count_parameters(model)})
            if self._mesh is not None:
                fsdp.shard_model(model, self._mesh, self.device)
            self._models[canonical] = _Model(canonical, model, ctx, wrapped, info)
            log.info(
                "loaded base model %s on %s%s",
                canonical,
                self.device,
                f", sharded over {self._mesh.size()} ranks" if self._mesh is not None else "",
            )

    def base_memory_bytes(self) -> int:
        """Bytes of the base models' weights held here (this rank's shards when sharded)."""
        with self._lock:
            return sum(fsdp.local_bytes(m.model) for m in self._models.values())

    def _tokenizer(self, m: _Model) -> object:
        if m.tokenizer is None:
            from transformers import AutoTokenizer

            m.tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer_dir(m.name)))
        return m.tokenizer

    # --- runs ---------------------------------------------------------------------------

    def create_run(self, run_id: str, base_model: str, lora: LoraSpec) -> None:
        with self._lock:
            if run_id in self._runs:
                raise UserInputError(f"run {run_id!r} already exists; remove it or use a new id")
            check_lora_spec(lora, self.settings.max_lora_rank)
            m = self._model(base_model)
            self._runs[run_id] = self._new_run(run_id, m, lora)

    def _new_run(self, run_id: str, m: _Model, lora: LoraSpec) -> _Run:
        adapter = LoraAdapter(lora, adapter_shapes(m.wrapped, lora), self.device)
        optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-4, foreach=True)
        return _Run(run_id, m, adapter, optimizer)

    def remove_run(self, run_id: str) -> None:
        with self._lock:
            run = self._runs.pop(run_id, None)
            if run is not None:
                self._loops.freeze(run.adapter)

    def run_ids(self) -> list[str]:
        return sorted(self._runs)

    def _run(self, run_id: str) -> _Run:
        if run_id not in self._runs:
            raise UserInputError(f"unknown run {run_id!r}; create it first or load its state")
        return self._runs[run_id]

    def adapter(self, run_id: str) -> LoraAdapter:
        """The run's LoRA weights (for inspection: tests, exports)."""
        return self._run(run_id).adapter

    def steps(self, run_id: str) -> int:
        """Optimizer steps the run has taken (restored with its optimizer state)."""
        return self._run(run_id).steps

    def base_module(self, base_model: str) -> torch.nn.Module:
        """The shared base model, loaded if it was not (for inspection)."""
        return self._model(base_model).model

    def tokenizer(self, base_model: str) -> object:
        """The base model's tokenizer (transformers), loaded if it was not."""
        return self._tokenizer(self._model(base_model))

    def gradients_pending(self, run_id: str) -> bool:
        """Whether forward_backward accumulated gradients no optimizer step has consumed yet
        (a saved state would lose them)."""
        with self._lock:
            return any(p.grad is not None for p in self._run(run_id).adapter.parameters())

    def run_memory_bytes(self, run_id: str) -> int:
        """Bytes held for this run: adapter weights, gradients and AdamW moments."""
        run = self._run(run_id)
        total = run.adapter.num_bytes()
        for p in run.adapter.parameters():
            if p.grad is not None:
                total += p.grad.numel() * p.grad.element_size()
            for v in run.optimizer.state.get(p, {}).values():
                total += v.numel() * v.element_size()
        return total

    # --- training -----------------------------------------------------------------------

    def forward_backward(
        self,
        run_id: str,
        data: list[Datum],
        loss_fn: str = "cross_entropy",
        loss_fn_config: dict[str, float] | None = None,
    ) -> ForwardBackwardResult:
        return self._single(ForwardBackwardOp(run_id, data, loss_fn, loss_fn_config))

    def _single(self, op: ForwardBackwardOp) -> ForwardBackwardResult:
        with self._lock:
            checked = self._prepare(op)
            return self._execute([checked])[0]

    def forward_backward_batch(
        self, ops: list[ForwardBackwardOp]
    ) -> list[ForwardBackwardResult | OpError]:
        """Run several ops (several runs) in as few passes as possible; one result per op."""
        with self._lock:
            return self.execute_checked(self.prepare_batch(ops))

    def prepare_batch(self, ops: list[ForwardBackwardOp]) -> list[CheckedOp | OpError]:
        """Validate each op on its own: its checked form, or why it is refused. Nothing
        changes; a worker group validates the whole op here, on one rank, because validation
        looks across an op's datums (clip thresholds spread to all once any datum sends one)."""
        with self._lock:
            prepared: list[CheckedOp | OpError] = []
            for op in ops:
                try:
                    prepared.append(self._prepare(op))
                except UserInputError as exc:
                    prepared.append(OpError.of_input(exc))
                except Exception as exc:  # this op alone fails; its batch-mates still run
                    log.exception("preparing forward_backward of %s failed", op.run_id)
                    prepared.append(OpError("server", f"{type(exc).__name__}: {exc}"))
            return prepared

    def execute_checked(
        self, ops: list[CheckedOp | OpError]
    ) -> list[ForwardBackwardResult | OpError]:
        """Run validated ops (OpErrors pass through) in as few passes as possible: one
        multi-LoRA batch per base model and direction. When a batch fails its ops are retried
        one by one, so each op fails or succeeds on its own and a failed op leaves its run's
        gradients as they were.

        On a sharded base the ranks run in lockstep instead: every rank runs each (model,
        direction) batch that any rank has, with as many passes as the rank with the most
        (shorter ranks and ranks without ops pad with dummy passes), and a failure is not
        retried but raised, because the ranks' collectives may no longer pair up."""
        with self._lock:
            if self._mesh is not None:
                return self._execute_lockstep(ops)
            results: list[ForwardBackwardResult | OpError | None] = [None] * len(ops)
            groups: dict[tuple[str, bool], list[tuple[int, CheckedOp]]] = {}
            for i, op in enumerate(ops):
                if isinstance(op, OpError):
                    results[i] = op
                    continue
                try:
                    model_name = self._run(op.run_id).model.name
                except UserInputError as exc:
                    results[i] = OpError.of_input(exc)
                    continue
                groups.setdefault((model_name, op.forward_only), []).append((i, op))
            for members in groups.values():
                try:
                    outs = self._execute([p for _, p in members])
                    for (i, _), out in zip(members, outs, strict=True):
                        results[i] = out
                except Exception:
                    log.exception(
                        "batched pass failed; retrying its %d ops one by one", len(members)
                    )
                    for i, p in members:
                        try:
                            results[i] = self._execute([p])[0]
                        except UserInputError as exc:
                            results[i] = OpError.of_input(exc)
                        except Exception as exc:
                            results[i] = OpError("server", f"{type(exc).__name__}: {exc}")
            return [
                r if r is not None else OpError("server", "op was not executed") for r in results
            ]

    def _execute_lockstep(
        self, ops: list[CheckedOp | OpError]
    ) -> list[ForwardBackwardResult | OpError]:
        results: list[ForwardBackwardResult | OpError | None] = [
            op if isinstance(op, OpError) else None for op in ops
        ]
        groups: dict[tuple[str, bool], list[tuple[int, CheckedOp]]] = {}
        for i, op in enumerate(ops):
            if isinstance(op, CheckedOp):
                try:
                    key = (self._run(op.run_id).model.name, op.forward_only)
                except UserInputError as exc:
                    results[i] = OpError.of_input(exc)
                    continue
                groups.setdefault(key, []).append((i, op))
        # every rank holds the same models, so every rank lists the same batches, in order
        keys = [
            (name, forward_only) for name in sorted(self._models) for forward_only in (False, True)
        ]
        planned = [
            len(
                plan_passes(
                    self._train_ops([op for _, op in groups[key]]), self.max_tokens_per_pass
                )
            )
            if key in groups
            else 0
            for key in keys
        ]
        for key, passes in zip(keys, fsdp.agree_max(planned, self.device), strict=True):
            if passes == 0:
                continue
            members = groups.get(key, [])
            if members:
                outs = self._execute([op for _, op in members], passes)
                for (i, _), out in zip(members, outs, strict=True):
                    results[i] = out
            else:
                self._dummy_passes(self._models[key[0]], not key[1], passes)
        return [r if r is not None else OpError("server", "op was not executed") for r in results]

    def _train_ops(self, checked: list[CheckedOp]) -> list[TrainOp]:
        return [
            TrainOp(self._run(c.run_id).adapter, c.datums, c.loss_fn, c.config) for c in checked
        ]

    def _prepare(self, op: ForwardBackwardOp) -> CheckedOp:
        run = self._run(op.run_id)
        config = check_loss_config(op.loss_fn, op.loss_fn_config)
        info = run.model.info
        datums = check_datums(op.data, op.loss_fn, info.vocab_size, info.max_context_length, config)
        return CheckedOp(op.run_id, op.loss_fn, config, datums, op.forward_only)

    def _execute(
        self, checked: list[CheckedOp], passes: int | None = None
    ) -> list[ForwardBackwardResult]:
        """One multi-LoRA batch of one model and direction; with `passes`, dummy passes
        follow the real ones up to that many (a sharded base's lockstep)."""
        m = self._run(checked[0].run_id).model
        ops = self._train_ops(checked)
        backward = not checked[0].forward_only
        results = run_ops(
            m.model,
            m.ctx,
            ops,
            backward=backward,
            device=self.device,
            autocast_dtype=self.autocast_dtype,
            max_tokens_per_pass=self.max_tokens_per_pass,
        )
        if passes is not None:
            self._dummy_passes(
                m, backward, passes - len(plan_passes(ops, self.max_tokens_per_pass))
            )
        return results

    def _dummy_passes(self, m: _Model, backward: bool, n: int) -> None:
        """`n` passes that change nothing but take part in the all-gathers of a sharded base,
        for a rank with fewer passes than another."""
        for _ in range(n):
            fsdp.dummy_pass(
                m.model,
                m.ctx,
                backward=backward,
                device=self.device,
                autocast_dtype=self.autocast_dtype,
            )

    def optim_step(
        self, run_id: str, adam: AdamParams, reduce: GradReduce | None = None
    ) -> OptimStepResult:
        """Clip the accumulated gradient to `adam.grad_clip_norm`, take one AdamW step and
        clear the gradients. `reduce` sees the parameters first, before the norm, so a worker
        group's ranks clip and step on the summed gradient and make the same decisions
        (including refusing a non-finite one)."""
        with self._lock:
            run = self._run(run_id)
            check_adam(adam)
            params = run.adapter.parameters()
            if reduce is not None:
                reduce(params)
            grads = [p.grad for p in params if p.grad is not None]
            norm = (
                torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                if grads
                else None
            )
            grad_norm = float(norm) if norm is not None else 0.0
            if grads and not np.isfinite(grad_norm):
                run.adapter.zero_grad()
                raise UserInputError(
                    "the accumulated gradient is not finite (NaN or inf); the "
                    "step was skipped and gradients cleared: lower the "
                    "learning rate or check advantages/weights"
                )
            if adam.grad_clip_norm > 0 and grads and grad_norm > adam.grad_clip_norm:
                for g in grads:
                    g.mul_(adam.grad_clip_norm / (grad_norm + 1e-6))
            for group in run.optimizer.param_groups:
                group.update(
                    lr=adam.learning_rate,
                    betas=(adam.beta1, adam.beta2),
                    eps=adam.eps,
                    weight_decay=adam.weight_decay,
                )
            self._loops.freeze(run.adapter)  # samples already running keep these weights
            run.optimizer.step()
            run.adapter.zero_grad()
            run.steps += 1
            return OptimStepResult(
                {
                    "grad_norm:mean": grad_norm,
                    "learning_rate:mean": adam.learning_rate,
                    "step:max": float(run.steps),
                }
            )

    def clear_gradients(self, run_id: str) -> None:
        """Drop the gradients accumulated since the last optimizer step; weights and optimizer
        state stay as they are."""
        with self._lock:
            self._run(run_id).adapter.zero_grad()

    # --- sampling -----------------------------------------------------------------------

    def sample_start(
        self, key: str, req: SampleRequest, indices: list[int] | None = None
    ) -> OpError | None:
        """Validate `req` and add it, under `key` (unique among unfinished jobs), to its base
        model's running decode loop; its rows join at the next `sample_step`. An OpError when
        refused; a key already in use raises ValueError (the caller's mistake).

        `indices` starts only those of the request's samples (a worker group's share; see
        `Job.indices`), and computes the prompt logprobs only if it holds sample 0, so that
        one share of the request pays for them."""
        with self._lock:
            try:
                m, job = self._job(req, indices)
            except UserInputError as exc:
                return OpError.of_input(exc)
            self._loops.start(key, m.name, job)
            return None

    def check_sample(self, req: SampleRequest) -> SampleRequest:
        """Validate `req` as `sample_start` would, without starting it; returns it with its
        seed fixed (drawn when it has none), so that the shares of it that a worker group's
        ranks start sample with one seed. Raises UserInputError when refused."""
        with self._lock:
            _, job = self._job(req)
            return replace(req, params=job.params)

    def sample_step(self) -> list[tuple[str, SampleResult | OpError]]:
        """One decode step of every base model's loop that has work (prefilling the jobs added
        since the last step); returns the jobs that finished in it, and those that finished
        during a `sample_batch` since the last call. A failure inside one model's loop ends all
        that loop's jobs with a server OpError marked `interrupted` and resets that loop
        (others go on)."""
        with self._lock:
            return self._loops.step()

    def sample_progress(self, key: str) -> list[list[int]]:
        """Tokens chosen so far for each sample of job `key`, by sample index (copies); empty
        for a key not started or already returned."""
        with self._lock:
            return self._loops.progress(key)

    def sample_abort(self, keys: Collection[str] | None = None) -> None:
        """Drop unfinished jobs (all when None), freeing their cache rows; unknown keys are
        ignored."""
        with self._lock:
            self._loops.abort(keys)

    @property
    def sampling(self) -> int:
        """How many jobs are started and not finished (or finished and not yet returned by
        `sample_step`)."""
        with self._lock:
            return len(self._loops)

    def frozen_memory_bytes(self) -> int:
        """Bytes of the adapter copies that samples still running keep after their run changed
        or dropped its weights (they go when those samples finish)."""
        with self._lock:
            live = {id(run.adapter) for run in self._runs.values()}
            return sum(a.num_bytes() for a in self._loops.adapters() if id(a) not in live)

    def sample_batch(self, requests: list[SampleRequest]) -> list[SampleResult | OpError]:
        """Sample all requests to completion in the running decode loops; other callers' jobs
        that finish meanwhile come out of the next `sample_step`."""
        with self._lock:
            out: dict[int, SampleResult | OpError] = {}
            keys: dict[str, int] = {}
            batch = next(self._batches)
            for i, req in enumerate(requests):
                key = f"{_BATCH_KEY}{batch}/{i}"
                refused = self.sample_start(key, req)
                if refused is None:
                    keys[key] = i
                else:
                    out[i] = refused
            for key, outcome in self._loops.finish(keys).items():
                out[keys[key]] = outcome
            return [out.get(i, OpError("server", "not executed")) for i in range(len(requests))]

    def _job(self, req: SampleRequest, indices: list[int] | None = None) -> tuple[_Model, Job]:
        if indices is not None and (
            not indices
            or len(set(indices)) < len(indices)
            or not all(0 <= i < req.num_samples for i in indices)
        ):
            raise ValueError(f"sample indices {indices}: distinct, within the request's samples")
        m, adapter = self._sampler(req.run_id, req.base_model)
        info = m.info
        prompt = check_tokens(req.prompt, info.vocab_size, info.max_context_length, "prompt")
        check_sampling(req.params, prompt.size, info.max_context_length, req.num_samples)
        stop_ids, stop_strings = resolve_stop(req.params.stop, self._eos(m))
        params = req.params
        if params.seed is None:
            # drawn here, when the job is made, rather than when the sampler admits it, so
            # the engine that accepts a job fixes its noise (and can hand the seed on)
            params = replace(params, seed=secrets.randbits(62))
        scores = indices is None or 0 in indices
        job = Job(
            prompt.tolist(),
            params,
            req.num_samples if indices is None else len(indices),
            adapter,
            stop_ids,
            stop_strings,
            prompt_logprobs=req.prompt_logprobs and scores,
            topk_prompt_logprobs=req.topk_prompt_logprobs if scores else 0,
            indices=indices,
        )
        return m, job

    def _new_sampler(self, name: str) -> Sampler:
        m = self._models[name]
        return Sampler(m.model, m.ctx, self._tokenizer(m), self.device, self.autocast_dtype)

    def _sampler(
        self, run_id: str | None, base_model: str | None
    ) -> tuple[_Model, LoraAdapter | None]:
        if run_id is not None:
            run = self._run(run_id)
            return run.model, run.adapter
        if base_model is None:
            raise UserInputError("name a run_id or a base_model to sample from")
        return self._model(base_model), None

    def _eos(self, m: _Model) -> list[int]:
        eos = getattr(m.model.config, "eos_token_id", None)
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        tok_eos = getattr(self._tokenizer(m), "eos_token_id", None)
        if tok_eos is not None and tok_eos not in ids:
            ids.append(tok_eos)
        return [int(i) for i in ids]

    # --- checkpoints --------------------------------------------------------------------

    def save_state(self, run_id: str, path: str | Path, include_optimizer: bool = True) -> None:
        with self._lock:
            run = self._run(run_id)
            checkpoint.save_state(
                run.adapter,
                run.optimizer if include_optimizer else None,
                run.steps,
                Path(path),
                run.model.name,
            )

    def load_state(
        self,
        run_id: str,
        path: str | Path,
        include_optimizer: bool = True,
        base_model: str | None = None,
    ) -> None:
        """Replace (or create) the run from a saved state; gradients are cleared."""
        with self._lock:
            state = checkpoint.read_state(Path(path), include_optimizer)
            self.load_state_tensors(run_id, state, base_model)

    def load_state_tensors(
        self, run_id: str, state: checkpoint.SavedState, base_model: str | None = None
    ) -> None:
        """`load_state` from a state already read into memory: a worker group's rank 0 reads
        the folder once and sends the tensors to the other ranks, which need no access to it.
        The optimizer moments (and step count) are restored when the state holds them."""
        with self._lock:
            meta = state.meta
            spec = checkpoint.spec_from_meta(meta)
            check_lora_spec(spec, self.settings.max_lora_rank)
            name = base_model or (
                self._runs[run_id].model.name if run_id in self._runs else meta["base_model"]
            )
            m = self._model(name)
            if self.catalog.resolve(meta["base_model"]).name != m.name:
                raise UserInputError(
                    f"state at {state.folder} was trained on {meta['base_model']}, "
                    f"not {m.name}; load it into a run on that base model"
                )
            run = self._new_run(run_id, m, spec)
            run.adapter.load_named_tensors(state.adapter)
            if state.optimizer is not None:
                checkpoint.apply_optimizer_state(run.adapter, run.optimizer, state.optimizer)
                run.steps = int(meta.get("optim_steps", 0))
            if run_id in self._runs:
                self._loops.freeze(self._runs[run_id].adapter)
            self._runs[run_id] = run

    def export_adapter(self, run_id: str, path: str | Path) -> None:
        """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""
        self.save_state(run_id, path, include_optimizer=False)

    def export_merged(self, run_id: str, path: str | Path) -> None:
        """A Hugging Face model folder with the adapter merged in, plus tokenizer files."""
        self.write_merged(run_id, self.prepare_merged(run_id, path))

    def prepare_merged(self, run_id: str, path: str | Path) -> checkpoint.MergedTarget:
        """What a merged export does before it gathers any weight, which can fail: the run
        known, the folder made, the tokenizer files found."""
        with self._lock:
            run = self._run(run_id)
            return checkpoint.prepare_merged(Path(path), self.tokenizer_dir(run.model.name))

    def write_merged(self, run_id: str, target: checkpoint.MergedTarget | None) -> None:
        """Gather the whole weights and write them to `target` with the adapter merged in. On
        a sharded base every rank must call it, as the gathers are collectives; a rank given
        no `target` only takes part in them, holding one whole weight at a time, and writes
        nothing. Once the gathers are done nothing else is a collective, so a failure to
        write is this rank's alone (`checkpoint.WriteFailed`)."""
        with self._lock:
            run = self._run(run_id)
            state = checkpoint.full_state(run.model.model, keep=target is not None)
            if target is None:
                return
            try:
                checkpoint.write_merged(run.model.model, run.adapter, state, target)
            except Exception as exc:
                raise checkpoint.WriteFailed(f"{type(exc).__name__}: {exc}") from exc
