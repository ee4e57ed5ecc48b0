"""A worker group of two gloo ranks (spawned processes) against one engine: five training steps
of three runs batched together, checkpoints both ways, a failure injected on rank 1, a
non-finite gradient on rank 1, and replicas bitwise equal at the end; then sampling split by
sample over the ranks (streamed, batched, aborted, and interrupted on rank 1).

The group is started once per module: rank 0 drives a scripted session through `GroupEngine`
and records what it saw, both ranks write their replicas, and the tests compare that with the
session-wide engine of `conftest` running the same calls.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gpu_worker.engine import Engine, EngineSettings
from gpu_worker.protocol import (
    ForwardBackwardOp,
    ForwardBackwardResult,
    OpError,
    SampleRequest,
    SampleResult,
    UserInputError,
)
from gpu_worker.sampling import Sampler
from tests.gpu_worker.group_helpers import (
    ADAM,
    REQUESTS,
    RUNS,
    SAMPLER,
    STEPS,
    TIMEOUT,
    WORLD,
    assert_same_samples,
    assert_steps_equal_one_engine,
    datums,
    join_gloo,
    lora,
    sampling_params,
    start_group,
    step_ops,
)
from tests.gpu_worker.helpers import TINY, assert_same_loss, training_run

pytestmark = pytest.mark.unit

VICTIM, BYSTANDER, NAN_RUN = "victim", "bystander", "nan-run"


# --- what the ranks run -----------------------------------------------------------------


def _drive(group: Any, out: Path) -> dict[str, Any]:
    """Rank 0's session, through the GroupEngine; returns what it saw."""
    seen: dict[str, Any] = {"fb": [], "optim": [], "pending": []}
    for run, (_, rank) in RUNS.items():
        group.create_run(run, TINY, lora(rank))
    for step in range(STEPS):
        seen["fb"].append(group.forward_backward_batch(step_ops(step)))
        seen["pending"].append([group.gradients_pending(run) for run in RUNS])
        seen["optim"].append([group.optim_step(run, ADAM).metrics for run in RUNS])
    seen["pending_after"] = [group.gradients_pending(run) for run in RUNS]
    seen["after_steps"] = {
        run: {k: v.clone() for k, v in group.adapter(run).named_tensors().items()} for run in RUNS
    }

    # a checkpoint written by the group, then one more step on it
    group.save_state("ce", out / "group_ckpt")
    seen["ce_next"] = group.forward_backward("ce", datums(777, "cross_entropy"))
    group.optim_step("ce", ADAM)

    # a checkpoint written by one engine, loaded into the group, then one more step on it
    group.load_state("loaded", out / "single_ckpt")
    seen["loaded_steps"] = group.steps("loaded")
    seen["loaded_next"] = group.forward_backward("loaded", datums(778, "cross_entropy"))
    group.optim_step("loaded", ADAM)

    # an op failing on rank 1 only: it fails, its batch-mate does not, gradients go back
    group.create_run(VICTIM, TINY, lora(4))
    group.create_run(BYSTANDER, TINY, lora(4))
    group.forward_backward(VICTIM, datums(900, "cross_entropy"))
    (out / "inject-fail").touch()
    try:
        seen["injected"] = group.forward_backward_batch(
            [
                ForwardBackwardOp(VICTIM, datums(901, "cross_entropy")),
                ForwardBackwardOp(BYSTANDER, datums(902, "cross_entropy")),
            ]
        )
    finally:
        (out / "inject-fail").unlink()
    seen["victim_pending"] = group.gradients_pending(VICTIM)

    # a gradient that is not finite on rank 1 only: both ranks refuse the step alike
    group.create_run(NAN_RUN, TINY, lora(2))
    (out / "inject-nan").touch()
    try:
        group.forward_backward(NAN_RUN, datums(903, "cross_entropy"))
    finally:
        (out / "inject-nan").unlink()
    try:
        group.optim_step(NAN_RUN, ADAM)
        seen["nan_refused"] = None
    except UserInputError as exc:
        seen["nan_refused"] = str(exc)
    seen["nan_pending"] = group.gradients_pending(NAN_RUN)
    group.forward_backward(NAN_RUN, datums(904, "cross_entropy"))  # the group still works
    seen["nan_after"] = group.optim_step(NAN_RUN, ADAM).metrics
    _drive_sampling(group, out, seen)
    return seen


