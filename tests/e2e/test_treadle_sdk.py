"""The treadle SDK trains, samples and checkpoints against an embedded server.

The same scenario as tests/e2e/test_tinker_training.py, driven by Treadle's own client, in
sync and asyncio variants; plus transient failures (503s, connections dropped after the
server received the request) that must be retried without running any op twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import multiprocessing
import pickle
import tarfile
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from fastapi import FastAPI
from rich.console import Console
from sqlalchemy import func, select
from typer.testing import CliRunner

import treadle
from core.tables import Operation
from tests.builders import tenant_factory
from tests.e2e.treadle_data import MODEL, sft_datum
from tests.sdk_client._worker import sample_tokens
from tests.server import LiveServer, build_app
from tests.services import free_port
from treadle import cli, types

pytestmark = pytest.mark.e2e


@pytest.fixture
def service(live_server: LiveServer) -> Iterator[treadle.ServiceClient]:
    with treadle.ServiceClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    ) as client:
        yield client


def test_sft_loop_loss_falls(service: treadle.ServiceClient) -> None:
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=3)
    batch = [sft_datum(i) for i in range(4)]
    losses = []
    for _ in range(6):
        fwd = trainer.forward_backward(batch, "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(fwd.result().metrics["loss:sum"])
        assert "grad_norm:mean" in (step.result().metrics or {})
    assert losses[-1] < 0.7 * losses[0], losses
    info = trainer.get_info()
    assert info.model_data.model_name == MODEL and info.lora_rank == 8
    tokenizer = trainer.get_tokenizer()
    assert tokenizer.decode(tokenizer.encode("hello world")).strip() == "hello world"


def test_rl_step_with_sampling_and_policy_losses(service: treadle.ServiceClient) -> None:
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=1)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([11, 12, 13, 14])
    futures = [
        sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, seed=5 + i)) for i in range(2)
    ]
    sequences = [seq for f in futures for seq in f.result().sequences]
    assert len(sequences) == 4 and all(s.sequence_id for s in sequences)
    for loss_fn in ("importance_sampling", "ppo"):
        data = []
        for i, seq in enumerate(sequences):
            assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
            tokens = prompt.to_ints() + seq.tokens
            pad = len(prompt.to_ints()) - 1
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * pad + list(seq.logprobs),
                        "advantages": [0.0] * pad + [1.0 if i % 2 else -1.0] * len(seq.tokens),
                    },
                )
            )
        out = trainer.forward_backward(data, loss_fn)
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        assert "loss:sum" in out.result().metrics


def test_custom_dpo_style_loss(service: treadle.ServiceClient) -> None:
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=2)
    chosen, rejected = sft_datum(1), sft_datum(2)

    def dpo_loss(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        weights = [d.loss_fn_inputs["weights"].to_torch() for d in data]
        margin = (logprobs[0] * weights[0]).sum() - (logprobs[1] * weights[1]).sum()
        return -torch.nn.functional.logsigmoid(0.1 * margin), {"margin": margin.item()}

    first = trainer.forward_backward_custom([chosen, rejected], dpo_loss)
    trainer.optim_step(types.AdamParams(learning_rate=1e-2))
    second = trainer.forward_backward_custom([chosen, rejected], dpo_loss).result()
    assert second.metrics["margin"] > first.result().metrics["margin"]
    assert "surrogate_loss:sum" in second.metrics

    def broken(
        data: list[types.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        raise RuntimeError("bug in my loss")

    with pytest.raises(RuntimeError, match="bug in my loss"):
        trainer.forward_backward_custom([chosen], broken).result(timeout=120)
    # The reserved seq ids were filled: the run goes on without waiting for a gap.
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)


def test_resume_with_optimizer_and_named_sampler(service: treadle.ServiceClient) -> None:
    batch = [sft_datum(i) for i in range(3)]
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=7)
    for _ in range(2):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=3e-3))
    path = trainer.save_state("mid").result().path
    assert path.endswith("/weights/mid")
    trainer.forward_backward(batch, "cross_entropy")
    trainer.optim_step(types.AdamParams(learning_rate=3e-3))
    expected = trainer.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    sampler_path = trainer.save_weights_for_sampler("policy-v1").result().path
    assert sampler_path is not None and sampler_path.endswith("/sampler_weights/policy-v1")

    resumed = service.create_training_client_from_state_with_optimizer(path)
    resumed.forward_backward(batch, "cross_entropy")
    resumed.optim_step(types.AdamParams(learning_rate=3e-3))
    actual = resumed.forward(batch, "cross_entropy").result().metrics["loss:sum"]
    assert actual == pytest.approx(expected, rel=1e-5)

    sampler = service.create_sampling_client(model_path=sampler_path)
    assert trainer.create_sampling_client(sampler_path).base_model == MODEL
    params = types.SamplingParams(max_tokens=5, seed=11)
    prompt = types.ModelInput.from_ints([20, 21, 22])
    first = sampler.sample(prompt, 2, params).result()
    again = pickle.loads(pickle.dumps(sampler)).sample(prompt, 2, params).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]
    assert all(s.stop_reason == "length" and len(s.tokens) == 5 for s in first.sequences)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints([20, 21, 22, 23])).result()
    assert logprobs[0] is None and len(logprobs) == 4

    rest = service.create_rest_client()
    run_ids = {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
    assert {trainer.model_id, resumed.model_id} <= run_ids
    listed = {c.tinker_path for c in rest.list_checkpoints(trainer.model_id).result().checkpoints}
    assert {path, sampler_path} <= listed
    assert rest.get_weights_info(path).result().lora_rank == 8


def test_async_variants(live_server: LiveServer) -> None:
    async def main() -> tuple[float, float]:
        with treadle.ServiceClient(
            base_url=live_server.base_url, api_key=live_server.make_tenant().key
        ) as service:
            trainer = await service.create_lora_training_client_async(MODEL, rank=4, seed=3)
            batch = [sft_datum(i) for i in range(2)]
            first = await trainer.forward_backward_async(batch, "cross_entropy")
            step = await trainer.optim_step_async(types.AdamParams(learning_rate=1e-2))
            before = (await first).metrics["loss:sum"]
            await step
            after = (await (await trainer.forward_async(batch))).metrics["loss:sum"]
            sampler = await trainer.save_weights_and_get_sampling_client_async()
            prompt = types.ModelInput.from_ints([5, 6, 7])
            results = await asyncio.gather(
                *(
                    sampler.sample_async(prompt, 1, types.SamplingParams(max_tokens=3))
                    for _ in range(4)
                )
            )
            assert all(len(r.sequences[0].tokens) == 3 for r in results)
            return before, after

    before, after = asyncio.run(main())
    assert after < before


def test_permanent_errors_carry_the_server_message(live_server: LiveServer) -> None:
    with pytest.raises(treadle.AuthenticationError):
        treadle.ServiceClient(
            base_url=live_server.base_url, api_key="tml-000000000000-nope"
        ).create_lora_training_client(MODEL, rank=4)
    tenant = live_server.make_tenant(max_lora_rank=8, max_concurrent_sessions=1)
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key) as service:
        with pytest.raises(treadle.BadRequestError, match="rank 64"):
            service.create_lora_training_client(MODEL, rank=64)
        with pytest.raises(treadle.QuotaExceededError, match="concurrent session limit"):
            other = treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key)
            try:
                other.create_lora_training_client(MODEL, rank=4)
            finally:
                other.close()
        trainer = service.create_lora_training_client(MODEL, rank=4)
        bad = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "advantages": [1.0, 1.0, 1.0]},
        )
        with pytest.raises(treadle.RequestFailedError) as failed:
            trainer.forward_backward([bad], "cross_entropy").result(timeout=120)
        assert failed.value.category == "user"
        trainer.forward_backward([sft_datum()], "cross_entropy").result(timeout=120)
        # The session ends behind the client's back (here: finished by another process).
        httpx.post(
            f"{live_server.base_url}/api/v1/sessions/{service.session_id}/finish",
            json={"reason": {"type": "interrupted"}},
            headers={"X-API-Key": tenant.key},
        ).raise_for_status()
        with pytest.raises(treadle.SessionExpiredError, match="has finished"):
            trainer.optim_step().result(timeout=30)


class FlakyTransport(httpx.AsyncBaseTransport):
    """Fails submissions: a 503 before the server sees them, or a dropped answer after."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.calls = 0
        self.injected = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path.endswith(("/forward_backward", "/optim_step", "/asample", "/retrieve_future")):
            self.calls += 1
            if self.calls % 3 == 0:
                self.injected += 1
                return httpx.Response(503, json={"detail": "injected", "category": "server"})
            if self.calls % 3 == 1 and not path.endswith("/retrieve_future"):
                await self.inner.handle_async_request(request)  # the server got it...
                self.injected += 1
                raise httpx.RemoteProtocolError("connection reset (injected)")  # ...we did not
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_transient_failures_are_retried_without_duplicate_ops(live_server: LiveServer) -> None:
    transport = FlakyTransport()
    retry = treadle.RetryPolicy(initial_backoff_seconds=0.05, max_backoff_seconds=0.2)
    with treadle.ServiceClient(
        base_url=live_server.base_url,
        api_key=live_server.make_tenant().key,
        transport=transport,
        retry=retry,
    ) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=3)
        batch = [sft_datum(i) for i in range(2)]
        losses = []
        for _ in range(3):
            fwd = trainer.forward_backward(batch, "cross_entropy")
            trainer.optim_step(types.AdamParams(learning_rate=1e-2))
            losses.append(fwd.result(timeout=120).metrics["loss:sum"])
        sampler = trainer.save_weights_and_get_sampling_client().result()
        sampler.sample(
            types.ModelInput.from_ints([1, 2]), 1, types.SamplingParams(max_tokens=2)
        ).result()
    assert transport.injected >= 4
    assert losses[-1] < losses[0]
    with live_server.database.reader() as db:
        per_seq = db.execute(
            select(Operation.seq_id, func.count())
            .where(Operation.target_id == trainer.model_id)
            .group_by(Operation.seq_id)
        ).all()
    assert sorted(seq for seq, _ in per_seq) == list(range(0, 8))
    assert all(count == 1 for _, count in per_seq)


