"""Registry references through the treadle SDK, and the lineage every save records.

A run's saves are versions of its package (named after the run); `package@alias` and
`package:version` name them wherever a tinker path is accepted: loading into a new run or an
existing one (with or without the optimizer), sampling, weights_info. Aliases are set through the
registry API, and every move is in the tenant's audit log.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

import treadle
from core.objectstore import ArtifactStore
from core.tables import AuditLog, ModelVersion, Operation, TrainingRun
from scheduler.ops import OpKind
from tests.builders import TenantKey
from tests.e2e.treadle_data import MODEL, sft_datum
from tests.server import LiveServer
from treadle import types

pytestmark = pytest.mark.e2e

ADAM = types.AdamParams(learning_rate=3e-3)


@pytest.fixture
def tenant(live_server: LiveServer) -> TenantKey:
    return live_server.make_tenant()


@pytest.fixture
def service(live_server: LiveServer, tenant: TenantKey) -> Iterator[treadle.ServiceClient]:
    with treadle.ServiceClient(base_url=live_server.base_url, api_key=tenant.key) as client:
        yield client


def version_at(server: LiveServer, path: str) -> ModelVersion:
    with server.database.reader() as db:
        version = db.scalar(select(ModelVersion).where(ModelVersion.tinker_path == path))
        assert version is not None, path
        db.expunge(version)
        return version


def set_alias(service: treadle.ServiceClient, version: ModelVersion, name: str) -> None:
    """Point alias `name` of the version's package at it (created or moved), through the
    registry API."""
    package = version.training_run_id  # a run's package is named after it
    assert package is not None
    service.create_rest_client().set_alias(package, name, version.version).result()


def train(trainer: treadle.TrainingClient, batch: list[types.Datum], steps: int) -> None:
    for _ in range(steps):
        trainer.forward_backward(batch, "cross_entropy")
        trainer.optim_step(ADAM)


def loss(trainer: treadle.TrainingClient, batch: list[types.Datum]) -> float:
    return trainer.forward(batch, "cross_entropy").result().metrics["loss:sum"]


def test_alias_and_version_references_load_with_the_optimizer(
    live_server: LiveServer, service: treadle.ServiceClient
) -> None:
    batch = [sft_datum(i) for i in range(3)]
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=7)
    train(trainer, batch, 2)
    path = trainer.save_state("mid").result().path
    saved = version_at(live_server, path)
    set_alias(service, saved, "production")
    package = trainer.model_id  # a run's package is named after it
    train(trainer, batch, 1)
    expected = loss(trainer, batch)

    with pytest.raises(treadle.BadRequestError, match=r"cannot overwrite .*@production points"):
        trainer.save_state("mid", overwrite=True).result()
    resumed = service.create_training_client_from_state_with_optimizer(f"{package}@production")
    train(resumed, batch, 1)
    assert loss(resumed, batch) == pytest.approx(expected, rel=1e-5)

    # `package:N` into an existing run, over weights it trained itself.
    other = service.create_lora_training_client(MODEL, rank=8, seed=99)
    train(other, batch, 1)
    other.load_state_with_optimizer(f"{package}:{saved.version}").result(timeout=120)
    train(other, batch, 1)
    assert loss(other, batch) == pytest.approx(expected, rel=1e-5)

    # Without the optimizer: the weights as saved, a fresh optimizer and step count.
    fresh = service.create_training_client_from_state(f"{package}:{saved.version}")
    at_save = loss(fresh, batch)
    into = service.create_lora_training_client(MODEL, rank=8, seed=5)
    into.load_state(f"{package}@production").result(timeout=120)
    assert loss(into, batch) == pytest.approx(at_save, rel=1e-5)
    assert at_save != pytest.approx(expected, rel=1e-5)
    with live_server.database.reader() as db:
        loaded = {
            run.id: (run.loaded_from_version_id, run.optim_steps)
            for run in db.scalars(
                select(TrainingRun).where(
                    TrainingRun.id.in_([resumed.model_id, other.model_id, fresh.model_id])
                )
            )
        }
    assert loaded == {
        resumed.model_id: (saved.id, 3),
        other.model_id: (saved.id, 3),
        fresh.model_id: (saved.id, 0),
    }

    info = service.create_rest_client().get_weights_info(f"{package}@production").result()
    assert info.base_model == MODEL and info.lora_rank == 8


def test_a_save_records_its_lineage(
    live_server: LiveServer, service: treadle.ServiceClient, tenant: TenantKey
) -> None:
    batch = [sft_datum(i) for i in range(2)]
    parent_run = service.create_lora_training_client(MODEL, rank=4, seed=1)
    train(parent_run, batch, 1)
    parent = version_at(live_server, parent_run.save_state("base").result().path)
    assert parent.parent_version_id is None
    assert parent.tokens_trained == sum(d.model_input.length for d in batch)

    child_run = service.create_training_client_from_state_with_optimizer(
        f"{parent_run.model_id}:{parent.version}"
    )
    loss(child_run, batch)  # a forward pass trains nothing
    train(child_run, batch, 2)
    child_path = child_run.save_state("child").result().path
    child = version_at(live_server, child_path)

    with live_server.database.reader() as db:
        save_op = db.scalar(
            select(Operation).where(
                Operation.target_id == child_run.model_id,
                Operation.kind == OpKind.SAVE_WEIGHTS.value,
            )
        )
        run = db.get(TrainingRun, child_run.model_id)
        assert save_op is not None and run is not None
        session_id, seq_id, run_tokens = save_op.session_id, save_op.seq_id, run.tokens_trained
    trained = 2 * sum(d.model_input.length for d in batch)
    assert run_tokens == trained
    assert (child.parent_version_id, child.session_id, child.seq_id) == (
        parent.id,
        session_id,
        seq_id,
    )
    assert (child.step, child.tokens_trained, child.created_by_key_id) == (
        3,
        trained,
        tenant.key_id,
    )
    assert (child.base_model, child.base_revision) == (MODEL, None)  # tiny models have none
    assert child.lora_config == parent.lora_config

    # Every file of the artifact, with its own size and digest.
    assert child.files and child.artifact_uri is not None
    store: ArtifactStore = live_server.app.state.treadle.store
    root = store.open_dir(child.artifact_uri)
    on_disk = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    assert [f["path"] for f in child.files] == on_disk
    for file in child.files:
        data = (root / file["path"]).read_bytes()
        assert file["size_bytes"] == len(data)
        assert file["sha256"] == hashlib.sha256(data).hexdigest()
    assert sum(f["size_bytes"] for f in child.files) == child.size_bytes


def test_a_moved_alias_serves_the_new_version_and_dead_targets_are_404(
    live_server: LiveServer, service: treadle.ServiceClient
) -> None:
    batch = [sft_datum(i) for i in range(3)]
    trainer = service.create_lora_training_client(MODEL, rank=8, seed=11)
    train(trainer, batch, 1)
    first_path = trainer.save_weights_for_sampler("v1").result().path
    train(trainer, batch, 3)
    second_path = trainer.save_weights_for_sampler("v2").result().path
    assert first_path is not None and second_path is not None
    first, second = version_at(live_server, first_path), version_at(live_server, second_path)
    reference = f"{trainer.model_id}@production"
    prompt = types.ModelInput.from_ints([20, 21, 22, 23, 24, 25])

    def logprobs(model_path: str) -> list[float | None]:
        return (
            service.create_sampling_client(model_path=model_path).compute_logprobs(prompt).result()
        )

    set_alias(service, first, "production")
    on_first = logprobs(reference)
    assert on_first == pytest.approx(logprobs(first_path), abs=1e-5)
    set_alias(service, second, "production")
    on_second = logprobs(reference)
    assert on_second == pytest.approx(logprobs(second_path), abs=1e-5)
    assert on_second != pytest.approx(on_first, abs=1e-3)

    # Loading follows the alias too (a sampler version, without the optimizer).
    into = service.create_lora_training_client(MODEL, rank=8, seed=3)
    into.load_state(reference).result(timeout=120)
    expected = loss(trainer, batch)
    assert loss(into, batch) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(treadle.BadRequestError, match="holds no optimizer state"):
        into.load_state_with_optimizer(reference).result(timeout=120)

    # So do exports (of a run loaded from the reference) and downloads.
    exporter = service.create_training_client_from_state(reference)
    exported = exporter.export("deploy", merged=True).result(timeout=120).path
    export_version = version_at(live_server, exported)
    assert (export_version.kind, export_version.parent_version_id) == ("merged", second.id)
    rest = service.create_rest_client()
    assert rest.get_download_urls(reference).result().version_id == second.id

    # Each move is in the tenant's audit log, with the versions before and after.
    with live_server.database.reader() as db:
        moves = [
            (
                entry.action,
                (entry.detail or {}).get("from_version"),
                (entry.detail or {}).get("to_version"),
            )
            for entry in db.scalars(
                select(AuditLog)
                .where(AuditLog.tenant_id == first.tenant_id)
                .where(AuditLog.action.startswith("registry.alias"))
                .order_by(AuditLog.id)
            )
        ]
    assert moves == [
        ("registry.alias.created", None, first.version),
        ("registry.alias.moved", first.version, second.version),
    ]

    # An alias never names a deleted version: deleting or overwriting its target is refused
    # with what to do; once the alias is gone the version deletes and its number is 404.
    set_alias(service, first, "old")
    with pytest.raises(treadle.BadRequestError, match=r"@old points at it; move or delete"):
        rest.delete_checkpoint(first_path).result()
    rest.delete_alias(trainer.model_id, "old").result()
    rest.delete_checkpoint(first_path).result()
    with pytest.raises(treadle.NotFoundError, match="not found; list the package's versions"):
        service.create_training_client_from_state(f"{trainer.model_id}:{first.version}")
    # An alias whose version has expired says so.
    set_alias(service, second, "stale")
    with live_server.database.transaction() as db:
        row = db.get(ModelVersion, second.id)
        assert row is not None
        row.expires_at = datetime.now(UTC) - timedelta(seconds=1)
    with pytest.raises(treadle.NotFoundError, match=r"@stale names version \d+, which is expired"):
        service.create_sampling_client(model_path=f"{trainer.model_id}@stale")
    with pytest.raises(treadle.NotFoundError, match="package 'nobody:train:0' not found"):
        service.create_rest_client().get_weights_info("nobody:train:0@latest").result()
    with pytest.raises(treadle.InvalidArgumentError, match="nor a registry reference"):
        service.create_sampling_client(model_path="just-a-name")


def test_references_name_only_the_callers_own_packages(
    live_server: LiveServer, service: treadle.ServiceClient
) -> None:
    trainer = service.create_lora_training_client(MODEL, rank=4, seed=2)
    path = trainer.save_state("mine").result().path
    set_alias(service, version_at(live_server, path), "production")
    with treadle.ServiceClient(
        base_url=live_server.base_url, api_key=live_server.make_tenant().key
    ) as stranger:
        for reference in (f"{trainer.model_id}@production", f"{trainer.model_id}@latest"):
            with pytest.raises(treadle.NotFoundError, match=f"package '{trainer.model_id}'"):
                stranger.create_training_client_from_state(reference)
