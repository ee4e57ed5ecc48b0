"""Tenant isolation route by route, for every route of the app's OpenAPI document.

Tenant A creates one of every kind of object: a session, training runs, a sampling session, a
future, checkpoints of each kind (published and not), download links. Every route that takes a
reference is then called by tenant B with each of A's objects that fits it, and must answer
exactly as it answers a made-up reference of the same form: the same status and the same body
once the made-up id is put in place of A's. The one exception is publication: a published
checkpoint may be read where publication allows it (sampled, through /api/v1 and /oai/v1
alike; loaded; its weights_info; its run's view with `access_scope=accessible`), and a download
link the server signed is itself the permission. A run's current weights (`live:<run id>`) are
never published: sampling another tenant's run live answers as a made-up run does. A's rows are unchanged afterwards. Listings of the caller's own objects (sessions,
runs, checkpoints, usage, storage, the audit log) show B's and none of A's, and every route
but the few that say why refuses a caller without an API key.

`ROUTES` has an entry for each route of the document; a route without one fails
`test_every_route_has_a_case`, so no route is added without deciding how it isolates tenants.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import json
import re
import secrets
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from billing.tables import UsageEvent
from core.db import Database
from core.settings import Settings
from core.signing import sign_download
from core.tables import (
    ModelAlias,
    ModelPackage,
    ModelVersion,
    Operation,
    SamplingSession,
    Session,
    TrainingRun,
)
from tests.builders import tenant_factory
from tests.server import build_app
from tests.services import throwaway_database

pytestmark = pytest.mark.integration

MODEL = "treadle/tiny-1m"
TOKENS = [(5 * i) % 300 + 10 for i in range(9)]
DATUM = {
    "model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:-1]}]},
    "loss_fn_inputs": {
        "target_tokens": {"data": TOKENS[1:], "dtype": "int64"},
        "weights": {"data": [1.0] * 8, "dtype": "float32"},
    },
}
SAMPLE = {
    "num_samples": 1,
    "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
    "sampling_params": {"max_tokens": 1},
}


class Kind(enum.Enum):
    """What a reference names."""

    SESSION = "session"
    RUN = "training run"
    SAMPLER = "sampling session"
    REQUEST = "request id"
    CHECKPOINT = "checkpoint"  # a tinker:// path, or run_id + kind + name in a URL
    LIVE = "live training run"  # live:<run id>: a run's current weights, never published
    LINK = "download link"  # token + relpath in a URL
    ARCHIVE = "archive link"  # token + archive name in a URL
    PACKAGE = "registry package"  # its name
    VERSION = "package version"  # name + version number in a URL
    ALIAS = "package alias"  # name + alias in a URL


class Marker(enum.Enum):
    """Values filled in per call."""

    RUN_SEQ = "the next seq_id of the run the call names"
    FRESH = "a number never used before (model and sampling session seq ids)"
    DAY_BEFORE = "the UTC hour boundary a day before now"
    HOUR_AFTER = "the UTC hour boundary after now"


class Owner(enum.Enum):
    """What in a listing shows whose objects it lists."""

    SESSION = "the ids of the sessions the objects were made in"
    KEY = "the id of the API key that made them"


# A reference is one parameter, or several path parameters naming one object together.
Ref = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Call:
    """One way of calling a route: the parameters that name objects, and the rest."""

    refs: dict[Ref, Kind]
    body: dict[str, Any] | None = None
    query: dict[str, str] | None = None
    # The reference another tenant may use when A published the object (documented reads).
    public_ref: Ref | None = None


@dataclasses.dataclass(frozen=True)
class Route:
    calls: tuple[Call, ...] = ()
    # Parameters that look like references but name nothing a tenant owns, and why.
    not_references: dict[str, str] = dataclasses.field(default_factory=dict)
    # Why the route takes no reference at all.
    no_reference: str | None = None
    # The route lists the caller's own objects, each showing its owner thus: B's answer shows
    # B's and none of A's.
    lists_own: Owner | None = None
    # The query a listing needs.
    listing_query: dict[str, Marker] = dataclasses.field(default_factory=dict)
    # Why the route answers a caller without an API key.
    keyless: str | None = None


SESSION, RUN, SAMPLER, REQUEST, CHECKPOINT, LINK = (
    Kind.SESSION,
    Kind.RUN,
    Kind.SAMPLER,
    Kind.REQUEST,
    Kind.CHECKPOINT,
    Kind.LINK,
)
PACKAGE, VERSION, ALIAS = Kind.PACKAGE, Kind.VERSION, Kind.ALIAS
IN_URL: Ref = ("run_id", "kind", "name")
HUB_KEYLESS = "Hugging Face clients fetch base models' tokenizers without a key"
NEW_NAME = {"path": "the name of the checkpoint to create, under the caller's own run"}
BASE_MODEL = {"model": "a base model, served to every tenant alike"}
HUB_REPO = {
    "repo_id": "a base model, served to every tenant alike (no key needed)",
    "revision": "'main' or the commit id of that base model's tokenizer",
}


def _owner_only(body: dict[str, Any] | None = None) -> Route:
    return Route((Call({IN_URL: CHECKPOINT}, body=body),))


def _on_run(**body: Any) -> Route:
    return Route((Call({("model_id",): RUN}, body=body),), not_references=NEW_NAME)


API = "/api/v1"
OAI = "/oai/v1"


def _oai(body: dict[str, Any]) -> Route:
    """An OpenAI-compatible completion: its `model` is a sampling session or a checkpoint."""
    body = {**body, "max_tokens": 1}
    return Route(
        (
            Call({("model",): SAMPLER}, body=body),
            Call({("model",): CHECKPOINT}, body=body, public_ref=("model",)),
            Call({("model",): Kind.LIVE}, body=body),
        )
    )


REGISTRY = f"{API}/registry/packages"
PACKAGE_REF: Ref = ("name",)
VERSION_REF: Ref = ("name", "version")
ALIAS_REF: Ref = ("name", "alias")
ROUTES: dict[tuple[str, str], Route] = {
    ("POST", f"{API}/client/config"): Route(
        no_reference="client settings, the same for all",
        keyless="the tinker SDK reads it before it sends its key",
    ),
    ("POST", f"{API}/client/dynamic_config"): Route(
        no_reference="client settings", keyless="the tinker SDK reads it before it sends its key"
    ),
    ("POST", f"{API}/telemetry"): Route(no_reference="accepted and dropped unread"),
    ("GET", f"{API}/get_server_capabilities"): Route(no_reference="the served base models"),
    ("GET", f"{API}/healthz"): Route(no_reference="liveness", keyless="load balancers probe it"),
    ("GET", f"{API}/readyz"): Route(no_reference="readiness", keyless="load balancers probe it"),
    ("POST", f"{API}/create_session"): Route(
        no_reference="creates the caller's own session",
        not_references={"project_id": "a label the client chooses; nothing is looked up by it"},
    ),
    ("GET", f"{API}/sessions"): Route(
        no_reference="the caller's sessions", lists_own=Owner.SESSION
    ),
    ("GET", f"{API}/training_runs"): Route(
        no_reference="the caller's runs",
        not_references={"project_id": "accepted for the tinker SDK; nothing is looked up by it"},
        lists_own=Owner.SESSION,
    ),
    ("GET", f"{API}/checkpoints"): Route(
        no_reference="the caller's checkpoints", lists_own=Owner.SESSION
    ),
    ("GET", f"{API}/usage"): Route(no_reference="the caller's usage by base model and kind"),
    ("GET", f"{API}/billing/usage/events"): Route(
        no_reference="the caller's usage per hour, session and API key",
        lists_own=Owner.SESSION,
        listing_query={"starting_on": Marker.DAY_BEFORE, "ending_before": Marker.HOUR_AFTER},
    ),
    ("GET", f"{API}/billing/usage/checkpoints/current"): Route(
        no_reference="the caller's stored checkpoints per project and API key",
        not_references={"project_id": "a label the client chose; it filters the caller's own"},
        lists_own=Owner.KEY,
    ),
    ("GET", f"{API}/audit"): Route(
        no_reference="the caller's audit log (its keys, limits and checkpoints)",
        lists_own=Owner.KEY,
    ),
    ("POST", f"{API}/billing/estimate"): Route(
        no_reference="prices usage given in the body at the prices in force, the same for all"
    ),
    ("GET", f"{API}/models/{{model}}/tokenizer"): Route(not_references=BASE_MODEL),
    ("GET", f"{API}/models/{{model}}/tokenizer/{{filename}}"): Route(
        not_references={**BASE_MODEL, "filename": "a file of that base model's tokenizer"}
    ),
    # The Hugging Face hub endpoint: base models' tokenizers, public and the same for all.
    ("GET", "/hf/{repo_id}/resolve/{revision}/{filename}"): Route(
        not_references={**HUB_REPO, "filename": "a file of that base model's tokenizer"},
        keyless=HUB_KEYLESS,
    ),
    ("GET", "/hf/api/models/{repo_id}"): Route(not_references=HUB_REPO, keyless=HUB_KEYLESS),
    ("GET", "/hf/api/models/{repo_id}/revision/{revision}"): Route(
        not_references=HUB_REPO, keyless=HUB_KEYLESS
    ),
    ("GET", "/hf/api/models/{repo_id}/tree/{revision}"): Route(
        not_references=HUB_REPO, keyless=HUB_KEYLESS
    ),
    ("GET", "/hf/api/models/{repo_id}/tree/{revision}/{folder}"): Route(
        not_references={**HUB_REPO, "folder": "a folder of that base model's tokenizer"},
        keyless=HUB_KEYLESS,
    ),
    ("POST", f"{API}/session_heartbeat"): Route((Call({("session_id",): SESSION}),)),
    ("GET", f"{API}/sessions/{{session_id}}"): Route((Call({("session_id",): SESSION}),)),
    ("POST", f"{API}/sessions/{{session_id}}/finish"): Route(
        (Call({("session_id",): SESSION}, body={"reason": {"type": "success"}}),)
    ),
    ("POST", f"{API}/create_model"): Route(
        (
            Call(
                {("session_id",): SESSION},
                body={"model_seq_id": Marker.FRESH, "base_model": MODEL},
            ),
        )
    ),
    ("POST", f"{API}/get_info"): _on_run(),
    ("POST", f"{API}/forward_backward"): _on_run(
        seq_id=Marker.RUN_SEQ, data=[DATUM], loss_fn="cross_entropy"
    ),
    ("POST", f"{API}/optim_step"): _on_run(
        seq_id=Marker.RUN_SEQ, adam_params={"learning_rate": 1e-3}
    ),
    ("POST", f"{API}/unload_model"): _on_run(),
    ("POST", f"{API}/save_weights"): _on_run(seq_id=Marker.RUN_SEQ, path="taken"),
    ("POST", f"{API}/save_weights_for_sampler"): _on_run(seq_id=Marker.RUN_SEQ, path="taken"),
    ("POST", f"{API}/save_weights_external"): _on_run(seq_id=Marker.RUN_SEQ, path="taken"),
    ("POST", f"{API}/load_weights"): Route(
        (
            # A new run in the caller's session, from a checkpoint.
            Call(
                {("session_id",): SESSION, ("path",): CHECKPOINT},
                body={"model_seq_id": Marker.FRESH, "optimizer": False},
                public_ref=("path",),
            ),
            # Into an existing run.
            Call(
                {("model_id",): RUN, ("path",): CHECKPOINT},
                body={"seq_id": Marker.RUN_SEQ, "optimizer": False},
                public_ref=("path",),
            ),
        )
    ),
    ("POST", f"{API}/create_sampling_session"): Route(
        (
            Call(
                {("session_id",): SESSION},
                body={"sampling_session_seq_id": Marker.FRESH, "base_model": MODEL},
            ),
            Call(
                {("session_id",): SESSION, ("model_path",): CHECKPOINT},
                body={"sampling_session_seq_id": Marker.FRESH},
                public_ref=("model_path",),
            ),
            Call(
                {("session_id",): SESSION, ("model_path",): Kind.LIVE},
                body={"sampling_session_seq_id": Marker.FRESH},
            ),
        )
    ),
    ("GET", f"{API}/samplers/{{sampler_id}}"): Route((Call({("sampler_id",): SAMPLER}),)),
    ("POST", f"{API}/asample"): Route(
        (
            Call({("sampling_session_id",): SAMPLER}, body={**SAMPLE, "seq_id": Marker.FRESH}),
            # Sampling a path without a sampling session is refused alike, whoever owns it.
            Call({("model_path",): CHECKPOINT}, body=SAMPLE),
        )
    ),
    ("POST", f"{API}/retrieve_future"): Route((Call({("request_id",): REQUEST}),)),
    ("POST", f"{API}/cancel_future"): Route((Call({("request_id",): REQUEST}),)),
    ("GET", f"{API}/training_runs/{{run_id}}"): Route(
        (
            Call({("run_id",): RUN}),
            Call({("run_id",): RUN}, query={"access_scope": "accessible"}, public_ref=("run_id",)),
        )
    ),
    ("GET", f"{API}/training_runs/{{run_id}}/checkpoints"): Route((Call({("run_id",): RUN}),)),
    ("POST", f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish"): (
        _owner_only()
    ),
    ("DELETE", f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/publish"): (
        _owner_only()
    ),
    ("PUT", f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/ttl"): _owner_only(
        {"ttl_seconds": 7200}
    ),
    (
        "GET",
        f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}/external_weights_urls",
    ): _owner_only(),
    ("DELETE", f"{API}/training_runs/{{run_id}}/checkpoints/{{kind}}/{{name}}"): _owner_only(),
    ("POST", f"{API}/weights_info"): Route(
        (Call({("tinker_path",): CHECKPOINT}, public_ref=("tinker_path",)),)
    ),
    ("GET", f"{API}/artifacts/{{token}}/{{relpath}}"): Route(
        (Call({("token", "relpath"): LINK}, public_ref=("token", "relpath")),),
        keyless="a link the server signed is the permission, as for any download",
    ),
    ("POST", f"{API}/registry/download_urls"): Route(
        (Call({("path",): CHECKPOINT}, public_ref=("path",)),)
    ),
    ("GET", f"{API}/archives/{{token}}/{{filename}}"): Route(
        (Call({("token", "filename"): Kind.ARCHIVE}, public_ref=("token", "filename")),),
        keyless="a link the server signed is the permission, as for any download",
    ),
    ("GET", REGISTRY): Route(
        no_reference="the caller's packages (a tag filters them)", lists_own=Owner.SESSION
    ),
    ("POST", REGISTRY): Route(
        (Call({("training_run_id",): RUN}, body={"name": "new-package"}),),
        not_references={"name": "the name of the package to create, among the caller's own"},
    ),
    ("GET", f"{REGISTRY}/{{name}}"): Route((Call({PACKAGE_REF: PACKAGE}),)),
    ("PATCH", f"{REGISTRY}/{{name}}"): Route(
        (Call({PACKAGE_REF: PACKAGE}, body={"description": "changed"}),)
    ),
    ("DELETE", f"{REGISTRY}/{{name}}"): Route((Call({PACKAGE_REF: PACKAGE}),)),
    ("GET", f"{REGISTRY}/{{name}}/versions"): Route((Call({PACKAGE_REF: PACKAGE}),)),
    ("GET", f"{REGISTRY}/{{name}}/versions/{{version}}"): Route((Call({VERSION_REF: VERSION}),)),
    ("DELETE", f"{REGISTRY}/{{name}}/versions/{{version}}"): Route((Call({VERSION_REF: VERSION}),)),
    ("PUT", f"{REGISTRY}/{{name}}/versions/{{version}}/ttl"): Route(
        (Call({VERSION_REF: VERSION}, body={"ttl_seconds": 7200}),)
    ),
    ("POST", f"{REGISTRY}/{{name}}/versions/{{version}}/promote"): Route(
        (Call({VERSION_REF: VERSION, ("target_package",): PACKAGE}),)
    ),
    ("GET", f"{REGISTRY}/{{name}}/aliases"): Route((Call({PACKAGE_REF: PACKAGE}),)),
    ("PUT", f"{REGISTRY}/{{name}}/aliases/{{alias}}"): Route(
        (Call({ALIAS_REF: ALIAS}, body={"version": 1}),)
    ),
    ("DELETE", f"{REGISTRY}/{{name}}/aliases/{{alias}}"): Route((Call({ALIAS_REF: ALIAS}),)),
    ("GET", f"{REGISTRY}/{{name}}/lineage"): Route((Call({PACKAGE_REF: PACKAGE}),)),
    ("GET", f"{OAI}/models"): Route(
        no_reference="the served base models and the caller's own models",
        lists_own=Owner.SESSION,
    ),
    ("POST", f"{OAI}/chat/completions"): _oai({"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", f"{OAI}/completions"): _oai({"prompt": "hi"}),
}

# Counters the client keeps; they position a request, they do not name an object.
SEQUENCE_NUMBERS = frozenset({"seq_id", "model_seq_id", "sampling_session_seq_id"})


def _looks_like_reference(name: str) -> bool:
    return name not in SEQUENCE_NUMBERS and (
        name.endswith(("_id", "_path")) or name in ("path", "token")
    )


# --- the document --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DocumentedRoute:
    method: str
    path: str
    path_params: frozenset[str]
    query_params: frozenset[str]
    body_fields: frozenset[str]


def _operations(doc: dict[str, Any]) -> list[DocumentedRoute]:
    schemas = doc.get("components", {}).get("schemas", {})

    def fields(schema: dict[str, Any]) -> set[str]:
        if "$ref" in schema:
            schema = schemas[schema["$ref"].rsplit("/", 1)[1]]
        found = set(schema.get("properties", {}))
        for option in schema.get("anyOf", []) + schema.get("oneOf", []) + schema.get("allOf", []):
            found |= fields(option)
        return found

    found = []
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            if method not in ("get", "put", "post", "delete", "patch"):
                continue
            parameters = operation.get("parameters", []) + item.get("parameters", [])
            body: set[str] = set()
            for media in operation.get("requestBody", {}).get("content", {}).values():
                body |= fields(media.get("schema", {}))
            found.append(
                DocumentedRoute(
                    method.upper(),
                    path,
                    frozenset(p["name"] for p in parameters if p["in"] == "path"),
                    frozenset(p["name"] for p in parameters if p["in"] == "query"),
                    frozenset(body),
                )
            )
    return found


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    doc: dict[str, Any] = build_app(tmp_path_factory.mktemp("doc")).openapi()
    return doc


def test_every_route_has_a_case(document: dict[str, Any]) -> None:
    operations = _operations(document)
    problems = []
    for op in operations:
        route = ROUTES.get((op.method, op.path))
        if route is None:
            problems.append(f"{op.method} {op.path}: no case in the cross-tenant matrix")
            continue
        if not (route.calls or route.no_reference or route.not_references):
            problems.append(f"{op.method} {op.path}: neither cases nor a reason for none")
        parameters = op.path_params | op.query_params | op.body_fields
        declared = {name for call in route.calls for ref in call.refs for name in ref}
        for name in sorted(declared - parameters):
            problems.append(f"{op.method} {op.path}: the document has no parameter {name!r}")
        references = op.path_params | {
            name for name in op.query_params | op.body_fields if _looks_like_reference(name)
        }
        for name in sorted(references - declared - route.not_references.keys()):
            problems.append(f"{op.method} {op.path}: parameter {name!r} has no cross-tenant case")
        if route.no_reference is not None and route.calls:
            problems.append(f"{op.method} {op.path}: has cases but says it takes no reference")
    listed = {(op.method, op.path) for op in operations}
    problems += [
        f"{m} {p}: in the matrix but not in the document" for m, p in ROUTES if (m, p) not in listed
    ]
    assert not problems, "\n".join(problems)


# --- the two tenants -----------------------------------------------------------------------


class Reply(Protocol):
    @property
    def status_code(self) -> int: ...

    @property
    def content(self) -> bytes: ...

    @property
    def headers(self) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Obj:
    """One of A's objects, and a made-up reference of the same form."""

    label: str
    value: str
    fake: str
    public: bool = False  # published (or a signed link): readable where publication allows


