"""The official `openai` client against `/oai/v1` of an embedded server: chat and text
completions from a base model, a saved sampler checkpoint and a registry reference, streamed and
not; stops, lengths, `n`; usage equal to the ledger; OpenAI-format errors."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
import tinker
from sqlalchemy import select

from billing.tables import UsageEvent
from tests.builders import TenantKey
from tests.scenarios import MODEL
from tests.server import LiveServer

pytestmark = pytest.mark.e2e

HELLO = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tenant(live_server: LiveServer) -> TenantKey:
    return live_server.make_tenant()


def _client(server: LiveServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/oai/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def client(live_server: LiveServer, tenant: TenantKey) -> openai.OpenAI:
    return _client(live_server, tenant.key)


@pytest.fixture(scope="module")
def saved(live_server: LiveServer, tenant: TenantKey) -> Iterator[tuple[str, str, str]]:
    """A sampler checkpoint's tinker path, its run's package name and a live sampling session."""
    service = tinker.ServiceClient(base_url=live_server.base_url, api_key=tenant.key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=2, seed=3).result()
    path = trainer.save_weights_for_sampler("oai").result().path
    sampler = trainer.save_weights_and_get_sampling_client().result()
    yield path, trainer.model_id, sampler._sampling_session_id
    service.close("success").result(timeout=60)


def _ledger(server: LiveServer, tenant_id: str) -> dict[str, int]:
    with server.database.reader() as db:
        rows = db.execute(
            select(UsageEvent.kind, UsageEvent.quantity).where(UsageEvent.tenant_id == tenant_id)
        ).all()
    totals: dict[str, int] = {}
    for kind, quantity in rows:
        totals[kind] = totals.get(kind, 0) + int(quantity)
    return totals


def test_chat_from_a_base_model_with_usage_equal_to_the_ledger(
    live_server: LiveServer, client: openai.OpenAI, tenant: TenantKey
) -> None:
    before = _ledger(live_server, tenant.tenant_id)
    answer = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=5,
        seed=1,
        n=4,
        logprobs=True,  # type: ignore[arg-type]
    )
    assert len(answer.choices) == 4
    assert answer.usage is not None
    after = _ledger(live_server, tenant.tenant_id)
    assert answer.usage.prompt_tokens == after["sampling_prefill"] - before.get(
        "sampling_prefill", 0
    )
    assert answer.usage.completion_tokens == after["sampling_sample"] - before.get(
        "sampling_sample", 0
    )
    for choice in answer.choices:
        assert choice.finish_reason in ("stop", "length")
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert all(entry.logprob <= 0 for entry in choice.logprobs.content)


def test_max_tokens_ends_with_length_and_stop_with_stop(client: openai.OpenAI) -> None:
    long = client.completions.create(model=MODEL, prompt="once upon", max_tokens=3, seed=5)
    assert long.choices[0].finish_reason in ("length", "stop")
    assert long.usage is not None and long.usage.completion_tokens <= 3
    # A stop string taken from what the same seed writes ends the text right before it.
    free = client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=30, seed=7, temperature=0.9
    )
    text = free.choices[0].text
    if len(text.strip()) < 2:
        pytest.skip("the tiny model wrote no text to stop on")
    stop = text.strip()[1:3]
    stopped = client.completions.create(
        model=MODEL, prompt="once upon", max_tokens=30, seed=7, temperature=0.9, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)


def test_streamed_chat_matches_the_unstreamed_one(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, seed=3)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=6,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            if choice.finish_reason is not None:
                reasons.append(choice.finish_reason)
    assert "".join(pieces) == whole.choices[0].message.content
    assert reasons == [whole.choices[0].finish_reason]
    assert usage is not None and whole.usage is not None
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_checkpoint_reference_and_live_sampler(
    client: openai.OpenAI, saved: tuple[str, str, str]
) -> None:
    path, package, sampler_id = saved
    for model in (path, f"{package}:1", f"{package}@latest", sampler_id):
        answer = client.chat.completions.create(model=model, messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
        assert answer.model == model and len(answer.choices) == 1
    listed = {m.id for m in client.models.list()}
    assert {MODEL, path, sampler_id} <= listed


def test_another_tenants_models_are_not_found(
    live_server: LiveServer, saved: tuple[str, str, str]
) -> None:
    other = _client(live_server, live_server.make_tenant().key)
    path, package, sampler_id = saved
    for model in (path, f"{package}:1", sampler_id, "no-such-model"):
        with pytest.raises(openai.NotFoundError) as caught:
            other.chat.completions.create(model=model, messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
        assert caught.value.status_code == 404
        assert isinstance(caught.value.body, dict) and caught.value.body["message"]


def test_bad_keys_and_refused_parameters(live_server: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.AuthenticationError):
        _client(live_server, "tml-000000000000-nope").models.list()
    refused = {
        "presence_penalty": {"presence_penalty": 0.5},
        "logit_bias": {"logit_bias": {"5": 1.0}},
        "tools": {"tools": [{"type": "function", "function": {"name": "f"}}]},
        "top_logprobs": {"logprobs": True, "top_logprobs": 2},
        "response_format": {"response_format": {"type": "json_object"}},
    }
    for param, extra in refused.items():
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=HELLO, **extra)  # type: ignore[call-overload]
        assert param in str(caught.value), caught.value
    with pytest.raises(openai.BadRequestError) as unknown:
        client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            extra_body={"mirostat": 2},  # type: ignore[arg-type]
        )
    assert "mirostat" in str(unknown.value)
    # `user` is harmless and accepted, as by OpenAI.
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1, user="u-1")  # type: ignore[arg-type]


def test_a_live_run_answers_with_its_current_weights_and_a_checkpoint_does_not_change(
    live_server: LiveServer, client: openai.OpenAI, tenant: TenantKey
) -> None:
    """`live:<run>` samples the adapter as the last optim_step left it; a sampler checkpoint
    saved before those steps keeps answering the same."""
    service = tinker.ServiceClient(base_url=live_server.base_url, api_key=tenant.key)
    trainer = service.create_lora_training_client(base_model=MODEL, rank=4, seed=9).result()
    checkpoint = trainer.save_weights_for_sampler("before").result().path
    live = f"live:{trainer.model_id}"
    assert live in {m.id for m in client.models.list().data}

    def logprobs(model: str) -> list[float]:
        answer = client.chat.completions.create(
            model=model,
            messages=HELLO,  # type: ignore[arg-type]
            max_tokens=4,
            temperature=0,
            logprobs=True,
        )
        content = answer.choices[0].logprobs
        assert content is not None and content.content is not None
        return [entry.logprob for entry in content.content]

    live_before, saved_before = logprobs(live), logprobs(checkpoint)
    assert live_before == pytest.approx(saved_before, abs=1e-5)
    datum = tinker.Datum(
        model_input=tinker.ModelInput.from_ints([5, 6, 7, 8, 9, 10]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9, 10, 11], "weights": [1.0] * 6},
    )
    for _ in range(3):
        trainer.forward_backward([datum], "cross_entropy").result()
        trainer.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()
    live_after = logprobs(live)
    assert logprobs(checkpoint) == pytest.approx(saved_before, abs=1e-5)
    assert live_after != pytest.approx(live_before, abs=1e-3)
    streamed = client.chat.completions.create(
        model=live,
        messages=HELLO,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    assert any(chunk.choices and chunk.choices[0].finish_reason for chunk in streamed)
    service.close("success").result(timeout=60)
    with pytest.raises(openai.BadRequestError, match="session ended"):
        client.chat.completions.create(model=live, messages=HELLO)  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="live:nobody:train:0", messages=HELLO)  # type: ignore[arg-type]


def test_x_api_key_is_accepted_too(live_server: LiveServer, tenant: TenantKey) -> None:
    response = httpx.get(f"{live_server.base_url}/oai/v1/models", headers={"X-API-Key": tenant.key})
    assert response.status_code == 200 and response.json()["object"] == "list"


def test_an_unreadable_authorization_header_is_refused_even_beside_a_good_key(
    live_server: LiveServer, tenant: TenantKey
) -> None:
    url = f"{live_server.base_url}/oai/v1/models"
    for authorization in (f"Basic {tenant.key}", "Bearer", "garbage"):
        response = httpx.get(url, headers={"X-API-Key": tenant.key, "Authorization": authorization})
        assert response.status_code == 401, (authorization, response.text)
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and "Bearer <key>" in error["message"]