def _sample_until_idle(group: Any, watch: list[str]) -> tuple[dict[str, Any], list[Any]]:
    """Step until no request is left; each key's outcome, and the watched keys' progress
    after every step."""
    outcomes: dict[str, Any] = {}
    progress = []
    while group.sampling:
        for key, outcome in group.sample_step():
            assert key not in outcomes, f"{key} came out twice"
            outcomes[key] = outcome
        progress.append([group.sample_progress(key) for key in watch])
    return outcomes, progress


def _drive_sampling(group: Any, out: Path, seen: dict[str, Any]) -> None:
    group.load_state(SAMPLER, out / "single_ckpt")
    for i, request in enumerate(REQUESTS):
        assert group.sample_start(f"k{i}", request) is None
    seen["streamed"], seen["progress"] = _sample_until_idle(group, ["k0", "k2"])
    seen["batch"] = group.sample_batch([REQUESTS[2], REQUESTS[1]])

    group.sample_start(
        "long", SampleRequest([9, 9, 9], sampling_params(15, 40), 2, base_model=TINY)
    )
    group.sample_step()
    group.sample_step()
    group.sample_abort(["long"])
    seen["sampling_after_abort"] = group.sampling
    seen["after_abort"], _ = _sample_until_idle(group, [])
    group.sample_start("k0-again", REQUESTS[0])
    seen["again"], _ = _sample_until_idle(group, [])

    (out / "inject-decode").touch()
    try:
        group.sample_start(
            "doomed", SampleRequest([8, 8], sampling_params(16, 6), 4, base_model=TINY)
        )
        seen["doomed_step"] = group.sample_step()
    finally:
        (out / "inject-decode").unlink()
    seen["doomed_rest"], _ = _sample_until_idle(group, [])
    group.sample_start("k3-after", REQUESTS[3])
    seen["after_doomed"], _ = _sample_until_idle(group, [])


def _inject_on_rank_1(engine: Engine, out: Path) -> None:
    """Rank 1's engine fails passes holding the victim, or poisons gradients, while the
    driver's marker files exist (rank 0 creates them before sending the op)."""
    execute = engine._execute

    def injected(checked: list[Any]) -> list[ForwardBackwardResult]:
        if (out / "inject-fail").exists() and any(c.run_id == VICTIM for c in checked):
            raise RuntimeError("injected failure on rank 1")
        results = execute(checked)
        if (out / "inject-nan").exists():
            for c in checked:
                for p in engine.adapter(c.run_id).parameters():
                    if p.grad is not None:
                        p.grad.fill_(float("nan"))
        return results

    setattr(engine, "_execute", injected)  # noqa: B010 (an instance attribute, on purpose)

    decode_step = Sampler.step

    def failing_step(self: Sampler) -> list[Any]:
        if (out / "inject-decode").exists():
            raise RuntimeError("injected decode failure on rank 1")
        return decode_step(self)

    setattr(Sampler, "step", failing_step)  # noqa: B010 (this process is rank 1 alone)