@dataclasses.dataclass
class World:
    client: TestClient
    database: Database
    a_headers: dict[str, str]
    b_headers: dict[str, str]
    a_tenant: str
    a_key_id: str
    b_key_id: str
    ours: dict[Kind, list[Obj]]  # A's objects, by kind
    mine: dict[Kind, str]  # B's own, to fill the references a call does not vary
    b_run_seqs: Iterator[int]
    fresh: Iterator[int] = dataclasses.field(default_factory=lambda: itertools.count(100))
    substitutions: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def post(self, headers: dict[str, str], route: str, body: dict[str, Any]) -> Any:
        response = self.client.post(f"{API}/{route}", json=body, headers=headers)
        assert response.status_code == 200, response.text
        return response.json()

    def future(self, headers: dict[str, str], request_id: str) -> dict[str, Any]:
        for _ in range(10):  # long polls
            body: dict[str, Any] = self.post(headers, "retrieve_future", {"request_id": request_id})
            if body.get("type") != "try_again":
                return body
        raise AssertionError(f"request {request_id} never finished")

    def op(self, headers: dict[str, str], route: str, body: dict[str, Any]) -> dict[str, Any]:
        submitted = self.post(headers, route, body)
        result = self.future(headers, submitted["request_id"])
        assert "error" not in result, result
        return {**result, "request_id": submitted["request_id"]}


