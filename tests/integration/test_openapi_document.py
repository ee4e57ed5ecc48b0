"""The OpenAPI document describes the routes as they are: every documented operation is reached
by its own path, errors share one body, and raw bodies and the API key are declared."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.bootstrap import ensure_default_key
from core.clock import SystemClock
from tests.server import AppFactory

pytestmark = pytest.mark.integration

ERROR_REF = "#/components/schemas/ErrorResponse"
# Under /oai/ errors have OpenAI's body (`{"error": {...}}`, api/oai_types.py).
OPENAI_PREFIX = "/oai/"
OPENAI_ERROR_REF = "#/components/schemas/ErrorBody"
# Answers that are not errors though their status is not 2xx: readiness's "not ready" has the
# body of its "ready", which load balancers and operators read.
NOT_ERRORS = {("get", "/api/v1/readyz", "503")}
# Operations a client reaches without an API key.
PUBLIC = {
    ("get", "/api/v1/healthz"),
    ("get", "/api/v1/readyz"),
    ("post", "/api/v1/client/config"),
    ("post", "/api/v1/client/dynamic_config"),
    ("get", "/api/v1/artifacts/{token}/{relpath}"),
    ("get", "/api/v1/archives/{token}/{filename}"),
    # The Hugging Face hub endpoint for tokenizers (api/routes/hub.py).
    ("get", "/hf/{repo_id}/resolve/{revision}/{filename}"),
    ("head", "/hf/{repo_id}/resolve/{revision}/{filename}"),
    ("get", "/hf/api/models/{repo_id}"),
    ("get", "/hf/api/models/{repo_id}/revision/{revision}"),
    ("get", "/hf/api/models/{repo_id}/tree/{revision}"),
    ("get", "/hf/api/models/{repo_id}/tree/{revision}/{folder}"),
}


@pytest.fixture
def client_and_key(app_factory: AppFactory) -> Iterator[tuple[TestClient, str]]:
    app = app_factory()
    state = app.state.treadle
    key = ensure_default_key(state.settings, state.database, SystemClock())
    with TestClient(app) as client:
        yield client, key


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            yield method, path, operation


def concrete_paths(path: str, operation: dict[str, Any]) -> list[str]:
    """The path with every parameter filled in, once per enum value; checkpoint names are the
    suffixes of other routes, which must not be taken for them."""
    choices: dict[str, list[str]] = {}
    for parameter in operation.get("parameters", []):
        if parameter["in"] != "path":
            continue
        schema = parameter["schema"]
        if "enum" in schema:
            choices[parameter["name"]] = list(schema["enum"])
        elif parameter["name"] == "name":
            choices[parameter["name"]] = ["publish", "ttl", "external_weights_urls"]
        else:
            choices[parameter["name"]] = ["x1"]
    filled = []
    for values in itertools.product(*choices.values()):
        concrete = path
        for name, value in zip(choices, values, strict=True):
            concrete = concrete.replace("{" + name + "}", value)
        filled.append(concrete)
    return filled


def test_every_documented_operation_is_reached_by_its_path(
    client_and_key: tuple[TestClient, str],
) -> None:
    client, key = client_and_key
    document = client.get("/openapi.json").json()
    tried = 0
    for method, path, operation in operations(document):
        for concrete in concrete_paths(path, operation):
            response = client.request(method, concrete, headers={"X-API-Key": key}, json={})
            tried += 1
            where = f"{method.upper()} {concrete} ({path})"
            assert response.status_code != 405, (where, response.text)
            if method != "head":  # a HEAD answer has no body
                detail = response.json().get("detail", "")
                assert "no endpoint" not in detail, (where, response.text)
            assert str(response.status_code) in operation["responses"], (where, response.text)
    assert tried > len(document["paths"])


def test_errors_and_the_api_key_are_documented_once(
    client_and_key: tuple[TestClient, str],
) -> None:
    client, _ = client_and_key
    document = client.get("/openapi.json").json()
    schemes = document["components"]["securitySchemes"]
    assert schemes == {
        "ApiKey": {
            "type": "apiKey",
            "in": "header",
            "name": "X-API-Key",
            "description": schemes["ApiKey"]["description"],
        },
        # OpenAI's clients send the key as a bearer token (/oai/ only).
        "Bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": schemes["Bearer"]["description"],
        },
    }
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for method, path, operation in operations(document):
        openai = path.startswith(OPENAI_PREFIX)
        errors = {
            s: r
            for s, r in operation["responses"].items()
            if not s.startswith("2") and (method, path, s) not in NOT_ERRORS
        }
        for status, response in errors.items():
            schema = response["content"]["application/json"]["schema"]
            expected = OPENAI_ERROR_REF if openai else ERROR_REF
            assert schema == {"$ref": expected}, (method, path, status)
        if (method, path) in PUBLIC:
            assert "security" not in operation, (method, path)
            continue
        security = [{"Bearer": []}, {"ApiKey": []}] if openai else [{"ApiKey": []}]
        assert operation["security"] == security, (method, path)
        assert {"401", "403"} <= set(errors), (method, path)
        if "requestBody" in operation:
            # OpenAI's clients expect an invalid request as a 400.
            assert {"413", "400" if openai else "422"} <= set(errors), (method, path)


def test_raw_bodies_are_described(client_and_key: tuple[TestClient, str]) -> None:
    client, _ = client_and_key
    document = client.get("/openapi.json").json()
    forward_backward = document["paths"]["/api/v1/forward_backward"]["post"]["requestBody"]
    assert forward_backward["required"] is True
    assert set(forward_backward["content"]) == {"application/json", "application/x-protobuf"}
    json_body = forward_backward["content"]["application/json"]["schema"]
    assert json_body["required"] == ["model_id", "seq_id", "data", "loss_fn"]
    assert "$ref" not in str(json_body)  # inlined: the models are not in the components
    telemetry = document["paths"]["/api/v1/telemetry"]["post"]["requestBody"]
    assert telemetry["required"] is False
    assert telemetry["content"]["application/json"]["schema"] == {"type": "object"}


def test_routing_answers_share_the_error_body(client_and_key: tuple[TestClient, str]) -> None:
    client, key = client_and_key
    headers = {"X-API-Key": key}
    missing = client.get("/api/v1/no_such_endpoint", headers=headers)
    assert missing.status_code == 404
    assert missing.json() == {
        "detail": "no endpoint at /api/v1/no_such_endpoint; /openapi.json lists the endpoints",
        "category": "user",
        "code": "unknown_endpoint",
    }
    # Two routes share the path; the answer names the methods of both.
    wrong = client.put("/api/v1/training_runs/r/checkpoints/weights/a/publish", headers=headers)
    assert wrong.status_code == 405 and wrong.headers["allow"] == "DELETE, POST"
    assert wrong.json()["detail"].endswith("; use DELETE or POST")
    assert wrong.json()["code"] == "method_not_allowed"
    garbled = client.post(
        "/api/v1/create_session",
        content=b'{"tags": ["\xff"]}',
        headers={**headers, "Content-Type": "application/json"},
    )
    assert garbled.status_code == 422 and garbled.json()["category"] == "user"
    assert "not UTF-8 JSON" in garbled.json()["detail"]
    not_an_object = client.post("/api/v1/telemetry", json=[1, 2], headers=headers)
    assert not_an_object.status_code == 422
    assert not_an_object.json()["detail"] == (
        "telemetry body is a JSON array; send a JSON object of events"
    )
    unix_time = client.get("/api/v1/usage?since=1700000000", headers=headers)
    assert unix_time.status_code == 422 and "not an ISO 8601 time" in unix_time.json()["detail"]


def test_text_with_nul_is_refused_where_it_cannot_be_stored(
    app_factory: AppFactory, postgres_url: str
) -> None:
    """PostgreSQL text cannot hold NUL: a request carrying one is the client's mistake (422),
    and the transaction it came in leaves nothing behind."""
    app = app_factory(postgres_url)
    state = app.state.treadle
    headers = {"X-API-Key": ensure_default_key(state.settings, state.database, SystemClock())}
    with TestClient(app) as client:
        named = client.post(
            "/api/v1/create_session", json={"display_name": "a\0b"}, headers=headers
        )
        looked_up = client.post("/api/v1/get_info", json={"model_id": "run\0"}, headers=headers)
        listed = client.get("/api/v1/sessions", headers=headers).json()
    for response in (named, looked_up):
        assert response.status_code == 422, response.text
        assert "NUL character" in response.json()["detail"]
    assert listed["sessions"] == []
