"""A scripted in-memory Treadle server for the client's unit tests (an httpx MockTransport).

It implements just enough of the protocol for a training loop: client config, sessions,
create_model, get_info, forward_backward (protobuf in and out), optim_step, asample and
retrieve_future. Submissions are deduplicated on (target, seq_id) like the real server, and
every op that reaches it is logged, so tests can prove nothing ran twice. `faults` maps a
path to a list of failures to inject, consumed one per request:

* `"503"` - answer 503 before the op is recorded (the server never saw it);
* `"reset-after"` - record the op, then drop the connection (the client never sees the answer);
* `"connect"` - refuse the connection.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

import httpx

from treadle.types import ForwardBackwardOutput, SampledSequence, SampleResponse, TensorData
from treadle.wire import (
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)

PROTO = "application/x-protobuf"


@dataclasses.dataclass
class Op:
    path: str
    target: str
    seq_id: int | None
    request_id: str
    body: Any


@dataclasses.dataclass
class FakeServer:
    faults: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    chunk_len: int | None = None
    ops: list[Op] = dataclasses.field(default_factory=list)
    posts: list[tuple[str, int | None]] = dataclasses.field(default_factory=list)
    results: dict[str, httpx.Response] = dataclasses.field(default_factory=dict)
    pending_polls: dict[str, int] = dataclasses.field(default_factory=dict)
    dedupe: dict[tuple[str, int | None], str] = dataclasses.field(default_factory=dict)
    heartbeats: int = 0
    finished: list[str] = dataclasses.field(default_factory=list)
    _ids: Any = dataclasses.field(default_factory=lambda: itertools.count(1))

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def executed_seq_ids(self, target: str) -> list[int | None]:
        return [op.seq_id for op in self.ops if op.target == target]

    # -- dispatch ---------------------------------------------------------------------------

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path.removeprefix("/api/v1")
        fault = self.faults.get(path, []).pop(0) if self.faults.get(path) else None
        if fault == "503":
            return httpx.Response(503, json={"detail": "injected outage", "category": "server"})
        if fault == "connect":
            raise httpx.ConnectError("injected: connection refused", request=request)
        response = self._answer(path, request)
        if fault == "reset-after":
            raise httpx.RemoteProtocolError("injected: connection reset", request=request)
        return response

    def _answer(self, path: str, request: httpx.Request) -> httpx.Response:
        if path == "/client/config":
            config: dict[str, Any] = {}
            if self.chunk_len is not None:
                config["fwdbwd_max_chunk_len"] = self.chunk_len
            return httpx.Response(200, json=config)
        if path == "/create_session":
            return httpx.Response(200, json={"session_id": "s1"})
        if path == "/session_heartbeat":
            self.heartbeats += 1
            return httpx.Response(200, json={})
        if path.startswith("/sessions/") and path.endswith("/finish"):
            self.finished.append(path.split("/")[2])
            return httpx.Response(200, json={"session_id": "s1", "status": "finished"})
        if path == "/get_info":
            model_id = json.loads(request.content)["model_id"]
            return httpx.Response(
                200,
                json={"model_id": model_id, "model_data": {"model_name": "tiny"}, "lora_rank": 4},
            )
        if path == "/retrieve_future":
            return self._retrieve(json.loads(request.content)["request_id"], request)
        if path == "/forward_backward":
            fb = decode_forward_backward_request(
                request.content, request.headers.get("content-encoding")
            )
            output = ForwardBackwardOutput(
                loss_fn_outputs=[
                    {
                        "logprobs": TensorData(
                            data=[-1.0] * len(d.model_input.to_ints()), dtype="float32"
                        )
                    }
                    for d in fb.data
                ],
                metrics={"loss:sum": float(len(fb.data)), "tokens:mean": float(fb.seq_id)},
            )
            result = httpx.Response(
                200, content=encode_forward_backward_output(output), headers={"content-type": PROTO}
            )
            return self._submit(path, fb.model_id, fb.seq_id, fb, result)
        body = json.loads(request.content)
        if path == "/create_sampling_session":
            return httpx.Response(
                200, json={"sampling_session_id": f"s1:sample:{body['sampling_session_seq_id']}"}
            )
        if path == "/create_model":
            model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
            return self._submit(
                path, model_id, 0, body, httpx.Response(200, json={"model_id": model_id})
            )
        if path == "/optim_step":
            result = httpx.Response(200, json={"metrics": {"grad_norm:mean": 1.0}})
            return self._submit(path, body["model_id"], body["seq_id"], body, result)
        if path == "/asample":
            sample = SampleResponse(
                sequences=[
                    SampledSequence(stop_reason="length", tokens=[7, 8], logprobs=[-0.5, -0.5])
                ]
                * body["num_samples"],
                prompt_logprobs=[None] + [-1.0] * (len(body["prompt"]["chunks"][0]["tokens"]) - 1),
            )
            result = httpx.Response(
                200, content=encode_sample_response(sample), headers={"content-type": PROTO}
            )
            response = self._submit(path, body["sampling_session_id"], body["seq_id"], body, result)
            request_id = response.json()["request_id"]
            return httpx.Response(
                200,
                json={
                    "request_id": request_id,
                    "sample_sequence_ids": [
                        f"{request_id}:{i}" for i in range(body["num_samples"])
                    ],
                },
            )
        return httpx.Response(404, json={"detail": f"no route {path}", "category": "user"})

    def _submit(
        self, path: str, target: str, seq_id: int | None, body: Any, result: httpx.Response
    ) -> httpx.Response:
        self.posts.append((path, seq_id))
        key = (target, seq_id)
        if key not in self.dedupe:
            request_id = f"req-{next(self._ids)}"
            self.dedupe[key] = request_id
            self.ops.append(Op(path, target, seq_id, request_id, body))
            self.results[request_id] = result
            self.pending_polls[request_id] = 1  # answer try_again once, like a busy server
        return httpx.Response(200, json={"request_id": self.dedupe[key], "model_id": target})

    def _retrieve(self, request_id: str, request: httpx.Request) -> httpx.Response:
        if self.pending_polls.get(request_id, 0) > 0:
            self.pending_polls[request_id] -= 1
            return httpx.Response(
                200, json={"type": "try_again", "request_id": request_id, "queue_state": "active"}
            )
        result = self.results.get(request_id)
        if result is None:
            return httpx.Response(
                404, json={"detail": f"no request {request_id}", "category": "user"}
            )
        return httpx.Response(result.status_code, content=result.content, headers=result.headers)