def _make_world(client: TestClient, database: Database, settings: Settings) -> World:
    tenants = tenant_factory(database, settings)
    a, b = tenants(), tenants()
    a_headers, b_headers = {"X-API-Key": a.key}, {"X-API-Key": b.key}
    world = World(
        client, database, a_headers, b_headers, a.tenant_id, a.key_id, b.key_id, {}, {}, iter(())
    )

    def session(headers: dict[str, str]) -> str:
        return str(world.post(headers, "create_session", {})["session_id"])

    def run(headers: dict[str, str], session_id: str, seq: int) -> tuple[str, str]:
        created = world.op(
            headers,
            "create_model",
            {
                "session_id": session_id,
                "model_seq_id": seq,
                "base_model": MODEL,
                "lora_config": {"rank": 2},
            },
        )
        return str(created["model_id"]), str(created["request_id"])

    def saved(headers: dict[str, str], run_id: str, seq: int, route: str, name: str) -> str:
        body = {"model_id": run_id, "seq_id": seq, "path": name}
        return str(world.op(headers, route, body)["path"])

    def registry_objects(headers: dict[str, str], run_id: str, prefix: str) -> None:
        """An alias `<prefix>-stable` on version 1 of the run's package, and a package
        `<prefix>-prod` holding that version promoted."""
        calls = [
            ("PUT", f"{run_id}/aliases/{prefix}-stable", {"version": 1}),
            ("POST", "", {"name": f"{prefix}-prod", "base_model": MODEL}),
            ("POST", f"{run_id}/versions/1/promote", {"target_package": f"{prefix}-prod"}),
        ]
        for method, path, body in calls:
            url = f"{REGISTRY}/{path}" if path else REGISTRY
            response = client.request(method, url, json=body, headers=headers)
            assert response.status_code == 200, response.text

    def publish(path: str) -> None:
        run_id, checkpoint_id = path.removeprefix("tinker://").split("/", 1)
        url = f"{API}/training_runs/{run_id}/checkpoints/{checkpoint_id}/publish"
        response = client.post(url, headers=a_headers)
        assert response.status_code == 204, response.text

    # A: one session with two runs, the first with published checkpoints.
    a_session = session(a_headers)
    run1, request = run(a_headers, a_session, 0)
    run2, _ = run(a_headers, a_session, 1)
    private = [
        saved(a_headers, run1, 1, "save_weights", "w"),
        saved(a_headers, run1, 2, "save_weights_for_sampler", "s"),
        saved(a_headers, run1, 3, "save_weights_external", "e"),
        saved(a_headers, run2, 1, "save_weights", "w"),
    ]
    public = [
        saved(a_headers, run1, 4, "save_weights", "pw"),
        saved(a_headers, run1, 5, "save_weights_for_sampler", "ps"),
    ]
    for path in public:
        publish(path)
    registry_objects(a_headers, run1, "a")
    sampler = world.post(
        a_headers,
        "create_sampling_session",
        {"session_id": a_session, "sampling_session_seq_id": 0, "base_model": MODEL},
    )["sampling_session_id"]

    fake_session, fake_request = str(uuid.uuid4()), "req_" + secrets.token_hex(12)
    with database.reader() as db:
        external = db.scalar(select(ModelVersion).where(ModelVersion.tinker_path == private[2]))
        assert external is not None and external.artifact_uri is not None
        version_id = external.id
        relpath = "adapter_config.json"
        assert (Path(external.artifact_uri.removeprefix("file://")) / relpath).is_file()
    fake_version = "mv_" + secrets.token_hex(8)
    expires = datetime.now(UTC) + timedelta(hours=1)
    forged_secret = b"not-the-server-secret-0123456789"
    # A's own package is named in answers about its versions too.
    world.substitutions = [(a_session, fake_session), (request, fake_request), ("a-prod", "z-prod")]

    def like(value: str, label: str | None = None, public: bool = False) -> Obj:
        """A's object, and the same id under a session that never existed."""
        return Obj(label or value, value, value.replace(a_session, fake_session), public)

    world.ours = {
        SESSION: [like(a_session, label="A's session")],
        RUN: [
            like(run1, label="A's run with published checkpoints", public=True),
            like(run2, label="A's run without"),
        ],
        SAMPLER: [like(sampler, label="A's sampling session")],
        REQUEST: [Obj("A's future", request, fake_request)],
        CHECKPOINT: [like(p) for p in private] + [like(p, public=True) for p in public],
        # Publishing a checkpoint publishes that checkpoint, not the run's weights as they train.
        Kind.LIVE: [
            like(f"live:{run1}", label="A's run with published checkpoints, live"),
            like(f"tinker://live:{run2}", label="A's run, live, as the tinker SDK names it"),
        ],
        PACKAGE: [
            like(run1, label="A's run's package"),
            Obj("A's own package", "a-prod", "z-prod"),
        ],
        VERSION: [
            like(f"{run1}/1", label="a version of A's run's package"),
            Obj("A's promoted version", "a-prod/1", "z-prod/1"),
        ],
        ALIAS: [like(f"{run1}/a-stable", label="A's alias")],
        LINK: [
            Obj(
                "a link to A's export, signed without the server's secret",
                f"{sign_download(forged_secret, version_id, relpath, expires)}/{relpath}",
                f"{sign_download(forged_secret, fake_version, relpath, expires)}/{relpath}",
            ),
            Obj(
                "a link to A's export, signed by the server (the link is the permission)",
                f"{sign_download(settings.secret_bytes(), version_id, relpath, expires)}/{relpath}",
                f"{sign_download(settings.secret_bytes(), fake_version, relpath, expires)}/{relpath}",
                public=True,
            ),
        ],
        Kind.ARCHIVE: [
            Obj(
                "an archive link to A's export, signed without the server's secret",
                f"{sign_download(forged_secret, version_id, 'e.tar', expires, archive=True)}/e.tar",
                f"{sign_download(forged_secret, fake_version, 'e.tar', expires, archive=True)}/e.tar",
            ),
            Obj(
                "a file's link to A's export, used for its archive",
                f"{sign_download(settings.secret_bytes(), version_id, 'e.tar', expires)}/e.tar",
                f"{sign_download(settings.secret_bytes(), fake_version, 'e.tar', expires)}/e.tar",
            ),
            Obj(
                "an archive link to A's export, signed by the server (the link is the permission)",
                f"{sign_download(settings.secret_bytes(), version_id, 'e.tar', expires, archive=True)}/e.tar",
                f"{sign_download(settings.secret_bytes(), fake_version, 'e.tar', expires, archive=True)}/e.tar",
                public=True,
            ),
        ],
    }

    # B: its own session, run, sampling session, future and checkpoint.
    b_session = session(b_headers)
    b_run, b_request = run(b_headers, b_session, 0)
    b_checkpoint = saved(b_headers, b_run, 1, "save_weights", "b")
    b_sampler = world.post(
        b_headers,
        "create_sampling_session",
        {"session_id": b_session, "sampling_session_seq_id": 0, "base_model": MODEL},
    )["sampling_session_id"]
    registry_objects(b_headers, b_run, "b")
    world.mine = {
        PACKAGE: "b-prod",
        VERSION: "b-prod/1",
        ALIAS: f"{b_run}/b-stable",
        SESSION: b_session,
        RUN: b_run,
        SAMPLER: b_sampler,
        REQUEST: b_request,
        CHECKPOINT: b_checkpoint,
        Kind.LIVE: f"live:{b_run}",
    }
    world.b_run_seqs = itertools.count(2)
    return world


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    root = tmp_path_factory.mktemp(f"matrix-{request.param}")
    with (
        (
            throwaway_database(request.getfixturevalue("postgres_admin_url"))
            if request.param == "postgres"
            else _sqlite(root)
        ) as url,
        TestClient(build_app(root, url)) as client,
    ):
        state = client.app.state.treadle  # type: ignore[attr-defined]
        yield _make_world(client, state.database, state.settings)


