"""A published sampler checkpoint, sampled by another tenant through the tinker SDK, stops
serving that tenant once its owner unpublishes or deletes it. The owner's own sampling clients
keep working after unpublishing (they own it) but not after deleting, and the engine lets go of
weights that no open session may sample any more."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from billing.tables import UsageEvent
from core.tables import ModelVersion, Operation
from scheduler.worker.embedded import EmbeddedDispatcher
from scheduler.worker.host import WorkerHost
from tests.scenarios import MODEL
from tests.server import LiveServer

pytestmark = pytest.mark.e2e

PROMPT = types.ModelInput.from_ints([5, 6, 7])
PARAMS = types.SamplingParams(max_tokens=2, seed=1)


@dataclass
class World:
    server: LiveServer
    owner: tinker.ServiceClient
    other: tinker.ServiceClient
    other_tenant: str
    owner_rest: tinker.RestClient
    trainer: tinker.TrainingClient

    @property
    def host(self) -> WorkerHost:
        dispatcher = self.server.app.state.treadle.dispatcher
        assert isinstance(dispatcher, EmbeddedDispatcher) and dispatcher.host is not None
        return dispatcher.host

    def weights_of(self, path: str) -> str:
        """The engine's name for the sampler weights of `path`."""
        with self.server.database.reader() as db:
            version_id = db.scalar(select(ModelVersion.id).where(ModelVersion.tinker_path == path))
        assert version_id is not None
        return f"sampler:{version_id}"

    def engine_holds(self, weights: str) -> bool:
        return weights in self.host.engine.run_ids()

    def recorded_for_other(self) -> tuple[int, int]:
        """Operations and usage events of the other tenant."""
        with self.server.database.reader() as db:
            ops = db.scalar(
                select(func.count())
                .select_from(Operation)
                .where(Operation.tenant_id == self.other_tenant)
            )
            usage = db.scalar(
                select(func.count())
                .select_from(UsageEvent)
                .where(UsageEvent.tenant_id == self.other_tenant)
            )
        return ops or 0, usage or 0


@pytest.fixture(scope="module")
def world(live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HOME", str(tmp_path_factory.mktemp("home")))  # no stored credentials
        owner_tenant, other_tenant = live_server.make_tenant(), live_server.make_tenant()
        owner = tinker.ServiceClient(base_url=live_server.base_url, api_key=owner_tenant.key)
        other = tinker.ServiceClient(base_url=live_server.base_url, api_key=other_tenant.key)
        trainer = owner.create_lora_training_client(base_model=MODEL, rank=4, seed=2).result()
        rest = tinker.RestClient(base_url=live_server.base_url, api_key=owner_tenant.key)
        yield World(live_server, owner, other, other_tenant.tenant_id, rest, trainer)
        owner.close("success").result(timeout=60)
        other.close("success").result(timeout=60)


def _sample(client: tinker.SamplingClient) -> types.SampleResponse:
    return client.sample(PROMPT, 1, PARAMS).result()


def test_unpublishing_ends_other_tenants_sampling_until_published_again(world: World) -> None:
    path = world.trainer.save_weights_for_sampler("shared").result().path
    world.owner_rest.publish_checkpoint_from_tinker_path(path).result()
    theirs = world.other.create_sampling_client(model_path=path).result()
    assert len(_sample(theirs).sequences) == 1
    weights = world.weights_of(path)
    assert world.engine_holds(weights)
    world.host.evict_ended()
    assert world.engine_holds(weights)  # the other tenant may still sample them

    world.owner_rest.unpublish_checkpoint_from_tinker_path(path).result()
    recorded = world.recorded_for_other()
    with pytest.raises(tinker.NotFoundError, match="is no longer published") as refused:
        _sample(theirs)
    assert f"checkpoint {path}" in str(refused.value)
    assert "ask its owner to publish it again" in str(refused.value)
    assert world.recorded_for_other() == recorded  # refused before anything was queued
    with pytest.raises(tinker.NotFoundError, match="not found"):
        world.other.create_sampling_client(model_path=path).result()
    # Only the other tenant's session was on them: nobody may sample them now.
    world.host.evict_ended()
    assert not world.engine_holds(weights)

    # The other tenant's session is otherwise unaffected.
    base = world.other.create_sampling_client(base_model=MODEL).result()
    assert len(_sample(base).sequences) == 1

    # The owner's own sampling clients keep working on its unpublished checkpoint.
    mine = world.owner.create_sampling_client(model_path=path).result()
    assert len(_sample(mine).sequences) == 1
    world.host.evict_ended()
    assert world.engine_holds(weights)

    world.owner_rest.publish_checkpoint_from_tinker_path(path).result()
    assert len(_sample(theirs).sequences) == 1


def test_deleting_ends_sampling_for_everyone_and_frees_the_weights(world: World) -> None:
    path = world.trainer.save_weights_for_sampler("doomed").result().path
    world.owner_rest.publish_checkpoint_from_tinker_path(path).result()
    theirs = world.other.create_sampling_client(model_path=path).result()
    mine = world.owner.create_sampling_client(model_path=path).result()
    assert len(_sample(theirs).sequences) == len(_sample(mine).sequences) == 1
    weights = world.weights_of(path)
    assert world.engine_holds(weights)

    world.owner_rest.delete_checkpoint_from_tinker_path(path).result()
    for client in (theirs, mine):
        with pytest.raises(tinker.NotFoundError, match=re.escape(f"checkpoint {path} was deleted")):
            _sample(client)
    world.host.evict_ended()
    assert not world.engine_holds(weights)