def test_export_and_cli(
    live_server: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter export: listed, downloaded by the CLI (by path, by registry reference, as one
    archive, resumed after an interruption), and loaded by peft on the base model built here,
    where it reproduces the server's logprobs."""
    from peft import PeftModel

    from gpu_worker.catalog import Catalog

    prompt = [11, 12, 13, 14, 15, 16]
    key = live_server.make_tenant().key
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=1)
        trainer.forward_backward([sft_datum()], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-2))
        exported = trainer.export("peft").result().path
        assert exported.endswith("/external_weights/peft")
        sampler = trainer.save_weights_and_get_sampling_client().result()
        served = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
        urls = service.create_rest_client().get_download_urls(exported).result()
    assert urls.kind == "adapter"
    reference = f"{trainer.model_id}:1"  # the run's package, its first version: the export

    monkeypatch.setattr(cli, "console", Console(width=400, emoji=False, highlight=False))
    monkeypatch.setenv("TREADLE_BASE_URL", live_server.base_url)
    monkeypatch.setenv("TREADLE_API_KEY", key)
    runner = CliRunner()
    runs = runner.invoke(cli.app, ["runs"])
    assert runs.exit_code == 0, runs.output
    assert trainer.model_id in runs.output
    listed = runner.invoke(cli.app, ["checkpoints", "--run", trainer.model_id])
    assert listed.exit_code == 0 and exported in listed.output
    out = tmp_path / "adapter"
    downloaded = runner.invoke(cli.app, ["download", exported, "--out", str(out)])
    assert downloaded.exit_code == 0, downloaded.output
    assert (out / "adapter_config.json").is_file()
    assert (out / "adapter_model.safetensors").is_file()

    model = PeftModel.from_pretrained(Catalog().load_model(MODEL), str(out)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    local = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])
    assert served[0] is None
    assert torch.allclose(torch.tensor(served[1:]), local[:, 0], atol=1e-4)

    # An interrupted download (a .part file holding the first bytes) is continued by a rerun.
    by_reference = tmp_path / "by-reference"
    weights = (out / "adapter_model.safetensors").read_bytes()
    by_reference.mkdir()
    (by_reference / "adapter_model.safetensors.part").write_bytes(weights[: len(weights) // 3])
    resumed = runner.invoke(cli.app, ["download", reference, "-o", str(by_reference)])
    assert resumed.exit_code == 0, resumed.output
    assert {p.name for p in by_reference.iterdir()} == {p.name for p in out.iterdir()}
    assert all((by_reference / p.name).read_bytes() == p.read_bytes() for p in out.iterdir())

    archived = tmp_path / "archived"
    archived.mkdir()
    whole = httpx.get(urls.archive_url).content
    (archived / "peft.tar.part").write_bytes(whole[:1500])
    fetched = runner.invoke(cli.app, ["download", exported, "--archive", "-o", str(archived)])
    assert fetched.exit_code == 0, fetched.output
    assert (archived / "peft.tar").read_bytes() == whole
    with tarfile.open(archived / "peft.tar") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}  # type: ignore[union-attr]
    assert members == {p.name: p.read_bytes() for p in out.iterdir()}

    missing = runner.invoke(cli.app, ["download", exported.replace("peft", "nope")])
    assert missing.exit_code == 1, missing.output
    stranger = live_server.make_tenant().key
    foreign = runner.invoke(cli.app, ["download", reference, "--api-key", stranger])
    assert foreign.exit_code == 1 and "not found" in foreign.output


def test_merged_export_loads_in_transformers_with_the_trained_weights(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """`export(merged=True)`: a plain Hugging Face folder whose logprobs equal the server's."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [11, 12, 13, 14, 15, 16]
    with treadle.ServiceClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    ) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=2)
        trainer.forward_backward([sft_datum()], "cross_entropy")
        trainer.optim_step(types.AdamParams(learning_rate=5e-2))
        path = trainer.export("merged", merged=True).result().path
        sampler = trainer.save_weights_and_get_sampling_client().result()
        served = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
        out = tmp_path / "merged"
        rest = service.create_rest_client()
        assert rest.get_download_urls(path).result().kind == "merged"
        rest.download_checkpoint(path, out).result()
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    local = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(prompt[1:])[:, None])[
        :, 0
    ]
    assert served[0] is None
    assert torch.allclose(torch.tensor(served[1:]), local, atol=1e-4)


def test_usage_report_and_cli(live_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    key = live_server.make_tenant().key
    datum = sft_datum()
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=key) as service:
        trainer = service.create_lora_training_client(MODEL, rank=2, seed=1)
        trainer.forward_backward([datum, datum], "cross_entropy")
        trainer.optim_step(types.AdamParams()).result()
        rest = service.create_rest_client()
        report = rest.get_usage().result()
        later = rest.get_usage(since=datetime.now(UTC) + timedelta(hours=1)).result()
    trained = 2 * datum.model_input.length
    assert [(line.base_model, line.kind, line.quantity) for line in report.lines] == [
        (MODEL, "training", trained)
    ]
    assert later.lines == []
    with treadle.RestClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    ) as other:
        assert other.get_usage().result().lines == []  # tenants see only their own usage

    monkeypatch.setattr(cli, "console", Console(width=400, emoji=False, highlight=False))
    monkeypatch.setenv("TREADLE_BASE_URL", live_server.base_url)
    monkeypatch.setenv("TREADLE_API_KEY", key)
    shown = CliRunner().invoke(cli.app, ["usage"])
    assert shown.exit_code == 0, shown.output
    assert "training" in shown.output and f"{trained:,}" in shown.output


def python_blocks(markdown: Path) -> list[str]:
    """The ```python blocks of a markdown file, in order."""
    return [block.split("```", 1)[0] for block in markdown.read_text().split("```python\n")[1:]]


@pytest.mark.parametrize("readme", ["README.md", "sdk/README.md"])
def test_readme_examples_run_as_printed(
    live_server: LiveServer, readme: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every Python example of the README is a complete program: each runs on its own (a fresh
    namespace, nothing defined by the test), in order, under one tenant; only the server's
    address and the key are replaced."""
    blocks = python_blocks(Path(__file__).resolve().parents[2] / readme)
    assert blocks, f"{readme} has no python examples"
    key = live_server.make_tenant().key
    for number, block in enumerate(blocks, 1):
        assert "http://127.0.0.1:8000" in block, f"{readme} example {number} names no server"
        code = block.replace("http://127.0.0.1:8000", live_server.base_url)
        code = code.replace('"tml-..."', repr(key)).replace('"tml-…"', repr(key))
        assert repr(key) in code, f"{readme} example {number} names no API key"
        exec(compile(code, f"{readme} example {number}", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    if readme == "sdk/README.md":
        assert "resumed tinker://" in printed and "/weights/step-20 as " in printed
        assert "32 samples, mean reward" in printed
        margins = [float(line.split()[1]) for line in printed.splitlines()[-5:]]
        assert margins[-1] > margins[0], printed  # DPO widens the chosen answer's margin
    else:
        losses = [float(line) for line in printed.splitlines()]
        assert len(losses) == 10 and losses[-1] < losses[0], printed


@contextlib.contextmanager
def serving(root: Path, port: int) -> Iterator[FastAPI]:
    """An embedded server on a fixed port, so a restarted one answers at the same address."""
    app = build_app(root)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    assert app.state.treadle.dispatcher.wait_ready(120), "engine did not start"
    try:
        yield app
    finally:
        server.should_exit = True
        thread.join(timeout=60)


def test_server_restart_mid_loop_is_survived(tmp_path: Path) -> None:
    """Ops in flight when the server stops run once, after it comes back; the loop goes on."""
    root, port = tmp_path / "server", free_port()
    root.mkdir()
    batch = [sft_datum(i) for i in range(2)]
    retry = treadle.RetryPolicy(initial_backoff_seconds=0.2, max_backoff_seconds=1.0)
    with serving(root, port) as app:
        state = app.state.treadle
        key = tenant_factory(state.database, state.settings)().key
        service = treadle.ServiceClient(
            base_url=f"http://127.0.0.1:{port}", api_key=key, retry=retry
        )
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=3)
        losses = [trainer.forward_backward(batch).result(timeout=120).metrics["loss:sum"]]
        trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
        # Submitted just before the server goes away; answered by the next one.
        in_flight = [
            trainer.forward_backward(batch),
            trainer.optim_step(types.AdamParams(learning_rate=1e-2)),
        ]
    with serving(root, port) as app:
        losses.append(in_flight[0].result(timeout=300).metrics["loss:sum"])
        in_flight[1].result(timeout=300)
        losses.append(trainer.forward(batch).result(timeout=300).metrics["loss:sum"])
        service.close()
        with app.state.treadle.database.reader() as db:
            seqs = db.scalars(
                select(Operation.seq_id).where(Operation.target_id == trainer.model_id)
            ).all()
    assert sorted(seqs) == [0, 1, 2, 3, 4, 5]
    assert losses[2] < losses[1] < losses[0], losses


def test_sampling_client_works_in_a_worker_process(service: treadle.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=MODEL)
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        remote = pool.submit(sample_tokens, sampler, [3, 4, 5], 17).result(timeout=300)
    assert remote == sample_tokens(sampler, [3, 4, 5], 17)
