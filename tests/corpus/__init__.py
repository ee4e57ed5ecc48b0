"""A malformed-input corpus: broken bodies for every training and sampling route.

Each `Case` is one HTTP request as an attacker or a buggy client would send it: JSON that is
truncated, of the wrong types, with numbers too large, negative, NaN or infinite, nested
thousands deep, with odd unicode; protobuf that is truncated or random; compression bombs; and
loss inputs the engine cannot lay out. The cases are built from a valid body per route (made
for the ids of a real session and run at test time), so each differs from a request that
would work in one thing only.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import json
from collections.abc import Iterator
from typing import Any

import zstandard

from tests.embedded_app import datum
from treadle.types import Datum, ForwardBackwardRequest, ModelInput, TensorData
from treadle.wire import PROTOBUF_CONTENT_TYPE, encode_forward_backward_request

JSON_TYPE = "application/json"
# Strings no safe name may hold: NUL, a bidi override, a lone surrogate (as JSON escapes it),
# a path, a query and a fragment, edge spaces, and one far past any length limit.
ODD_STRINGS = ("\x00", "a\u202eb", "\ud800", "../../etc/passwd", "x?y#z", " x ", "é" * 300)
HUGE_NUMBERS = ("9223372036854775808", "18446744073709551616", "1e400", "-9223372036854775809")
NON_FINITE = ("NaN", "Infinity", "-Infinity")
LONG_STRING = "A" * 100_000


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    route: str
    body: bytes
    content_type: str = JSON_TYPE
    content_encoding: str | None = None
    method: str = "POST"

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": self.content_type}
        if self.content_encoding:
            headers["Content-Encoding"] = self.content_encoding
        return headers


@dataclasses.dataclass(frozen=True)
class Ids:
    """The attacker's own objects the valid bodies refer to."""

    session_id: str
    run_id: str
    spare_run_id: str  # unload_model bodies point here, so a body that works harms nothing
    checkpoint_path: str
    sampler_id: str
    request_id: str

    @property
    def checkpoint_ttl_route(self) -> str:
        """`training_runs/{run}/checkpoints/{kind}/{name}/ttl` of the checkpoint."""
        run_id, _, rest = self.checkpoint_path.removeprefix("tinker://").partition("/")
        return f"training_runs/{run_id}/checkpoints/{rest}/ttl"

    @property
    def package_route(self) -> str:
        """`registry/packages/{name}` of the run's package (named after the run)."""
        return f"registry/packages/{self.run_id}"


# The registry's routes with a JSON body, as the OpenAPI document writes them.
REGISTRY_TEMPLATES = frozenset(
    "/api/v1/registry/packages" + suffix
    for suffix in (
        "",
        "/{name}",
        "/{name}/versions/{version}/ttl",
        "/{name}/versions/{version}/promote",
        "/{name}/aliases/{alias}",
    )
)
TOKENS = list(range(10, 27))


def valid_bodies(ids: Ids, seq_ids: Iterator[int]) -> dict[str, dict[str, Any]]:
    """A body per route that the server would accept."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": TOKENS[:5]}]}
    return {
        "client/config": {"sdk_version": "0.38.0"},
        "client/dynamic_config": {"sdk_version": "0.38.0"},
        "weights_info": {"tinker_path": ids.checkpoint_path},
        "registry/download_urls": {"path": ids.checkpoint_path},
        ids.checkpoint_ttl_route: {"ttl_seconds": 86_400},
        "registry/packages": {
            "name": "corpus-target",
            "description": "a package",
            "tags": ["corpus"],
            "base_model": "treadle/tiny-1m",
        },
        ids.package_route: {"description": "the run's", "tags": ["a", "b"]},
        f"{ids.package_route}/versions/1/ttl": {"ttl_seconds": 86_400},
        f"{ids.package_route}/versions/1/promote": {"target_package": "corpus-target"},
        f"{ids.package_route}/aliases/stable": {"version": 1},
        "create_session": {"tags": ["corpus"], "user_metadata": {"k": "v"}},
        "session_heartbeat": {"session_id": ids.session_id},
        "create_model": {
            "session_id": ids.session_id,
            "model_seq_id": 1000,
            "base_model": "treadle/tiny-1m",
            "lora_config": {"rank": 2, "seed": 1},
        },
        "get_info": {"model_id": ids.run_id},
        "forward_backward": {
            "model_id": ids.run_id,
            "seq_id": next(seq_ids),
            "data": [datum(TOKENS)],
            "loss_fn": "cross_entropy",
        },
        "optim_step": {
            "model_id": ids.run_id,
            "seq_id": next(seq_ids),
            "adam_params": {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8},
        },
        "unload_model": {"model_id": ids.spare_run_id},
        "save_weights": {"model_id": ids.run_id, "seq_id": next(seq_ids), "path": "ck"},
        "save_weights_for_sampler": {
            "model_id": ids.run_id,
            "seq_id": next(seq_ids),
            "path": "smp",
        },
        "save_weights_external": {"model_id": ids.run_id, "seq_id": next(seq_ids), "path": "ext"},
        "load_weights": {
            "model_id": ids.run_id,
            "seq_id": next(seq_ids),
            "path": ids.checkpoint_path,
            "optimizer": True,
        },
        "create_sampling_session": {
            "session_id": ids.session_id,
            "sampling_session_seq_id": 1000,
            "base_model": "treadle/tiny-1m",
        },
        "asample": {
            "sampling_session_id": ids.sampler_id,
            "seq_id": next(seq_ids),
            "prompt": prompt,
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "seed": 1},
            "num_samples": 1,
        },
        "retrieve_future": {"request_id": ids.request_id},
        "billing/estimate": {
            "base_model": "treadle/tiny-1m",
            "usage": {"training": 1000, "sampling_prefill": 200, "sampling_sample": 50},
            "cached_prefill_tokens": 100,
        },
        "telemetry": {
            "events": [],
            "platform": "linux",
            "sdk_version": "0.38.0",
            "session_id": ids.session_id,
            "process_uuid": "p",
        },
        # The OpenAI-compatible completions, named by their whole path (see `url_of`).
        "/oai/v1/completions": {
            "model": "treadle/tiny-1m",
            "prompt": "hello",
            "max_tokens": 2,
            "temperature": 1.0,
            "seed": 1,
            "stop": ["\n"],
        },
        "/oai/v1/chat/completions": {
            "model": ids.sampler_id,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 2,
            "top_p": 0.9,
            "logprobs": True,
        },
    }


def url_of(route: str) -> str:
    """The URL of a route `valid_bodies` names: a whole path, or one under /api/v1/."""
    return route if route.startswith("/") else f"/api/v1/{route}"


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every (path, leaf or container) inside a JSON value, depth first."""
    yield prefix, value
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*prefix, key))
    elif isinstance(value, list) and value:
        yield from _paths(value[0], (*prefix, 0))