@contextlib.contextmanager
def _sqlite(root: Path) -> Iterator[str]:
    yield f"sqlite:///{root / 'treadle.db'}"


# --- calling a route as B ------------------------------------------------------------------


def _split(kind: Kind, ref: Ref, value: str) -> dict[str, str]:
    """The parameters `ref` stands for, from one reference of `kind`."""
    if len(ref) == 1:
        return {ref[0]: value}
    if kind is CHECKPOINT:  # tinker://<run id>/<kind>/<name> in the URL's three parameters
        return dict(zip(ref, value.removeprefix("tinker://").split("/"), strict=True))
    # A link (<token>/<relpath>), a version (<package>/<number>) or an alias (<package>/<alias>).
    return dict(zip(ref, value.split("/", 1), strict=True))


Answer = tuple[int, Any]


def _call(world: World, method: str, template: str, call: Call, refs: dict[Ref, str]) -> Answer:
    params: dict[str, str] = {}
    for ref, kind in call.refs.items():
        params.update(_split(kind, ref, refs[ref]))
    in_path = set(re.findall(r"\{(\w+)\}", template))
    url = re.sub(r"\{(\w+)\}", lambda m: params[m.group(1)], template)
    rest = {k: v for k, v in params.items() if k not in in_path}
    query = {**(call.query or {})}
    if method in ("GET", "DELETE"):
        query, rest = {**query, **rest}, {}
    body = {**(call.body or {}), **rest}
    for key, value in body.items():
        if value is Marker.RUN_SEQ:
            # Only B's own run executes: its seq_ids must follow each other.
            own = body.get("model_id") == world.mine[RUN]
            body[key] = next(world.b_run_seqs) if own else 1_000_000
        elif value is Marker.FRESH:
            body[key] = next(world.fresh)
    response = world.client.request(
        method,
        url,
        params=query,
        json=body if body or method in ("POST", "PUT") else None,
        headers=world.b_headers,
    )
    return _answer(world, response)