def _rank_main(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from gpu_worker.group import GroupComm, GroupEngine, follow

    join_gloo(rank, out)
    try:
        engine = Engine(EngineSettings(device="cpu", precision="fp32", num_threads=1))
        comm = GroupComm(idle_timeout=TIMEOUT)
        if rank == 0:
            group = GroupEngine(engine, comm)
            try:
                seen = _drive(group, out)
            finally:
                group.close()
            (out / "seen.pkl").write_bytes(pickle.dumps(seen))
        else:
            _inject_on_rank_1(engine, out)
            follow(engine, comm)
        grads = {}
        for run in engine.run_ids():
            engine.save_state(run, out / f"rank{rank}" / run)
            grads[run] = [p.grad for p in engine.adapter(run).parameters()]
        torch.save(grads, out / f"rank{rank}" / "grads.pt")
    finally:
        dist.destroy_process_group()


# --- the test side ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def group_dir(tmp_path_factory, engine) -> Path:
    out = tmp_path_factory.mktemp("group")
    with training_run(engine, "to-load", lora(4)):
        for step in range(2):
            engine.forward_backward("to-load", datums(500 + step, "cross_entropy"))
            engine.optim_step("to-load", ADAM)
        engine.save_state("to-load", out / "single_ckpt")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start_group(out, _rank_main)
    return out


@pytest.fixture(scope="module")
def seen(group_dir) -> dict[str, Any]:
    return pickle.loads((group_dir / "seen.pkl").read_bytes())


def _grads(engine: Engine, run: str) -> list[torch.Tensor]:
    return [p.grad.clone() for p in engine.adapter(run).parameters() if p.grad is not None]


def _group_grads(group_dir: Path, run: str) -> list[torch.Tensor]:
    """The run's gradient summed over the ranks' replicas."""
    per_rank = [torch.load(group_dir / f"rank{r}" / "grads.pt")[run] for r in range(WORLD)]
    return [sum(g for g in grads if g is not None) for grads in zip(*per_rank, strict=True)]


def test_five_steps_of_three_runs_equal_one_engine(engine, seen):
    assert_steps_equal_one_engine(engine, seen, "group-ref-")
    assert seen["pending"] == [[True] * len(RUNS)] * STEPS
    assert seen["pending_after"] == [False] * len(RUNS)


def test_replicas_are_bitwise_equal(group_dir):
    runs = sorted(p.name for p in (group_dir / "rank0").iterdir() if p.is_dir())
    assert set(RUNS) | {"loaded", VICTIM, BYSTANDER, NAN_RUN, SAMPLER} == set(runs)
    for run in runs:
        for name in ("adapter_model.safetensors", "optimizer.safetensors", "treadle_state.json"):
            a = (group_dir / "rank0" / run / name).read_bytes()
            b = (group_dir / "rank1" / run / name).read_bytes()
            assert a == b, f"{run}/{name} differs between the ranks"


def test_a_group_checkpoint_loads_into_one_engine_and_continues_alike(engine, group_dir, seen):
    engine.load_state("from-group", group_dir / "group_ckpt")
    try:
        saved = seen["after_steps"]["ce"]
        for key, value in engine.adapter("from-group").named_tensors().items():
            assert torch.equal(value, saved[key])  # written once, in the one-engine format
        assert engine.steps("from-group") == STEPS
        assert_same_loss(
            seen["ce_next"], engine.forward_backward("from-group", datums(777, "cross_entropy"))
        )
        engine.optim_step("from-group", ADAM)
        engine.save_state("from-group", group_dir / "continued")
        _assert_close_states(group_dir / "continued", group_dir / "rank0" / "ce")
    finally:
        engine.remove_run("from-group")


def test_one_engines_checkpoint_loads_into_the_group_and_continues_alike(engine, group_dir, seen):
    assert seen["loaded_steps"] == 2
    engine.load_state("reloaded", group_dir / "single_ckpt")
    try:
        want = engine.forward_backward("reloaded", datums(778, "cross_entropy"))
        assert_same_loss(seen["loaded_next"], want)
        engine.optim_step("reloaded", ADAM)
        engine.save_state("reloaded", group_dir / "reloaded")
        _assert_close_states(group_dir / "reloaded", group_dir / "rank0" / "loaded")
    finally:
        engine.remove_run("reloaded")


def _assert_close_states(a: Path, b: Path) -> None:
    from gpu_worker import checkpoint

    left = checkpoint.read_state(a, include_optimizer=True)
    right = checkpoint.read_state(b, include_optimizer=True)
    assert left.meta == right.meta
    for x, y in ((left.adapter, right.adapter), (left.optimizer, right.optimizer)):
        assert x is not None and y is not None
        assert x.keys() == y.keys()
        for key in x:
            torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-5)


