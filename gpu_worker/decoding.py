"""The engine's running decode loops: one `Sampler` per base model, jobs under the caller's keys.

Jobs join their model's loop between steps and leave it when they finish or are aborted; a step
advances every loop that has work, once. Before a run's weights change, `freeze` points the
jobs still sampling them at one frozen copy, so a job samples the weights it started with. A
loop that raises ends its own jobs as interrupted and starts over empty; the other models'
loops go on. Results that finish while a caller waits for its own jobs (`finish`) are kept for
the next `step`, so no caller's result is lost.

This module knows nothing of runs, validation or where the keys come from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from gpu_worker.lora import LoraAdapter
from gpu_worker.protocol import OpError, SampleResult, Usage
from gpu_worker.sampling import Job, Sampler

log = logging.getLogger(__name__)

Outcome = SampleResult | OpError


def result_of(job: Job) -> SampleResult:
    """A finished job's answer: its sequences, the prompt scores it asked for, its usage."""
    sampled = sum(len(s.tokens) for s in job.sequences)
    usage = Usage(prefill_tokens=len(job.prompt), sampled_tokens=sampled)
    lp = job.prompt_lp if job.prompt_logprobs else None
    top = job.prompt_top if job.topk_prompt_logprobs > 0 else None
    return SampleResult(job.sequences, lp, top, usage)


class DecodeLoops:
    """Every base model's decode loop, created on a model's first job by `new_sampler`."""

    def __init__(self, new_sampler: Callable[[str], Sampler]) -> None:
        self._new_sampler = new_sampler
        self._samplers: dict[str, Sampler] = {}
        self._jobs: dict[str, tuple[str, Job]] = {}  # key -> (base model, job), unfinished
        self._held: dict[str, Outcome] = {}  # finished, not yet returned by `step`

    def __len__(self) -> int:
        """Jobs started whose outcome `step` has not returned yet."""
        return len(self._jobs) + len(self._held)

    def start(self, key: str, model: str, job: Job) -> None:
        if key in self._jobs or key in self._held:
            raise ValueError(f"sample key {key!r} is already in use; give each job its own key")
        if model not in self._samplers:
            self._samplers[model] = self._new_sampler(model)
        self._samplers[model].add(job)
        self._jobs[key] = (model, job)

    def step(self) -> list[tuple[str, Outcome]]:
        """One step of every loop with work; the jobs finished in it, after those held."""
        out = list(self._held.items())
        self._held.clear()
        for model, sampler in list(self._samplers.items()):
            if sampler.idle:
                continue
            keys = {id(job): key for key, (m, job) in self._jobs.items() if m == model}
            try:
                completed = sampler.step()
            except Exception as exc:
                log.exception(
                    "the decode loop of %s failed; interrupting its %d jobs", model, len(keys)
                )
                del self._samplers[model]  # the next job on this model starts a fresh loop
                error = OpError("server", f"{type(exc).__name__}: {exc}", interrupted=True)
                for key in keys.values():
                    del self._jobs[key]
                    out.append((key, error))
                continue
            for job in completed:
                key = keys[id(job)]
                del self._jobs[key]
                out.append((key, result_of(job)))
        return out

    def finish(self, keys: Collection[str]) -> dict[str, Outcome]:
        """Step until the jobs under `keys` are finished; returns their outcomes and holds the
        other jobs' that finish meanwhile for the next `step`."""
        wanted = {key for key in keys if key in self._jobs or key in self._held}
        mine: dict[str, Outcome] = {}
        while wanted - mine.keys():
            others: dict[str, Outcome] = {}
            for key, outcome in self.step():
                (mine if key in wanted else others)[key] = outcome
            self._held.update(others)
        return mine

    def progress(self, key: str) -> list[list[int]]:
        """Tokens chosen so far for each sample of job `key` (none for an unknown key)."""
        if key in self._jobs:
            model, job = self._jobs[key]
            return self._samplers[model].progress(job)
        held = self._held.get(key)
        if isinstance(held, SampleResult):
            return [list(s.tokens) for s in held.sequences]
        return []

    def abort(self, keys: Collection[str] | None = None) -> None:
        """Drop the jobs under `keys` (all when None), running or held; unknown keys are
        ignored."""
        chosen = list(self._jobs) + list(self._held) if keys is None else keys
        by_model: dict[str, list[Job]] = {}
        for key in chosen:
            self._held.pop(key, None)
            if key in self._jobs:
                model, job = self._jobs.pop(key)
                by_model.setdefault(model, []).append(job)
        for model, jobs in by_model.items():
            self._samplers[model].drop(jobs)

    def adapters(self) -> list[LoraAdapter]:
        """The distinct adapters the unfinished jobs sample (frozen copies among them)."""
        seen: dict[int, LoraAdapter] = {}
        for _, job in self._jobs.values():
            if job.adapter is not None:
                seen.setdefault(id(job.adapter), job.adapter)
        return list(seen.values())

    def freeze(self, adapter: LoraAdapter) -> None:
        """Point the unfinished jobs sampling `adapter` at one frozen copy of it, before the
        caller changes or drops it."""
        users = [job for _, job in self._jobs.values() if job.adapter is adapter]
        if users:
            frozen = adapter.frozen_copy()
            for job in users:
                job.adapter = frozen