def _answer(world: World, response: Reply) -> Answer:
    """Status and body; a submitted operation's body is its future's final answer, since the
    request id itself differs from call to call."""
    if "json" not in response.headers.get("content-type", ""):
        return response.status_code, response.content
    body = json.loads(response.content)
    if response.status_code == 200 and isinstance(body, dict) and "request_id" in body:
        body.pop("sample_sequence_ids", None)
        body["future"] = world.future(world.b_headers, body.pop("request_id"))
    return response.status_code, body


def _as_made_up(world: World, obj: Obj, answer: Answer) -> Answer:
    """A's answer with every id of A's replaced by its made-up counterpart."""
    status, body = answer
    if isinstance(body, bytes):
        return answer
    text = json.dumps(body)
    for real, fake in [(obj.value, obj.fake), *world.substitutions]:
        text = text.replace(real, fake)
    return status, json.loads(text)


def _succeeded(answer: Answer) -> bool:
    status, body = answer
    return status < 300 and not (isinstance(body, dict) and "error" in body.get("future", {}))


def _state_of_a(world: World) -> dict[str, list[tuple[Any, ...]]]:
    """Everything of A's that B's calls could have changed."""
    tenant = world.a_tenant
    with world.database.reader() as db:
        return {
            "sessions": list(
                db.execute(
                    select(Session.id, Session.status, Session.last_heartbeat_at, Session.ended_at)
                    .where(Session.tenant_id == tenant)
                    .order_by(Session.id)
                ).all()
            ),
            "runs": list(
                db.execute(
                    select(
                        TrainingRun.id,
                        TrainingRun.status,
                        TrainingRun.executed_seq_id,
                        TrainingRun.optim_steps,
                        TrainingRun.last_request_at,
                    )
                    .where(TrainingRun.tenant_id == tenant)
                    .order_by(TrainingRun.id)
                ).all()
            ),
            "samplers": list(
                db.execute(
                    select(SamplingSession.id, SamplingSession.model_version_id)
                    .where(SamplingSession.tenant_id == tenant)
                    .order_by(SamplingSession.id)
                ).all()
            ),
            "checkpoints": list(
                db.execute(
                    select(
                        ModelVersion.id,
                        ModelVersion.status,
                        ModelVersion.tinker_path,
                        ModelVersion.public,
                        ModelVersion.expires_at,
                        ModelVersion.artifact_uri,
                    )
                    .where(ModelVersion.tenant_id == tenant)
                    .order_by(ModelVersion.id)
                ).all()
            ),
            "packages": list(
                db.execute(
                    select(
                        ModelPackage.id,
                        ModelPackage.name,
                        ModelPackage.description,
                        ModelPackage.training_run_id,
                        ModelPackage.deleted_at,
                    )
                    .where(ModelPackage.tenant_id == tenant)
                    .order_by(ModelPackage.id)
                ).all()
            ),
            "aliases": list(
                db.execute(
                    select(ModelAlias.id, ModelAlias.name, ModelAlias.version_id)
                    .where(ModelAlias.tenant_id == tenant)
                    .order_by(ModelAlias.id)
                ).all()
            ),
            "operations": list(
                db.execute(
                    select(Operation.id, Operation.status)
                    .where(Operation.tenant_id == tenant)
                    .order_by(Operation.id)
                ).all()
            ),
            "usage": list(
                db.execute(
                    select(UsageEvent.operation_id, UsageEvent.kind, UsageEvent.quantity)
                    .where(UsageEvent.tenant_id == tenant)
                    .order_by(UsageEvent.operation_id, UsageEvent.kind)
                ).all()
            ),
        }


