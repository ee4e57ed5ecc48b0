"""A worker group of two gloo ranks whose engines shard the base model (FSDP2) against one
engine: five training steps of three runs, a batch that leaves rank 1 with an empty slice and
fewer passes (it must pad with dummy passes, or the ranks' all-gathers hang), mirrored seeded
sampling, a merged export that gathers the weights, merged exports that fail on rank 0 alone
(before the gathers, and in the write after them) while the group goes on serving, and each
rank's share of the base; and, in this process, that a sharded engine shards its model before
anything moves it to its device.

The group is started once per module, as in `test_group`, with the session and helpers both
share from `group_helpers`; passes are cut at 64 tokens so that the ranks' pass counts differ.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from gpu_worker import checkpoint, fsdp
from gpu_worker.checkpoint import STATE_FILE
from gpu_worker.engine import Engine, EngineSettings
from gpu_worker.protocol import (
    Datum,
    ForwardBackwardOp,
    ForwardBackwardResult,
    LoraSpec,
    SampleResult,
    UserInputError,
)
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
    start_group,
    step_ops,
)
from tests.gpu_worker.helpers import TINY, VOCAB, assert_same_loss, training_run

pytestmark = pytest.mark.unit

PASS_TOKENS = 64
HEAD_ONLY = "head-only"  # an adapter on the unembedding alone: no layer of it needs a backward
HEAD_LORA = LoraSpec(rank=4, seed=4, train_attn=False, train_mlp=False)


def _datum(T: int, seed: int) -> Datum:
    rng = np.random.default_rng(seed)
    inputs: dict[str, np.ndarray] = {
        "target_tokens": rng.integers(0, VOCAB, T),
        "weights": rng.uniform(0, 1, T).astype(np.float32),
    }
    return Datum(rng.integers(0, VOCAB, T), inputs)


def uneven_ops(runs: dict[str, str]) -> list[ForwardBackwardOp]:
    """Rank 0 gets the 60-token datum, the 20-token op and the forward-only op (one datum each
    stays on the first rank): two backward passes and a forward pass. Rank 1 gets the two
    30-token datums: one backward pass, and an empty slice of the other two ops."""
    return [
        ForwardBackwardOp(runs[HEAD_ONLY], [_datum(60, 1), _datum(30, 2), _datum(30, 3)]),
        ForwardBackwardOp(runs["ce"], [_datum(20, 4)]),
        ForwardBackwardOp(runs["ppo"], [_datum(25, 5)], forward_only=True),
    ]


# --- what the ranks run -----------------------------------------------------------------


def _drive(group: Any, out: Path) -> dict[str, Any]:
    seen: dict[str, Any] = {"fb": [], "optim": []}
    for run, (_, rank) in RUNS.items():
        group.create_run(run, TINY, lora(rank))
    for step in range(STEPS):
        seen["fb"].append(group.forward_backward_batch(step_ops(step)))
        seen["optim"].append([group.optim_step(run, ADAM).metrics for run in RUNS])
    seen["after_steps"] = {
        run: {k: v.clone() for k, v in group.adapter(run).named_tensors().items()} for run in RUNS
    }

    group.save_state("ce", out / "ce_before_uneven")
    group.create_run(HEAD_ONLY, TINY, HEAD_LORA)
    seen["uneven"] = group.forward_backward_batch(uneven_ops({r: r for r in (*RUNS, HEAD_ONLY)}))
    seen["uneven_optim"] = [group.optim_step(run, ADAM).metrics for run in (HEAD_ONLY, "ce")]
    try:
        group.create_run("other", "treadle/tiny-10m", lora(2))
        seen["other_model"] = None
    except UserInputError as exc:
        seen["other_model"] = str(exc)

    group.load_state(SAMPLER, out / "single_ckpt")
    for i, request in enumerate(REQUESTS):
        assert group.sample_start(f"k{i}", request) is None
    seen["streamed"] = {}
    while group.sampling:
        seen["streamed"].update(group.sample_step())
    seen["batch"] = group.sample_batch([REQUESTS[2], REQUESTS[1]])

    seen["export_unmade"] = _export_error(group, out / "single_ckpt" / STATE_FILE / "merged")
    with mock.patch.object(checkpoint, "save_file", side_effect=OSError(28, "No space left")):
        seen["export_unwritten"] = _export_error(group, out / "merged_unwritten")
    group.export_merged("ce", out / "merged")  # the group still serves
    return seen


def _export_error(group: Any, path: Path) -> tuple[str, str] | None:
    """How a merged export of "ce" to `path` failed on rank 0 (its type and message)."""
    try:
        group.export_merged("ce", path)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _rank_main(rank: int, out: Path) -> None:
    import torch.distributed as dist

    from gpu_worker.group import GroupComm, GroupEngine, follow

    join_gloo(rank, out)
    try:
        engine = Engine(
            EngineSettings(
                device="cpu",
                precision="fp32",
                num_threads=1,
                max_tokens_per_pass=PASS_TOKENS,
                models=(TINY,),
                shard_base=True,
            )
        )
        (out / f"base_bytes{rank}").write_text(str(engine.base_memory_bytes()))
        comm = GroupComm(idle_timeout=TIMEOUT)
        if rank == 0:
            group = GroupEngine(engine, comm)
            try:
                seen = _drive(group, out)
            finally:
                group.close()
            (out / "seen.pkl").write_bytes(pickle.dumps(seen))
        else:
            follow(engine, comm)
        for run in engine.run_ids():
            engine.save_state(run, out / f"rank{rank}" / run)
    finally:
        dist.destroy_process_group()


# --- the test side ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def group_dir(tmp_path_factory, engine) -> Path:
    out = tmp_path_factory.mktemp("fsdp_group")
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


def test_each_rank_holds_half_the_base(engine, group_dir):
    full = sum(p.numel() * p.element_size() for p in engine.base_module(TINY).parameters())
    for rank in range(WORLD):
        assert int((group_dir / f"base_bytes{rank}").read_text()) * WORLD == full


def test_five_steps_on_a_sharded_base_equal_one_engine(engine, seen):
    assert_steps_equal_one_engine(engine, seen, "fsdp-ref-")


def test_an_empty_slice_and_uneven_passes_finish_and_equal_one_engine(engine, group_dir, seen):
    from gpu_worker import checkpoint

    names = {run: f"uneven-{run}" for run in ("ce", "ppo", HEAD_ONLY)}
    engine.load_state(names["ce"], group_dir / "ce_before_uneven")
    engine.load_state(names["ppo"], group_dir / "rank0" / "ppo")  # only a forward since
    engine.create_run(names[HEAD_ONLY], TINY, HEAD_LORA)
    try:
        results = engine.forward_backward_batch(uneven_ops(names))
        for got, want in zip(seen["uneven"], results, strict=True):
            assert isinstance(got, ForwardBackwardResult)
            assert isinstance(want, ForwardBackwardResult)
            assert_same_loss(got, want)
        for run, metrics in zip((HEAD_ONLY, "ce"), seen["uneven_optim"], strict=True):
            want_metrics = engine.optim_step(names[run], ADAM).metrics
            assert metrics["grad_norm:mean"] == pytest.approx(
                want_metrics["grad_norm:mean"], rel=1e-4
            )
            saved = checkpoint.read_state(group_dir / "rank0" / run, include_optimizer=False)
            want = engine.adapter(names[run]).named_tensors()
            for key, value in saved.adapter.items():
                torch.testing.assert_close(value, want[key], rtol=0, atol=1e-5)
    finally:
        for name in names.values():
            engine.remove_run(name)


def test_replicas_stay_bitwise_equal_and_other_models_are_refused(group_dir, seen):
    runs = sorted(p.name for p in (group_dir / "rank0").iterdir() if p.is_dir())
    assert set(runs) == {*RUNS, HEAD_ONLY, SAMPLER}
    for run in runs:
        for name in ("adapter_model.safetensors", "optimizer.safetensors"):
            a = (group_dir / "rank0" / run / name).read_bytes()
            assert a == (group_dir / "rank1" / run / name).read_bytes(), f"{run}/{name}"
    assert seen["other_model"] is not None and "serves only" in seen["other_model"]


def test_seeded_sampling_on_a_sharded_base_equals_one_engine(engine, group_dir, seen):
    from dataclasses import replace

    engine.load_state("fsdp-sampler", group_dir / "single_ckpt")
    try:
        requests = [
            replace(r, run_id="fsdp-sampler") if r.run_id == SAMPLER else r for r in REQUESTS
        ]
        expected = engine.sample_batch(requests)
    finally:
        engine.remove_run("fsdp-sampler")
    assert all(isinstance(r, SampleResult) for r in expected)
    assert sorted(seen["streamed"]) == [f"k{i}" for i in range(len(REQUESTS))]
    for i, want in enumerate(expected):
        assert isinstance(want, SampleResult)
        assert_same_samples(seen["streamed"][f"k{i}"], want)
    assert isinstance(expected[2], SampleResult) and isinstance(expected[1], SampleResult)
    assert_same_samples(seen["batch"][0], expected[2])
    assert_same_samples(seen["batch"][1], expected[1])


def test_a_merged_export_gathers_the_sharded_base(engine, group_dir, tmp_path):
    engine.load_state("fsdp-merged", group_dir / "rank0" / "ce")
    try:
        engine.export_merged("fsdp-merged", tmp_path / "merged")
    finally:
        engine.remove_run("fsdp-merged")
    got = load_file(str(group_dir / "merged" / "model.safetensors"))
    want = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert (group_dir / "merged" / "config.json").read_text() == (
        tmp_path / "merged" / "config.json"
    ).read_text()


def test_a_merged_export_that_fails_on_rank_0_fails_alone(group_dir, seen):
    # a folder rank 0 cannot make fails before any rank gathers; a write that fails after
    # the gathers (a full disk) fails the export, not the group, which goes on to export
    unmade, unwritten = seen["export_unmade"], seen["export_unwritten"]
    assert unmade is not None and unmade[0] in ("NotADirectoryError", "FileExistsError")
    assert unwritten == ("RuntimeError", "OSError: [Errno 28] No space left")
    assert not (group_dir / "merged_unwritten" / "model.safetensors").exists()
    assert (group_dir / "merged" / "model.safetensors").exists()


def test_a_sharded_engine_never_moves_the_whole_model_to_its_device(tmp_path, monkeypatch):
    """The model is sharded on the CPU, where it was loaded, and `fully_shard` moves each
    unit's shard to the device. On the CPU the device is where the model already is, so what
    can be seen here is the order: no `Module.to` with a device before the model is sharded
    (on a GPU such a call would put the whole model on one device), and every weight of the
    units a DTensor on the device after."""
    import torch.distributed as dist

    events: list[tuple[str, torch.device | None]] = []
    module_to = torch.nn.Module.to
    shard_model = fsdp.shard_model

    def spy_to(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        events.append(("to", device))
        return module_to(module, *args, **kwargs)

    def spy_shard(*args: Any) -> None:
        events.append(("shard", None))
        shard_model(*args)

    monkeypatch.setattr(torch.nn.Module, "to", spy_to)
    monkeypatch.setattr(fsdp, "shard_model", spy_shard)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        engine = Engine(
            EngineSettings(device="cpu", precision="fp32", models=(TINY,), shard_base=True)
        )
        model = engine.base_module(TINY)
    finally:
        dist.destroy_process_group()
    assert ("shard", None) in events
    before = events[: events.index(("shard", None))]
    assert [device for _, device in before if device is not None] == []
    layers: Any = model.get_decoder().layers  # type: ignore[operator]
    layer_weights = [p for layer in layers for p in layer.parameters()]
    assert layer_weights and all(isinstance(p, DTensor) for p in layer_weights)
    assert all(p.device == engine.device for p in model.parameters())
    assert all(b.device == engine.device for b in model.buffers())
