"""Every error answer carries a `code` from the closed set `ErrorCode`: each domain error class,
each error the framework answers (unknown path, wrong method, invalid or oversized body, a
host the server does not answer for), and each failed operation's future, whose code is also
stored on its row.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.errors import install_error_handlers, status_for
from core import errors, signing
from core.errors import ErrorCode
from core.tables import Operation
from tests.embedded_app import MODEL, EmbeddedApp, datum, embedded_app

pytestmark = pytest.mark.integration

CODES = {code.value for code in ErrorCode}


def _subclasses(cls: type[errors.TreadleError]) -> list[type[errors.TreadleError]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found


# Imported so that their subclasses count too.
DOMAIN_ERRORS = sorted(set(_subclasses(errors.TreadleError)), key=lambda c: c.__qualname__)
assert signing.DownloadTokenExpired in DOMAIN_ERRORS


def _raise(cls: type[errors.TreadleError], code: ErrorCode | None = None) -> errors.TreadleError:
    if issubclass(cls, errors.RateLimited):
        return cls("slow down; retry in a second", retry_after_seconds=1.0)
    return cls(f"{cls.__name__} happened; change something", code=code)


@pytest.fixture(scope="module")
def raising() -> Iterator[TestClient]:
    """A bare app with the one error mapping, whose route raises what the test names."""
    app = FastAPI()
    install_error_handlers(app)
    by_name = {cls.__qualname__: cls for cls in DOMAIN_ERRORS}

    @app.get("/raise/{name}")
    def _route(name: str, code: str | None = None) -> None:
        if name == "unexpected":
            raise RuntimeError("a bug")
        raise _raise(by_name[name], ErrorCode(code) if code else None)

    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


@pytest.mark.parametrize("cls", DOMAIN_ERRORS, ids=lambda c: c.__qualname__)
def test_every_domain_error_answers_its_code(
    raising: TestClient, cls: type[errors.TreadleError]
) -> None:
    assert cls.code in ErrorCode  # each class names its own, from the closed set
    response = raising.get(f"/raise/{cls.__qualname__}")
    body = response.json()
    assert response.status_code == status_for(_raise(cls))
    assert body["code"] == cls.code and body["category"] == cls.category
    assert body["detail"]


def test_a_raise_may_name_a_finer_code(raising: TestClient) -> None:
    response = raising.get("/raise/InvalidInput?code=unsupported")
    assert response.status_code == 422
    assert response.json()["code"] == "unsupported"


def test_an_unexpected_error_is_internal_error(raising: TestClient) -> None:
    response = raising.get("/raise/unexpected")
    assert response.status_code == 500
    assert response.json() == {
        "detail": "internal server error; the operator's logs have the details",
        "category": "server",
        "code": "internal_error",
    }


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedApp]:
    root: Path = tmp_path_factory.mktemp("error-codes")
    # "testserver" is the TestClient's own host name; the body limit still fits every request
    # below but the oversized one.
    with embedded_app(root, allowed_hosts=["testserver"], max_request_bytes=20_000) as embedded:
        yield embedded


def _code(response: Any, status: int) -> str:
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert isinstance(body["detail"], str) and body["category"] in ("user", "server")
    code: str = body["code"]
    assert code in CODES
    return code


def test_framework_answers_carry_codes(app: EmbeddedApp) -> None:
    headers = app.tenant()
    client = app.client
    assert _code(client.get("/api/v1/no_such_endpoint", headers=headers), 404) == (
        "unknown_endpoint"
    )
    assert _code(client.put("/api/v1/create_session", headers=headers), 405) == (
        "method_not_allowed"
    )
    assert _code(app.post(headers, "create_session", {"tags": 5}), 422) == "invalid_input"
    garbled = client.post(
        "/api/v1/create_session",
        content=b'{"tags": ["\xff"]}',
        headers={**headers, "Content-Type": "application/json"},
    )
    assert _code(garbled, 422) == "invalid_input"
    deep = client.post(
        "/api/v1/telemetry",
        content=b"[" * 100 + b"]" * 100,
        headers={**headers, "Content-Type": "application/json"},
    )
    assert _code(deep, 422) == "invalid_input"
    big = app.post(headers, "create_session", {"tags": ["x" * 30_000]})
    assert _code(big, 413) == "payload_too_large"
    elsewhere = client.get("/api/v1/healthz", headers={**headers, "Host": "evil.example"})
    assert _code(elsewhere, 400) == "host_not_allowed"
    assert _code(client.get("/hf/api/models/not/served"), 404) == "not_found"


def _openai_code(response: Any, status: int, kind: str = "invalid_request_error") -> str:
    """The code of an error in OpenAI's body, which every answer under /oai/ has."""
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["type"] == kind
    code: str = error["code"]
    assert code in CODES
    return code