def test_a_failure_on_rank_1_fails_only_its_op_and_restores_gradients(engine, group_dir, seen):
    victim, bystander = seen["injected"]
    assert isinstance(victim, OpError)
    assert victim.category == "server" and "injected failure on rank 1" in victim.message
    assert isinstance(bystander, ForwardBackwardResult)
    assert seen["victim_pending"]  # the first op's gradient is still there
    with training_run(engine, "ref-victim", lora(4)), training_run(engine, "ref-by", lora(4)):
        engine.forward_backward("ref-victim", datums(900, "cross_entropy"))
        assert_same_loss(bystander, engine.forward_backward("ref-by", datums(902, "cross_entropy")))
        # summed over the ranks, each run's gradient is exactly what its successful ops left
        for run, ref in ((VICTIM, "ref-victim"), (BYSTANDER, "ref-by")):
            for got, want in zip(_group_grads(group_dir, run), _grads(engine, ref), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_non_finite_gradient_on_one_rank_is_refused_by_all_and_the_group_goes_on(seen):
    assert seen["nan_refused"] is not None and "not finite" in seen["nan_refused"]
    assert seen["nan_pending"] is False
    assert seen["nan_after"]["step:max"] == 1.0  # the refused step was not counted
    assert np.isfinite(seen["nan_after"]["grad_norm:mean"])


# --- sampling ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def expected_samples(engine, group_dir) -> list[SampleResult]:
    """REQUESTS sampled by one engine, on the same weights."""
    engine.load_state("ref-sampler", group_dir / "single_ckpt")
    try:
        requests = [
            replace(r, run_id="ref-sampler") if r.run_id == SAMPLER else r for r in REQUESTS
        ]
        results = engine.sample_batch(requests)
    finally:
        engine.remove_run("ref-sampler")
    assert all(isinstance(r, SampleResult) for r in results)
    return results


def test_sampling_split_over_the_ranks_equals_one_engine(seen, expected_samples):
    assert sorted(seen["streamed"]) == [f"k{i}" for i in range(len(REQUESTS))]
    for i, want in enumerate(expected_samples):
        assert_same_samples(seen["streamed"][f"k{i}"], want)
    batch = seen["batch"]
    assert_same_samples(batch[0], expected_samples[2])
    assert_same_samples(batch[1], expected_samples[1])


def test_progress_streams_every_ranks_tokens_as_they_come(seen, expected_samples):
    final = [[s.tokens for s in expected_samples[i].sequences] for i in (0, 2)]
    history = seen["progress"]
    for step, watched in enumerate(history):
        for progress, tokens in zip(watched, final, strict=True):
            if not progress and step + 1 >= min(len(t) for t in tokens):
                continue  # finished and returned, as on one engine
            assert len(progress) == len(tokens)
            for got, want in zip(progress, tokens, strict=True):
                assert got == want[: len(got)]  # a prefix of what the sample ends with
                if step < 3:
                    assert len(got) == step + 1  # samples on both ranks, a token a step
    # k0's samples are dealt out to both ranks, and rank 1's tokens arrive by the step
    assert len({len(p) for p in history[2][0]}) == 1


def test_an_aborted_request_never_comes_back_and_frees_its_rows(seen, expected_samples):
    assert seen["sampling_after_abort"] == 0
    assert seen["after_abort"] == {}
    assert_same_samples(seen["again"]["k0-again"], expected_samples[0])


def test_a_share_interrupted_on_rank_1_interrupts_its_request(seen, expected_samples):
    ((key, outcome),) = seen["doomed_step"]
    assert key == "doomed"
    assert isinstance(outcome, OpError) and outcome.interrupted
    assert "injected decode failure on rank 1" in outcome.message
    assert seen["doomed_rest"] == {}  # rank 0's share was dropped, not returned
    assert_same_samples(seen["after_doomed"]["k3-after"], expected_samples[3])


# --- a rank that dies -------------------------------------------------------------------


def _dying_main(rank: int, out: Path) -> None:
    """Rank 1 exits in the middle of a command; rank 0 records what its calls then raise."""
    from gpu_worker.group import GroupComm, GroupEngine, GroupFailed, follow

    join_gloo(rank, out)
    engine = Engine(EngineSettings(device="cpu", precision="fp32", num_threads=1))
    comm = GroupComm(idle_timeout=TIMEOUT)
    if rank == 1:
        setattr(engine, "clear_gradients", lambda run_id: os._exit(0))  # noqa: B010
        follow(engine, comm)
        return
    group = GroupEngine(engine, comm)
    group.create_run("a", TINY, lora(2))
    seen: dict[str, Any] = {}
    for call in ("clear", "create", "close"):
        try:
            if call == "clear":
                group.clear_gradients("a")
            elif call == "create":
                group.create_run("b", TINY, lora(2))
            else:
                group.close()
            seen[call] = None
        except GroupFailed as exc:
            seen[call] = str(exc)
    seen["local_read"] = group.run_ids()  # what needs no collective still answers
    (out / "seen.pkl").write_bytes(pickle.dumps(seen))


def test_a_rank_that_dies_fails_the_group_at_once_and_for_good(tmp_path):
    start_group(tmp_path, _dying_main)
    seen = pickle.loads((tmp_path / "seen.pkl").read_bytes())
    assert seen["clear"] is not None and "ClearGradients" in seen["clear"]
    assert seen["create"] == seen["clear"]  # later calls fail without trying
    assert seen["close"] is None  # closing a failed group sends nothing
    assert seen["local_read"] == ["a"]