def _replaced(body: Any, path: tuple[Any, ...], raw: str) -> bytes:
    """The body as JSON with the value at `path` replaced by the raw JSON text `raw`."""
    marker = "\u0000corpus-marker\u0000"
    mutated = copy.deepcopy(body)
    target = mutated
    for part in path[:-1]:
        target = target[part]
    target[path[-1]] = marker
    return json.dumps(mutated).replace(json.dumps(marker), raw).encode()


def _where(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def method_of(route: str) -> str:
    if route.endswith("/ttl") or "/aliases/" in route:
        return "PUT"
    if route.startswith("registry/packages/") and route.count("/") == 2:
        return "PATCH"  # a package's own route: its update
    return "POST"


def json_cases(route: str, body: dict[str, Any]) -> Iterator[Case]:
    """Broken variants of one valid JSON body."""
    for case in _json_cases(route, body):
        yield dataclasses.replace(case, method=method_of(route))


def _json_cases(route: str, body: dict[str, Any]) -> Iterator[Case]:
    text = json.dumps(body).encode()
    yield Case(f"{route}: empty body", route, b"")
    yield Case(f"{route}: truncated", route, text[: len(text) // 2])
    yield Case(f"{route}: not UTF-8", route, b'{"model_id": "\xff\xfe"}')
    yield Case(f"{route}: a list", route, b"[]")
    yield Case(f"{route}: null", route, b"null")
    yield Case(f"{route}: 20,000 levels deep", route, b"[" * 20_000 + b"]" * 20_000)
    yield Case(f"{route}: NaN at the top", route, b'{"x": NaN}')
    for path, value in _paths(body):
        if not path:
            continue
        where = _where(path)
        yield Case(
            f"{route}: {where} nested deep", route, _replaced(body, path, "[" * 5000 + "]" * 5000)
        )
        if isinstance(value, bool) or value is None:
            yield Case(f"{route}: {where} as text", route, _replaced(body, path, '"yes"'))
        elif isinstance(value, int | float):
            for raw in (*HUGE_NUMBERS, *NON_FINITE, "-1", '"12"', "[]"):
                yield Case(f"{route}: {where}={raw}", route, _replaced(body, path, raw))
        elif isinstance(value, str):
            for odd in ODD_STRINGS:
                raw = json.dumps(odd)
                yield Case(f"{route}: {where}={raw[:20]}", route, _replaced(body, path, raw))
            yield Case(
                f"{route}: {where} 100 kB", route, _replaced(body, path, json.dumps(LONG_STRING))
            )
            yield Case(f"{route}: {where} as a number", route, _replaced(body, path, "7"))
        elif isinstance(value, dict | list):
            yield Case(f"{route}: {where} as a number", route, _replaced(body, path, "1"))
    for key in body:
        rest = {k: v for k, v in body.items() if k != key}
        yield Case(f"{route}: without {key}", route, json.dumps(rest).encode())


def _datum(loss_fn_inputs: dict[str, TensorData], tokens: list[int] = TOKENS) -> Datum:
    return Datum(model_input=ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_fn_inputs)


def _targets(tokens: list[int] = TOKENS) -> TensorData:
    return TensorData(data=tokens[1:], dtype="int64")


def poison_requests(run_id: str, seq_ids: Iterator[int]) -> dict[str, ForwardBackwardRequest]:
    """forward_backward requests the wire accepts but the engine cannot, or must not, run; each
    takes the next of `seq_ids`."""
    n = len(TOKENS) - 1

    def request(one: Datum, loss_fn: str = "cross_entropy") -> ForwardBackwardRequest:
        return ForwardBackwardRequest(
            model_id=run_id, seq_id=next(seq_ids), data=[one], loss_fn=loss_fn
        )

    def floats(values: list[float]) -> TensorData:
        return TensorData(data=values, dtype="float32")

    ppo_inputs = {
        "target_tokens": _targets(),
        "logprobs": floats([-1.0] * n),
        "advantages": floats([1.0] * n),
    }

    def sparse_weights(cols: int) -> TensorData:
        return TensorData(
            data=[],
            dtype="float32",
            shape=[n, cols],
            sparse_crow_indices=[0] * (n + 1),
            sparse_col_indices=[],
        )

    return {
        "sparse weights of 2**62 columns": request(
            _datum({"target_tokens": _targets(), "weights": sparse_weights(2**62)})
        ),
        "sparse weights of 2**40 columns": request(
            _datum({"target_tokens": _targets(), "weights": sparse_weights(2**40)})
        ),
        "weights one longer than the datum": request(
            _datum(
                {
                    "target_tokens": _targets(),
                    "weights": TensorData(data=[1.0] * (n + 1), dtype="float32"),
                }
            )
        ),
        "NaN weights": request(
            _datum(
                {
                    "target_tokens": _targets(),
                    "weights": TensorData(data=[float("nan")] * n, dtype="float32"),
                }
            )
        ),
        "target token outside the vocabulary": request(
            _datum(
                {
                    "target_tokens": TensorData(data=[10**12] * n, dtype="int64"),
                    "weights": TensorData(data=[1.0] * n, dtype="float32"),
                }
            )
        ),
        "negative input token": request(
            _datum(
                {
                    "target_tokens": _targets(),
                    "weights": TensorData(data=[1.0] * n, dtype="float32"),
                },
                [-5] * (n + 1),
            )
        ),
        "unknown loss": request(_datum({"target_tokens": _targets()}), loss_fn="no_such_loss"),
        "ppo without advantages": request(_datum({"target_tokens": _targets()}), loss_fn="ppo"),
        "ppo clip threshold above 1 for the low side": request(
            _datum({**ppo_inputs, "clip_low_threshold": floats([2.0] * n)}), loss_fn="ppo"
        ),
        "ppo clip threshold one longer than the datum": request(
            _datum({**ppo_inputs, "clip_high_threshold": floats([1.2] * (n + 1))}), loss_fn="ppo"
        ),
        "no datums": ForwardBackwardRequest(
            model_id=run_id, seq_id=next(seq_ids), data=[], loss_fn="cross_entropy"
        ),
    }


def zstd_bomb(expanded_bytes: int) -> bytes:
    """A few kilobytes of zstd that expand to `expanded_bytes` zeros."""
    return zstandard.ZstdCompressor(level=19).compress(b"\x00" * expanded_bytes)


def gzip_bomb(expanded_bytes: int) -> bytes:
    return gzip.compress(b"\x00" * expanded_bytes, compresslevel=9)


def forward_backward_cases(
    run_id: str, seq_ids: Iterator[int], max_request_bytes: int
) -> Iterator[Case]:
    """Broken protobuf bodies, compression bombs, and poison requests as the tinker SDK sends."""
    route = "forward_backward"
    good = encode_forward_backward_request(
        ForwardBackwardRequest.model_validate(
            {
                "model_id": run_id,
                "seq_id": next(seq_ids),
                "data": [datum(TOKENS)],
                "loss_fn": "cross_entropy",
            }
        )
    )
    proto = PROTOBUF_CONTENT_TYPE
    yield Case("protobuf: truncated", route, good[: len(good) // 2], proto)
    yield Case("protobuf: random bytes", route, bytes(range(256)) * 4, proto)
    yield Case("protobuf: zstd garbage", route, b"\x28\xb5\x2f\xfd" + b"\x01" * 64, proto, "zstd")
    yield Case("protobuf: gzip garbage", route, b"\x1f\x8b" + b"\x01" * 64, proto, "gzip")
    yield Case("protobuf: unknown encoding", route, good, proto, "br")
    bomb = max_request_bytes + (1 << 20)
    yield Case("zstd bomb past the request limit", route, zstd_bomb(bomb), proto, "zstd")
    yield Case("zstd bomb without the header", route, zstd_bomb(bomb), proto)
    yield Case("gzip bomb past the request limit", route, gzip_bomb(bomb), proto, "gzip")
    for name, request in poison_requests(run_id, seq_ids).items():
        yield Case(f"protobuf: {name}", route, encode_forward_backward_request(request), proto)