def test_foreign_references_answer_like_unknown_ones(world: World) -> None:
    before = _state_of_a(world)
    problems = []
    compared: set[tuple[str, str]] = set()
    for (method, template), route in ROUTES.items():
        for call in route.calls:
            for ref, kind in call.refs.items():
                # B's own objects for the references this case does not vary.
                refs = {other: world.mine[k] for other, k in call.refs.items() if other != ref}
                for obj in world.ours[kind]:
                    where = f"{method} {template} {'+'.join(ref)}={obj.label}"
                    where += f" {call.query}" if call.query else ""
                    real = _call(world, method, template, call, {**refs, ref: obj.value})
                    if obj.public and call.public_ref == ref:
                        if not _succeeded(real):
                            problems.append(f"{where}: publication allows this, but {real}")
                        continue
                    made_up = _call(world, method, template, call, {**refs, ref: obj.fake})
                    compared.add((method, template))
                    if _as_made_up(world, obj, real) != made_up:
                        problems.append(f"{where}:\n  A's:     {real}\n  made up: {made_up}")
    assert not problems, "\n".join(problems)
    assert compared == {key for key, route in ROUTES.items() if route.calls}
    assert _state_of_a(world) == before


def _listing_query(query: dict[str, Marker]) -> dict[str, str]:
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    moments = {
        Marker.DAY_BEFORE: hour - timedelta(days=1),
        Marker.HOUR_AFTER: hour + timedelta(hours=1),
    }
    return {name: moments[marker].isoformat() for name, marker in query.items()}