def test_framework_answers_under_oai_are_in_openais_format(app: EmbeddedApp) -> None:
    """The middlewares answer before any route runs; under /oai/ they speak OpenAI's format
    too, with an invalid request as a 400, as the OpenAPI document says."""
    headers = app.tenant()
    client = app.client
    url = "/oai/v1/completions"
    json_headers = {**headers, "Content-Type": "application/json"}
    garbled = client.post(url, content=b'{"model": "\xff"}', headers=json_headers)
    assert _openai_code(garbled, 400) == "invalid_input"
    non_finite = client.post(
        url, content=b'{"model": "m", "temperature": NaN}', headers=json_headers
    )
    assert _openai_code(non_finite, 400) == "invalid_input"
    deep = client.post(url, content=b"[" * 100 + b"]" * 100, headers=json_headers)
    assert _openai_code(deep, 400) == "invalid_input"
    big = client.post(url, json={"model": MODEL, "prompt": "x" * 30_000}, headers=headers)
    assert _openai_code(big, 413) == "payload_too_large"
    elsewhere = client.get("/oai/v1/models", headers={**headers, "Host": "evil.example"})
    assert _openai_code(elsewhere, 400) == "host_not_allowed"
    assert _openai_code(client.get("/oai/v1/nothing", headers=headers), 404, "not_found_error") == (
        "unknown_endpoint"
    )


def test_domain_answers_carry_codes(app: EmbeddedApp) -> None:
    assert _code(app.post({}, "create_session", {}), 401) == "unauthenticated"
    assert _code(app.post({"X-API-Key": "tml-nope"}, "create_session", {}), 401) == (
        "unauthenticated"
    )
    headers = app.tenant(max_concurrent_sessions=1)
    session_id = app.session(headers)
    assert _code(app.post(headers, "create_session", {}), 403) == "quota_exceeded"
    missing = app.post(headers, "session_heartbeat", {"session_id": "no-such-session"})
    assert _code(missing, 404) == "not_found"
    base = {"session_id": session_id, "model_seq_id": 0, "base_model": MODEL}
    dimuon = app.post(headers, "create_model", {**base, "optimizer_config": {"type": "dimuon"}})
    assert _code(dimuon, 422) == "unsupported"
    unserved = app.post(headers, "create_model", {**base, "base_model": "acme/not-served"})
    assert _code(unserved, 422) == "unsupported"
    finished = app.post(headers, f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
    assert finished.status_code == 200, finished.text
    ended = app.post(headers, "session_heartbeat", {"session_id": session_id})
    assert _code(ended, 410) == "session_ended"
    # Work on an ended session answers 404, as a foreign session's would, but its code says why.
    assert _code(app.post(headers, "create_model", base), 404) == "session_ended"


def test_failed_operations_carry_their_code_to_the_future_and_the_row(app: EmbeddedApp) -> None:
    headers = app.tenant()
    run_id = app.run(headers)
    unknown = app.submit(
        headers,
        "load_weights",
        {
            "model_id": run_id,
            "seq_id": 1,
            "path": "tinker://nope:train:0/weights/x",
            "optimizer": False,
        },
    )
    encrypted = app.submit(
        headers,
        "save_weights_external",
        {"model_id": run_id, "seq_id": 2, "path": "x", "age_encryption_recipients": ["age1x"]},
    )
    out_of_vocabulary = app.submit(
        headers,
        "forward_backward",
        {
            "model_id": run_id,
            "seq_id": 3,
            "data": [datum([1, 2, 10**6])],
            "loss_fn": "cross_entropy",
        },
    )
    unknown_loss = app.submit(
        headers,
        "forward_backward",
        {"model_id": run_id, "seq_id": 4, "data": [datum([1, 2, 3])], "loss_fn": "hinge"},
    )
    expected = {
        unknown: "not_found",
        encrypted: "unsupported",
        out_of_vocabulary: "invalid_input",
        unknown_loss: "unsupported",
    }
    for request_id, code in expected.items():
        body = app.result(headers, request_id)
        assert body["category"] == "user" and body["code"] == code, body
        assert isinstance(body["error"], str) and body["error"]
    with app.database.reader() as db:
        stored = dict(
            db.execute(
                select(Operation.id, Operation.error_code).where(Operation.id.in_(expected))
            ).all()
        )
    assert stored == expected


def test_the_openapi_error_body_declares_the_code(app: EmbeddedApp) -> None:
    document = app.client.get("/openapi.json").json()
    schema = document["components"]["schemas"]["ErrorResponse"]
    assert "code" in schema["required"]
    code = schema["properties"]["code"]
    if "$ref" in code:
        code = document["components"]["schemas"][code["$ref"].rsplit("/", 1)[1]]
    elif "allOf" in code:
        ref = code["allOf"][0]["$ref"]
        code = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert set(code["enum"]) == CODES