def test_listings_show_only_the_callers_own(world: World) -> None:
    markers = {
        "A": {Owner.SESSION: world.ours[SESSION][0].value, Owner.KEY: world.a_key_id},
        "B": {Owner.SESSION: world.mine[SESSION], Owner.KEY: world.b_key_id},
    }
    headers = {"A": world.a_headers, "B": world.b_headers}
    for (method, path), route in ROUTES.items():
        if route.lists_own is None:
            continue
        for caller, other in (("A", "B"), ("B", "A")):
            response = world.client.request(
                method, path, params=_listing_query(route.listing_query), headers=headers[caller]
            )
            assert response.status_code == 200, (path, caller, response.text)
            assert markers[caller][route.lists_own] in response.text, (path, caller)
            for owner, value in markers[other].items():
                assert value not in response.text, (path, caller, f"{other}'s {owner.value}")


def test_routes_refuse_callers_without_a_key(world: World) -> None:
    problems = []
    for (method, template), route in ROUTES.items():
        url = re.sub(r"\{(\w+)\}", "made-up", template)
        for headers in ({}, {"X-API-Key": "tml-" + secrets.token_hex(16)}):
            response = world.client.request(
                method, url, json={} if method in ("POST", "PUT") else None, headers=headers
            )
            refused = response.status_code == 401
            if route.keyless is None and not refused:
                problems.append(f"{method} {template} {headers}: {response.status_code}, not 401")
            if route.keyless is not None and refused:
                problems.append(f"{method} {template} {headers}: 401, though {route.keyless}")
    assert not problems, "\n".join(problems)
